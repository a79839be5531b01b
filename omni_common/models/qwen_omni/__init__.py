"""Qwen2.5-Omni: thinker -> talker -> token2wav DiT -> vocoder, streamed across the stages."""

from omni_common.models.qwen_omni.config_warnings import quiet_talker_id_warnings

# Every use of the family (a stage, a fixture build, a test) reads talker configs.
quiet_talker_id_warnings()
