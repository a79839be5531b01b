python3 benchmarks/ar_decode_gpu.py --concurrency 1 8 --new-tokens 64 --skip attention eager generate --parts agreement
