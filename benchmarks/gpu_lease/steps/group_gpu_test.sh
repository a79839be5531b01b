# 1 GPU: a replica over one GPU worker process (the server's steps sent ahead, the worker
# launching step k+1 before answering step k) against one GPU in process, eager and compiled,
# with and without CFG, on the tiny fixture.
timeout 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_multi_device_gpu.py -k "1]" --durations=5 2>&1 | grep -v "registered at\|fallthrough" | tail -25
