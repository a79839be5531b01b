# 2 GPUs at 512, every request spread (--parallel-mode sequence-parallel) against one GPU, with
# and without CFG: whether spreading a lone 512x512 request beats keeping it on one rank (auto).
python3 benchmarks/multi_gpu.py --model /tmp/qi --sizes 512 --runs 3 --one-gpu-eager 0 --concurrent 0 --diffusers-modes --parallel-mode sequence-parallel --logs /tmp/res/multi-logs
