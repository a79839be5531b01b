python3 benchmarks/token2wav_gpu.py --model /tmp/omni --batch 1 8 --modes eager graphs:tf32 compiled:tf32
