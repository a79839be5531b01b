#!/usr/bin/env bash
# Set up, start the local cluster (docker-compose.yml's services as local processes),
# generate one image, save it, print its path, stop the cluster (KEEP=1: keep it up for the
# page at http://127.0.0.1:8000/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
PROMPT=${1:-"a handwritten digit seven"}
OUT=${OUT:-out/demo.png}

# Every hop is TLS: a local CA and one certificate per service (kept; cluster up would make them too).
.venv/bin/omnistage certs "${OMNISTAGE_SECRETS:-.secrets}/tls" >/dev/null
.venv/bin/omnistage cluster up --logs out/logs &
CLUSTER=$!
trap 'kill -INT $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true' EXIT
# The default model (models/qwen-image-digits) draws 32x32 digits; ask for others by name.
.venv/bin/omnistage generate "$PROMPT" -o "$OUT" --width 32 --height 32 --steps 20 \
  --guidance 1 --seed "${SEED:-0}" --wait-ready 300 --ca-cert "${OMNISTAGE_SECRETS:-.secrets}/tls/ca.pem"
# KEEP=1: leave the cluster up and try more prompts on the gateway's page (Ctrl-C stops it).
if [ "${KEEP:-0}" = 1 ]; then
  echo "try it in a browser: http://127.0.0.1:8000/  (Ctrl-C stops the cluster)"
  wait $CLUSTER
fi
