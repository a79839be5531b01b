#!/usr/bin/env bash
# Set up, start the local cluster (docker-compose.yml's services as local processes),
# generate one image, save it, print its path, stop the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
PROMPT=${1:-"a red apple on a wooden table"}
OUT=${OUT:-out/demo.png}

.venv/bin/omnistage cluster up --logs out/logs &
CLUSTER=$!
trap 'kill -INT $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null || true' EXIT
.venv/bin/omnistage generate "$PROMPT" -o "$OUT" --width 256 --height 256 --steps 20 \
  --wait-ready 300
