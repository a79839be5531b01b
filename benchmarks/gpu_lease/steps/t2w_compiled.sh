# token2wav alone at real size, the DiT's forward compiled (the stage's default on a GPU) in TF32
# and in bf16: an interval's kernels one window at a time, then windows 4 together, 1 and 8 utterances.
python3 benchmarks/token2wav_gpu.py --model /tmp/omni --batch 1 8 --max-open 1 --modes compiled:tf32 compiled:bf16 --profile 12
