# The 2-GPU replica at 1024 with one request a setting profiled on the server and on each rank
# (benchmarks/rank_profile.py's summary per rank); no 1-GPU baseline, no diffusers.
python3 benchmarks/multi_gpu.py --model /tmp/qi --gpus 2 --sizes 1024 --runs 2 --one-gpu-eager 0 --concurrent 0 --diffusers-modes --profile /tmp/res/profiles --logs /tmp/res/multi-logs
