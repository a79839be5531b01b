# 2 GPUs: the replica's sequence-parallel forwards compiled and replayed as CUDA graphs (the
# all-to-alls captured inside) against one GPU, with and without CFG, on the tiny fixture.
timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_multi_device_gpu.py -k "compiled and 2-spread" --durations=5 2>&1 | grep -v "registered at\|fallthrough" | tail -25
