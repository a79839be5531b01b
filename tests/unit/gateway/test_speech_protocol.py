"""The gateway's translation of speech, chat and edit bodies and of hostile JSON, without a
cluster: every refusal is 400 with its field in `param`, a coordinator's refusal is tied to
the HTTP field it is about, a form becomes the JSON API's document."""

from __future__ import annotations

import io
import wave

import grpc
import pytest

from omni_common.errors import InvalidArgument, NotFound, OmniError
from omnistage.v1 import coordinator_pb2 as cpb
from services.gateway.audio_files import wav_header
from services.gateway.forms import form_document, parse_form
from services.gateway.protocol import (
    IMAGE_FIELDS,
    BadField,
    blame,
    error_body,
    image_job,
    parse_json,
    parse_size,
)
from services.gateway.speech import CHAT_FIELDS, SPEECH_FIELDS, chat_job, refused, speech_job


@pytest.mark.parametrize("size", ["²x²", "１６x１６", "16x٣"])
def test_unicode_digits_are_not_a_size(size: str) -> None:
    with pytest.raises(BadField) as bad:
        parse_size(size)
    assert bad.value.param == "size"


@pytest.mark.parametrize("field", ["prompt", "negative_prompt", "model"])
def test_a_lone_surrogate_is_400_about_its_field(field: str) -> None:
    doc = parse_json(b'{"prompt": "a cat", "' + field.encode() + b'": "x\\ud800y"}')
    with pytest.raises(BadField) as bad:
        image_job(doc, max_images=4)
    assert bad.value.param == field


def test_json_nested_100000_deep_is_400() -> None:
    with pytest.raises(InvalidArgument, match="too deep"):
        parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_a_guidance_past_float_range_is_400() -> None:
    with pytest.raises(BadField) as bad:
        image_job({"prompt": "a cat", "guidance_scale": 10**400}, max_images=4)
    assert bad.value.param == "guidance_scale"


@pytest.mark.parametrize(
    ("err", "param"),
    [
        (InvalidArgument("width is 33; it must be a multiple of 16"), "size"),
        (InvalidArgument("qwenimage models take no negative prompt"), "negative_prompt"),
        (InvalidArgument("model 'm' takes 0 input images; got 1"), "image"),
        (InvalidArgument("input image 0 is not a readable image; send a PNG file"), "image"),
        (NotFound("unknown model 'x'"), "model"),
        (OmniError("busy", grpc.StatusCode.RESOURCE_EXHAUSTED), None),
    ],
)
def test_a_coordinator_refusal_names_the_http_field(err: OmniError, param: str | None) -> None:
    _, body, _ = error_body(blame(err, IMAGE_FIELDS))
    assert body["error"]["param"] == param and body["error"]["message"] == err.message


def test_voice_refusals_name_voice_or_audio_voice() -> None:
    unknown = InvalidArgument("unknown speaker 'Nobody'; this model has Chelsie, Ethan")
    assert getattr(refused(unknown, SPEECH_FIELDS), "param", None) == "voice"
    assert getattr(refused(unknown, CHAT_FIELDS), "param", None) == "audio.voice"
    image_model = InvalidArgument("qwenimage has no option 'audio'; its options: none")
    said = refused(image_model, SPEECH_FIELDS)
    assert getattr(said, "param", None) == "model" and "does not write or speak" in said.message


def test_speech_becomes_a_pcm16_chat_request_with_the_voice_and_options() -> None:
    job = speech_job({"input": "hi", "voice": "Ethan", "seed": 3, "options": {"talker_max_new_tokens": 50}})
    params = job.request.params
    assert (params.prompt, params.seed, job.response_format, job.sse) == ("hi", 3, "wav", False)
    assert dict(params.options) == {
        "audio": "1",
        "stream_audio": "1",
        "speaker": "Ethan",
        "talker_max_new_tokens": "50",
    }
    assert job.request.audio_format == cpb.AUDIO_FORMAT_PCM16


def test_chat_takes_one_user_turn_and_its_modalities() -> None:
    job = chat_job(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                }
            ],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "wav"},
            "max_completion_tokens": 20,
        }
    )
    assert job.speaks and job.audio_format == "wav" and not job.stream
    assert job.request.params.prompt == "hi there"
    assert job.request.params.options["max_new_tokens"] == "20"
    written = chat_job({"messages": [{"role": "user", "content": "hi"}]})
    assert not written.speaks and written.request.params.options["audio"] == "0"


def test_a_wav_header_with_its_length_is_a_wav_file() -> None:
    pcm = b"\x01\x00\xff\xff" * 10
    with wave.open(io.BytesIO(wav_header(24_000, len(pcm)) + pcm)) as wav:
        assert (wav.getframerate(), wav.getnframes(), wav.readframes(100)) == (24_000, 20, pcm)


def form(*parts: tuple[str, bytes]) -> tuple[str, bytes]:
    body = b"".join(
        b'--B\r\nContent-Disposition: form-data; name="' + name.encode() + b'"\r\n\r\n' + value + b"\r\n"
        for name, value in parts
    )
    return "multipart/form-data; boundary=B", body + b"--B--\r\n"


def test_a_form_gives_its_fields_typed_and_its_images_in_order() -> None:
    binary = b"\x89PNG\r\n\x1a\n--B is no delimiter without a CRLF before it\r\n\x00\xff"
    fields, images = parse_form(
        *form(("prompt", b"make it red"), ("image[]", binary), ("image[]", b"2"), ("n", b"2"))
    )
    assert images == [binary, b"2"]
    assert form_document(fields) == {"prompt": "make it red", "n": 2}


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/json", b"{}"),
        ("multipart/form-data", b"--B--\r\n"),  # no boundary
        (
            "multipart/form-data; boundary=B",
            b'--B\r\nContent-Disposition: form-data; name="a"\r\n\r\nx',
        ),  # cut
    ],
)
def test_a_broken_form_is_400(content_type: str, body: bytes) -> None:
    with pytest.raises(InvalidArgument):
        parse_form(content_type, body)


@pytest.mark.parametrize(
    ("field", "text"), [("n", "²"), ("n", "--5"), ("guidance_scale", "much"), ("stream", "yes")]
)
def test_a_forms_bad_number_is_400_about_its_field(field: str, text: str) -> None:
    with pytest.raises(BadField) as bad:
        form_document({field: text})
    assert bad.value.param == field
