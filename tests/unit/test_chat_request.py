"""The SDK's chat requests: a prompt or a conversation, input clips, images and videos as InputMedia,
and `audio=True/False` keeping its first meaning (whether the reply is spoken)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omni_common.audio_input import wav_bytes
from omni_common.chat import chat_request
from omni_common.media import Video
from omnistage.v1 import coordinator_pb2 as cpb


def test_a_bool_audio_still_says_whether_the_reply_is_spoken() -> None:
    assert chat_request("hi", audio=False).params.options["audio"] == "0"
    assert chat_request("hi").params.options["audio"] == "1"
    assert chat_request("hi", speak=False).params.options["audio"] == "0"


def test_clips_and_images_become_input_media_in_order(tmp_path) -> None:
    wav = wav_bytes(np.zeros(4, np.int16), 16_000)
    path = tmp_path / "in.wav"
    path.write_bytes(wav)
    request = chat_request("hi", audio=[path, (np.ones(3, np.float32), 8000)], images=[b"png-bytes"])
    kinds = [item.WhichOneof("media") for item in request.inputs]
    assert kinds == ["audio", "audio", "image"]
    first, second = request.inputs[0].audio, request.inputs[1].audio
    assert first.data == wav and first.format == cpb.AUDIO_INPUT_FORMAT_WAV
    assert second.format == cpb.AUDIO_INPUT_FORMAT_FLOAT32 and second.sample_rate == 8000
    assert len(chat_request("hi", audio=wav).inputs) == 1  # one clip on its own


def test_a_conversation_becomes_chat_messages() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "audio", "audio": 0}, {"type": "text", "text": "And?"}]},
    ]
    params = chat_request(messages, audio=[wav_bytes(np.zeros(4, np.int16), 16_000)]).params
    assert params.prompt == ""
    assert [m.role for m in params.messages] == ["system", "user"]
    assert [p.WhichOneof("part") for p in params.messages[1].parts] == ["audio", "text"]
    with pytest.raises(ValueError, match="text, audio, image or video"):
        chat_request([{"role": "user", "content": [{"type": "file", "file": 0}]}])


def test_videos_become_input_media_after_the_images_and_parts_name_them() -> None:
    still = Image.new("RGB", (4, 4))
    one = Video([still, b"frame-bytes"], 2.0)
    turns = [{"role": "user", "content": [{"type": "video", "video": 1}, {"type": "video", "video": 0}]}]
    request = chat_request(turns, images=[b"png-bytes"], video=[one, Video([b"x"], 0.5)])
    kinds = [item.WhichOneof("media") for item in request.inputs]
    assert kinds == ["image", "video", "video"]
    first = request.inputs[1].video
    assert first.fps == 2.0 and first.frames[1] == b"frame-bytes" and first.frames[0][:4] == b"\x89PNG"
    assert [part.video for part in request.params.messages[0].parts] == [1, 0]
    assert len(chat_request("hi", video=one).inputs) == 1  # one video on its own
