# As multi_gpu2_1024, with dynamo's automatic dynamic shapes off in every process: the spread
# blocks compile a static graph per prompt length (as before e1e4e25) instead of one dynamic
# graph. Run both on one lease to see which the 2-GPU replica's 1024 request pays for.
TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0 python3 benchmarks/multi_gpu.py --model /tmp/qi --gpus 2 --sizes 1024 --runs 3 --one-gpu-eager 0 --concurrent 0 --diffusers-modes --logs /tmp/res/multi-logs-static
