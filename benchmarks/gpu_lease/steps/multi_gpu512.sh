# 2 GPUs at 512 only, no diffusers: one replica over both against one GPU, a lone request with and
# without CFG (never slower, target <= 1.0) and 8 at once (images/s, target >= 1.9x).
python3 benchmarks/multi_gpu.py --model /tmp/qi --sizes 512 --runs 3 --one-gpu-eager 0 --concurrent 8 --diffusers-modes --logs /tmp/res/multi-logs
