# 2 GPUs against one, a replica that serves both sizes (--capture-sizes 1024x1024,512x512): the
# starts, a lone request at each size with and without CFG, and 8 at once at 512x512.
python3 benchmarks/multi_gpu.py --model /tmp/qi --sizes 1024 512 --runs 3 --one-gpu-eager 0 --concurrent 8 --diffusers-modes --logs /tmp/res/multi-logs
