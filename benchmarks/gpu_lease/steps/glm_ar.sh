# GLM-Image's AR prior alone at 1, 8 and 32 rows against its floor, at the stage's 64 slots.
python3 benchmarks/ar_decode_gpu.py --concurrency 1 8 32 --skip attention thinker --parts glm
