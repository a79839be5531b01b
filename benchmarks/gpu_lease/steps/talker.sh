# The talker alone at real size: its graphed step per code at 1 and 8 rows against the floor,
# and the kernels of one step (the thinker's parts skipped).
python3 benchmarks/ar_decode_gpu.py --concurrency 1 8 --new-tokens 256 --skip attention thinker --parts talker profile
