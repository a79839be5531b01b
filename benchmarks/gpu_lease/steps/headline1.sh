# Qwen-Image on one GPU at 1024 through the cluster, against diffusers' regional compile.
python3 benchmarks/multi_gpu.py --model /tmp/qi --gpus 1 --sizes 1024 --runs 2 --one-gpu-eager 0 --concurrent 0 --diffusers-modes regional --logs /tmp/res/headline-logs
