"""Silence one false warning of transformers about every Qwen2.5-Omni config.

transformers (5.x) checks that each `*_token_id` of a config lies in its text vocabulary.
The talker's text-side ids (tts_text_*, audio_*, vision_*) are ids of the *thinker's*
vocabulary, which the talker reads as text; its own vocabulary is the codec's (8448 tokens).
So every talker config, the real checkpoint's and the class defaults' that `save_pretrained`
and `from_pretrained` compare against alike, logs seven warnings that say nothing wrong: a
fixture build printed them, and every stage log repeated them. Only those seven are dropped;
any other id out of range still warns.
"""

from __future__ import annotations

import logging
import re

# The ids transformers' check misreads: thinker-vocabulary ids carried by the talker config.
_THINKER_IDS = re.compile(
    r"^Model config: (tts_text_(start|end|pad)|audio_(start|end)|vision_(start|end))_token_id "
    r"must be `None` or an integer within the vocabulary"
)


class _TalkerIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _THINKER_IDS.match(record.getMessage())


_FILTER = _TalkerIdFilter()


def quiet_talker_id_warnings() -> None:
    """Install the filter on transformers' config logger (once; logging keeps one copy)."""
    # A filter on the logger that logs the record: filters of parent loggers never see it.
    logging.getLogger("transformers.configuration_utils").addFilter(_FILTER)
