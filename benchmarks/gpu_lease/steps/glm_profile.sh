# GLM-Image's AR prior alone at 1 and 8 rows, and the kernels of its step at each: why one row
# steps slower than eight.
python3 benchmarks/ar_decode_gpu.py --concurrency 1 8 --skip attention thinker --parts glm profile
