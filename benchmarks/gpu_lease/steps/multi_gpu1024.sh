# 2 GPUs at 1024 only, no diffusers: one replica over both against one GPU, with and without CFG.
python3 benchmarks/multi_gpu.py --model /tmp/qi --sizes 1024 --runs 3 --one-gpu-eager 0 --concurrent 0 --diffusers-modes --logs /tmp/res/multi-logs
