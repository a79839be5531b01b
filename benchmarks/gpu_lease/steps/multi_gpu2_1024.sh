# The 2-GPU replica alone at 1024 (no 1-GPU baseline, no diffusers: the shortest 2-GPU lease;
# compare with a 1-GPU run of the same tree).
python3 benchmarks/multi_gpu.py --model /tmp/qi --gpus 2 --sizes 1024 --runs 3 --one-gpu-eager 0 --concurrent 0 --diffusers-modes --logs /tmp/res/multi-logs
