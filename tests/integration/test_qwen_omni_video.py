"""Qwen2.5-Omni sees video, through real gRPC servers and shared memory: a reply to text plus a
video's frames equals transformers' processor + `generate` on the same frames bit for bit (text
and waveform, fp32, CPU); hostile videos are INVALID_ARGUMENT with a message that says which
limit, and the service stays up; the prefix cache keys a conversation by its videos' content,
so the same words over another video are not a hit; `omnistage speak` sends a GIF's frames or
a list of frame files."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omni_common.client import Client
from omni_common.cluster import free_port
from omni_common.errors import InvalidArgument
from omni_common.media import Video
from omni_common.models.qwen_omni.reference import reference_generate
from omnistage_cli import main as cli
from tests.integration.conftest import InProcessCluster
from tests.integration.test_qwen_omni_media import CAPS, PROMPT, clip, picture, prefix_hits

FPS = 2.0


def frames(count: int = 4, width: int = 56, height: int = 56, seed: int = 0) -> list[bytes]:
    """`count` PNG frames of noise drifting to the right, one size."""
    base = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return [png(np.roll(base, 4 * i, axis=1)) for i in range(count)]


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def blank(width: int, height: int) -> bytes:
    return png(np.zeros((height, width, 3), np.uint8))


@pytest.fixture(scope="module")
def omni(omni_model: Path) -> Iterator[InProcessCluster]:
    running = InProcessCluster(omni_model, stage_options={"ar-encoder": {"metrics_port": free_port()}})
    running.start()
    yield running
    running.stop()


@pytest.mark.parametrize("media", ["video", "all"])
def test_a_reply_to_text_and_video_equals_the_processor_and_generate(
    omni: InProcessCluster, omni_model: Path, media: str
) -> None:
    video = frames(5)  # odd: the last frame fills the third temporal patch
    rate = 0.5  # not the processor's default (2): the rate must reach the rope positions
    audios, images = ([clip()], [picture()]) if media == "all" else ([], [])
    with Client(omni.coordinator) as client:
        reply = client.speak(
            PROMPT,
            audio=audios,
            images=images,
            video=Video(video, rate),
            seed=5,
            stream_audio=False,
            options=CAPS,
        )
    ref = reference_generate(
        omni_model,
        PROMPT,
        audios=audios,
        images=images,
        videos=[(video, rate)],
        seed=5,
        thinker_max_new_tokens=12,
        talker_max_new_tokens=40,
    )
    assert reply.text == ref.text
    np.testing.assert_array_equal(reply.audio, ref.waveform.numpy())


def test_the_frames_and_their_rate_change_the_reply(omni: InProcessCluster) -> None:
    with Client(omni.coordinator) as client:
        replies = [
            client.speak(PROMPT, video=video, seed=5, speak=False, options=CAPS).text
            for video in (Video(frames(seed=1), FPS), Video(frames(seed=2), FPS), Video(frames(seed=1), 0.5))
        ]
        plain = client.speak(PROMPT, seed=5, speak=False, options=CAPS).text
    assert len({*replies, plain}) > 1


@pytest.mark.parametrize(
    ("video", "message"),
    [
        (Video([], FPS), "input video 0 has no frames"),
        (Video([blank(28, 28)] * 257, FPS), "257 frames; the limit is 256"),
        (Video(frames(2), 0.0), "fps 0; allowed: [0.1, 60]"),
        (Video(frames(2), 120.0), "fps 120; allowed: [0.1, 60]"),
        (Video(frames(2), float("nan")), "fps nan"),
        (Video([frames(1)[0], b"not an image at all"], FPS), "input video 0 frame 1 is not a readable image"),
        (Video([blank(56, 56), blank(84, 56)], FPS), "frame 1 is 84x56, frame 0 56x56"),
        (Video([frames(1)[0][:100]], FPS), "input video 0 frame 0 could not be decoded"),
        (Video([blank(4096, 1100)], FPS), "frame 0 is 4096x1100 = 4505600 pixels"),
        (Video([blank(2048, 2048)] * 17, FPS), "= 71303168 pixels; the limit is 67108864"),
    ],
    ids=[
        "no-frames",
        "too-many-frames",
        "fps-0",
        "fps-over",
        "fps-nan",
        "not-an-image",
        "two-sizes",
        "truncated-frame",
        "frame-over-pixels",
        "over-total-pixels",
    ],
)
def test_hostile_video_is_invalid_argument_and_the_service_stays_up(
    omni: InProcessCluster, video: Video, message: str
) -> None:
    with Client(omni.coordinator) as client:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            client.speak(PROMPT, video=video, seed=5, speak=False, options=CAPS)
        assert client.speak(PROMPT, seed=5, speak=False, options=CAPS).text is not None


def test_too_many_videos_and_unshown_videos_are_refused(omni: InProcessCluster) -> None:
    one = Video(frames(2), FPS)
    with Client(omni.coordinator) as client:
        with pytest.raises(InvalidArgument, match="at most 4 videos; got 5"):
            client.speak(PROMPT, video=[one] * 5, speak=False, options=CAPS)
        turns = [{"role": "user", "content": [{"type": "video", "video": 1}, {"type": "text", "text": "hi"}]}]
        with pytest.raises(InvalidArgument, match="shows video 1; the request has 1"):
            client.speak(turns, video=one, speak=False, options=CAPS)


def first_turn() -> list[dict[str, object]]:
    content = [{"type": "video", "video": 0}, {"type": "text", "text": "Hello, who are you?"}]
    return [{"role": "user", "content": content}]


def test_a_conversation_over_another_video_is_not_a_prefix_hit(
    omni: InProcessCluster, omni_model: Path
) -> None:
    other_frames = frames(seed=4)
    seen, other = Video(frames(seed=3), FPS), Video(other_frames, FPS)
    with Client(omni.coordinator) as client:
        first = client.speak(first_turn(), video=seen, seed=9, speak=False, options=CAPS)
        history = [*first_turn(), {"role": "assistant", "content": first.text}]
        history.append({"role": "user", "content": "Tell me a short story."})
        hits = prefix_hits(omni)
        client.speak(history, video=seen, seed=9, speak=False, options=CAPS)
        assert prefix_hits(omni) == hits + 1  # the same video: turn 1's KV is reused
        elsewhere = client.speak(history, video=other, seed=9, stream_audio=False, options=CAPS)
        assert prefix_hits(omni) == hits + 1  # the same words over other frames: computed anew
    ref = reference_generate(
        omni_model,
        messages=history,
        videos=[(other_frames, FPS)],
        seed=9,
        thinker_max_new_tokens=12,
        talker_max_new_tokens=40,
    )
    assert elsewhere.text == ref.text
    np.testing.assert_array_equal(elsewhere.audio, ref.waveform.numpy())


def test_the_speak_command_sends_a_gifs_frames_and_a_list_of_frames(
    omni: InProcessCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pictures = [Image.open(io.BytesIO(frame)) for frame in frames(4, seed=6)]
    gif = tmp_path / "clip.gif"
    pictures[0].save(gif, save_all=True, append_images=pictures[1:], duration=500, loop=0)
    paths = []
    for i, still in enumerate(pictures):
        paths.append(tmp_path / f"{i}.png")
        still.save(paths[-1])
    caps = [f"--option={name}={value}" for name, value in CAPS.items()]
    base = ["speak", PROMPT, "--address", omni.coordinator, "--seed", "3", "--option", "audio=0", *caps]
    assert cli.main([*base, "--video", str(gif), "--quiet"]) == 0
    from_gif = capsys.readouterr().out
    assert cli.main([*base, "--video-frames", *map(str, paths), "--fps", "2", "--quiet"]) == 0
    from_frames = capsys.readouterr().out
    with Client(omni.coordinator) as client:
        gif_reply = client.speak(PROMPT, video=Video.open(gif), seed=3, audio=False, options=CAPS)
        frames_reply = client.speak(PROMPT, video=Video(paths, FPS), seed=3, audio=False, options=CAPS)
    assert from_gif.startswith(gif_reply.text + "\n")
    assert from_frames.startswith(frames_reply.text + "\n")
    assert cli.main([*base, "--video", str(paths[0].with_suffix(".missing"))]) == 1
