#!/usr/bin/env bash
# Set up an omnistage environment from a lock file, on a machine with only Python 3.11+ and pip.
#
#   bash scripts/setup.sh          .venv       requirements.lock   (what the cluster runs)
#   bash scripts/setup.sh test     .venv       requirements-test.lock  (the same pins + test tools)
#   bash scripts/setup.sh vllm     .venv-vllm  requirements-vllm.lock  (the optional vLLM backend)
#   bash scripts/setup.sh canary   .venv-canary the newest releases pyproject.toml allows
#
# Locked environments install exact versions with hashes (`pip install --require-hashes
# --no-deps`): the tests run on exactly what the run command serves. Idempotent: a second run
# checks a stamp of the lock's hash and installs nothing. A lock that changed rebuilds the
# environment from scratch, so nothing of an older lock stays behind.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${1:-run}
PYTHON=${PYTHON:-python3}
case "$PROFILE" in
  run) VENV=.venv; LOCKS=(requirements.lock) ;;
  test) VENV=.venv; LOCKS=(requirements.lock requirements-test.lock) ;;
  vllm) VENV=.venv-vllm; LOCKS=(requirements-vllm.lock) ;;
  canary) VENV=.venv-canary; LOCKS=() ;;
  *) echo "usage: scripts/setup.sh [run|test|vllm|canary]" >&2; exit 2 ;;
esac

say() { printf '[setup %s] %s\n' "$PROFILE" "$*"; }
# pip's own lines, less this machine's notes about unused local indexes: one line a package.
pip_progress() { grep --line-buffered -E '^(Collecting|Processing|Successfully|ERROR)' || true; }
lock_hash() { cat "$@" | sha256sum | cut -c1-16; }
one_line() { tr '\n' ' ' <<<"$1" | sed 's/ *$//'; }

STAMP=$VENV/.omnistage-locks
want=""
for lock in "${LOCKS[@]}"; do want+="$lock $(lock_hash "$lock")"$'\n'; done

if [ "$PROFILE" != canary ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ]; then
  have=$(cat "$STAMP")
  missing=0
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    grep -qxF "$line" <<<"$have" || missing=1
  done <<<"$want"
  # The project itself is installed after the locks: check that it got there too.
  if [ "$PROFILE" != vllm ] && [ ! -x "$VENV/bin/omnistage" ]; then missing=1; fi
  if [ "$missing" = 0 ]; then
    say "up to date: $(one_line "$want")"
    exit 0
  fi
  # A lock that this environment was built from has changed: start again from nothing.
  while IFS= read -r line; do
    lock=${line%% *}
    if [ -n "$line" ] && grep -q "^$lock " <<<"$want" && ! grep -qxF "$line" <<<"$want"; then
      say "$lock changed since $VENV was built: rebuilding it"
      rm -rf "$VENV"
      break
    fi
  done <<<"$have"
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
touch "$STAMP"

if [ "$PROFILE" = canary ]; then
  # torch stays at the lock's pin: it is the platform (the CPU wheel on this machine's disk), not
  # a library that drifts; everything else takes the newest release pyproject.toml allows.
  torch_pin=$(grep -oE '^torch==[^ ]+' requirements.lock)
  say "installing the newest allowed releases (with $torch_pin)"
  if ! "$VENV/bin/python" -m pip install --upgrade --upgrade-strategy eager "$torch_pin" -e ".[test]" \
    2>&1 | pip_progress; then
    say "pip could not install the newest allowed releases"; exit 1
  fi
  exit 0
fi

for lock in "${LOCKS[@]}"; do
  line="$lock $(lock_hash "$lock")"
  grep -qxF "$line" "$STAMP" && continue
  count=$(grep -cE '^[A-Za-z0-9_.-]+==' "$lock")
  say "installing $count locked packages from $lock (the first time takes a few minutes)"
  if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --require-hashes --no-deps -r "$lock" \
    2>&1 | pip_progress; then
    say "pip failed installing $lock"; exit 1
  fi
  echo "$line" >>"$STAMP"
done

if [ "$PROFILE" = vllm ]; then
  # The vLLM environment runs this checkout from its folder (PYTHONPATH), not an installed copy.
  say "vLLM environment ready in $VENV ($(one_line "$want"))"
  exit 0
fi

# omnistage itself, editable, with the setuptools of the lock (no build isolation: nothing unpinned).
if ! "$VENV/bin/python" -c "import omnistage_cli.main" 2>/dev/null || [ ! -x "$VENV/bin/omnistage" ]; then
  say "installing omnistage (editable)"
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e . \
    2> >(grep -v '^WARNING: Location' >&2)
fi

if [ "$PROFILE" = test ]; then
  # docker-compose (Debian's package) validates docker-compose.yml without a Docker engine.
  if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
     && [ "$(id -u)" = 0 ]; then
    say "installing docker-compose (Debian) to validate docker-compose.yml"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) \
      >/dev/null 2>&1 || say "note: docker-compose could not be installed; its check will be skipped"
  fi
  # Debian's chromium: the browser that tests the gateway's try-it page in CI (Playwright drives
  # it; its own browser download is never used).
  if [ "${CI:-}" = true ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
     && [ "$(id -u)" = 0 ]; then
    say "installing chromium (Debian) for the page's browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
      >/dev/null 2>&1 || say "note: chromium could not be installed; the browser test will be skipped"
  fi
fi
say "omnistage is set up in $VENV ($(one_line "$want"))"
