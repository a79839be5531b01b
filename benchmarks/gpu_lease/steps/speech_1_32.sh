# Spoken replies at real size at concurrency 1 and 32 (issue 34's two targets), token2wav's DiT
# in bf16, the services' logs kept.
python3 benchmarks/speech.py --device cuda --model /tmp/omni --prompt-tokens 64 --rounds 2 --no-reference \
  --concurrency 1 32 --quantization bf16 --logs /tmp/res/speech-logs
