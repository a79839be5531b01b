# 2 GPUs: one replica over both against one GPU (1024 and 2048, with and without CFG).
python3 benchmarks/multi_gpu.py --model /tmp/qi --sizes 1024 2048 --runs 2 --one-gpu-eager 0 --concurrent 0 --logs /tmp/res/multi-logs
