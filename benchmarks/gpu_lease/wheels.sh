#!/usr/bin/env bash
# Download, here, the wheels a GPU machine of this workplace lacks (its image has torch, numpy,
# safetensors, tokenizers and pillow, and transformers 5.17, below pyproject's floor) into .whl/,
# which git ignores and a device call carries: `carry: [".whl"]`. The versions are requirements.lock's.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  diffusers==0.42.1 transformers==5.24.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  protobuf==7.36.2 importlib_metadata==10.2.0 zipp==4.1.2 soundfile==0.14.0 cffi==2.1.1 \
  pycparser==3.12 uvicorn==0.54.0 h11==0.16.0 starlette==1.10.0 anyio==4.16.0 click==8.5.1 \
  idna==3.20 certifi==2026.10.19.post1 uvloop==0.23.0 prometheus-client==0.26.0 2>&1 | grep -v "is ignored" || true
du -sh .whl
