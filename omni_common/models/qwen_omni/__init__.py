"""Qwen2.5-Omni: thinker -> talker -> token2wav DiT -> vocoder, streamed across the stages."""
