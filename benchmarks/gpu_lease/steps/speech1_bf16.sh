# The c=1 spoken reply (as speech1) with token2wav's DiT in bfloat16 (dit-denoise's --quantization
# bf16), its windows solved together where the talker gets ahead.
python3 benchmarks/speech.py --device cuda --model /tmp/omni --prompt-tokens 64 --rounds 3 --no-reference --concurrency 1 --quantization bf16 --logs /tmp/res/speech-logs
