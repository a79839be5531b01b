# token2wav alone at real size: an interval's kernels, one window at a time (as the cluster's
# replies at c=1 solve them), TF32 and bf16 replayed as CUDA graphs; then windows 4 together.
python3 benchmarks/token2wav_gpu.py --model /tmp/omni --batch 1 --max-open 1 --modes graphs:tf32 graphs:bf16 eager:tf32 --profile 18
python3 benchmarks/token2wav_gpu.py --model /tmp/omni --batch 1 8 --modes graphs:tf32 graphs:bf16
