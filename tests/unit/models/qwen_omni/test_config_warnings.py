"""Building and loading a Qwen2.5-Omni config says nothing false: transformers' check of token
ids against the talker's codec vocabulary (the talker's text ids are the thinker's) is muted,
and only that."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from omni_common.models.qwen_omni.config_warnings import _TalkerIdFilter

REPO = Path(__file__).resolve().parents[3]
WARNING = (
    "Model config: {} must be `None` or an integer within the vocabulary (between 0 and 8447), got 151860."
)


def passes(message: str) -> bool:
    record = logging.LogRecord(
        "transformers.configuration_utils", logging.WARNING, "", 0, message, None, None
    )
    return _TalkerIdFilter().filter(record)


def test_only_the_talkers_thinker_vocabulary_ids_are_muted() -> None:
    for name in (
        "tts_text_start_token_id",
        "tts_text_pad_token_id",
        "audio_end_token_id",
        "vision_start_token_id",
    ):
        assert not passes(WARNING.format(name))
    assert passes(WARNING.format("pad_token_id"))  # a real problem still warns
    assert passes("some other warning")


def test_a_fixture_build_and_a_config_load_print_no_token_id_warning(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path\n"
        "from omni_common.models.qwen_omni.fixture import build_config, build_tokenizer\n"
        "from omni_common.models.qwen_omni.checkpoint import load_config\n"
        "build_config(build_tokenizer()).save_pretrained(sys.argv[1])\n"
        "load_config(Path(sys.argv[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert "must be `None` or an integer" not in done.stderr + done.stdout, done.stderr
