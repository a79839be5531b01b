# One spoken reply at a time, the thinker's rows fed to the talker a row per Feed against groups
# of 8 (option feed_tokens), alternating, token2wav's DiT in bf16, the services' logs kept.
python3 benchmarks/speech.py --device cuda --model /tmp/omni --prompt-tokens 64 --rounds 3 --no-reference \
  --concurrency 1 --feed-tokens 1 8 1 8 --quantization bf16 --logs /tmp/res/speech-logs-feeds
