# The talker alone (as the talker step) with its decode step compiled under inductor's
# max-autotune (Triton templates for the skinny products, searched at first use).
python3 benchmarks/ar_decode_gpu.py --concurrency 1 8 --new-tokens 256 --skip attention thinker --parts talker --compile-mode max-autotune-no-cudagraphs
