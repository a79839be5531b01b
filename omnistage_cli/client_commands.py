"""The commands a client of the coordinator runs: `generate`, `speak` and `models`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_common.errors import OmniError


def add_client_parsers(sub: Any) -> None:
    """`generate`, `speak` and `models`: what a client of the coordinator runs."""
    gen = sub.add_parser("generate", help="generate one image through a coordinator")
    gen.add_argument("prompt", help="what the image shows (an edit: what to change)")
    gen.add_argument("-o", "--output", default="out.png", help="the PNG file to write (default out.png)")
    _add_client_args(gen)
    gen.add_argument("--negative-prompt", default="", help="what the image should not show (true CFG)")
    for flag, what in (("--width", "width"), ("--height", "height")):
        gen.add_argument(
            flag, type=int, default=None, help=f"image {what} in pixels (default: the model's own)"
        )
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's own)")
    gen.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's own)")
    gen.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="input image (repeatable), for models that take them: GLM-Image edits",
    )
    gen.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME[:SCALE]",
        help="a LoRA adapter of the DiT (repeatable, applied in order); `omnistage lora list` names them",
    )
    _add_request_args(gen)
    gen.set_defaults(func=_generate)

    speak = sub.add_parser("speak", help="chat with a speaking model (Qwen2.5-Omni): text out, WAV file")
    speak.add_argument("prompt", help="what to say to the model")
    speak.add_argument(
        "-o",
        "--output",
        default="reply.wav",
        help="the WAV file of the spoken reply (default reply.wav; none with --option audio=0)",
    )
    _add_client_args(speak)
    speak.add_argument("--speaker", default=None, help="the voice (default: the model's first, Chelsie)")
    speak.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="FILE",
        help="an audio clip the model hears before the prompt (repeatable): WAV or FLAC "
        "(16 kHz for Qwen2.5-Omni)",
    )
    speak.add_argument(
        "--image", action="append", default=[], metavar="FILE", help="an image the model sees (repeatable)"
    )
    speak.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE",
        help="a video the model sees (repeatable): an animated GIF, PNG or WebP, its frames at the rate "
        "their durations give (no MP4: sample frames and pass them with --video-frames)",
    )
    speak.add_argument(
        "--video-frames",
        nargs="+",
        default=[],
        metavar="FILE",
        help="one video as its frames, image files in order, taken --fps times a second",
    )
    speak.add_argument(
        "--fps", type=float, default=2.0, help="the rate of --video-frames, frames a second (default 2)"
    )
    _add_request_args(speak)
    speak.set_defaults(func=_speak)

    models = sub.add_parser("models", help="list the models a coordinator serves, with their options")
    _add_client_args(models)
    models.set_defaults(func=_models)


def _generate(args: argparse.Namespace) -> int:
    from omni_common.client import ResultBuilder
    from omni_common.errors import OmniError

    options = dict(_parse_option(item) for item in args.option)
    with _client(args, args.timeout) as client:
        try:
            if args.wait_ready:
                client.wait_ready(args.wait_ready, model=args.model)
            builder = ResultBuilder()
            with _progress_bars() as bars:
                events = client.events(
                    args.prompt,
                    negative_prompt=args.negative_prompt,
                    width=args.width,
                    height=args.height,
                    steps=args.steps,
                    guidance=args.guidance,
                    seed=args.seed,
                    model=args.model,
                    image_format="png",
                    images=[Path(path) for path in args.image],
                    options=options,
                    loras=[_parse_lora(item) for item in args.lora],
                )
                for event in events:
                    builder.add(event)
                    if event.HasField("step"):
                        _advance(bars, "denoising", "step", event.step.step, event.step.total, args.quiet)
                    else:
                        _show_event(bars, event, args.quiet)
            result = builder.build()
        except OSError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        except OmniError as err:
            return _failed(err, args)
    out = _output_path(args)
    out.write_bytes(result.encoded)
    stages = ", ".join(f"{k} {v:.0f} ms" for k, v in result.stage_ms.items())
    print(
        f"saved {out.resolve()} ({result.image.width}x{result.image.height}, "
        f"{result.total_ms:.0f} ms: {stages})"
    )
    return 0


def _speak(args: argparse.Namespace) -> int:
    """One chat turn of a speaking model: the reply's text, and its audio as a WAV file."""
    from omni_common.chat import ReplyBuilder, SpeechChunk, chat_request
    from omni_common.errors import OmniError
    from omni_common.media import Video

    options = dict(_parse_option(item) for item in args.option)
    try:
        videos = [Video.open(path) for path in args.video]
        if args.video_frames:
            videos.append(Video([Path(path) for path in args.video_frames], args.fps))
        request = chat_request(
            args.prompt,
            audio=[Path(path) for path in args.audio],
            images=[Path(path) for path in args.image],
            video=videos,
            speaker=args.speaker,
            model=args.model,
            seed=args.seed,
            options=options,
        )
    except OSError as err:  # a file that cannot be read, or is no image
        print(f"error: {err}", file=sys.stderr)
        return 1
    with _client(args, args.timeout) as client:
        try:
            if args.wait_ready:
                client.wait_ready(args.wait_ready, model=args.model)
            builder = ReplyBuilder(time.perf_counter())
            with _progress_bars() as bars:
                for event in client.stream(request, args.timeout):
                    piece = builder.add(event, time.perf_counter())
                    if isinstance(piece, SpeechChunk):
                        heard = round((piece.offset + len(piece.samples)) / piece.sample_rate)
                        _advance(bars, "speech", "s", heard, 0, args.quiet)
                    else:
                        _show_event(bars, event, args.quiet)
            reply = builder.build()
        except OmniError as err:
            return _failed(err, args)
    print(reply.text)
    if not reply.spoken:  # a text-only reply (--option audio=0): no WAV to write
        print(f"a text-only reply (no speech; audio=0 asks for that): {args.output} not written")
        return 0
    out = _output_path(args)
    reply.save(out)
    first = f", first audio after {reply.first_audio_ms:.0f} ms" if reply.first_audio_ms is not None else ""
    print(f"saved {out.resolve()} ({reply.seconds:.2f} s of speech, {reply.total_ms:.0f} ms{first})")
    return 0


@contextlib.contextmanager
def _progress_bars() -> Iterator[dict[str, Any]]:
    """One tqdm bar per plan step that reports progress, made on first use (`_advance`) and
    closed when the request ends, however it ends."""
    bars: dict[str, Any] = {}
    try:
        yield bars
    finally:
        for bar in bars.values():
            bar.close()


def _failed(err: OmniError, args: argparse.Namespace) -> int:
    """Print a request's error (with a hint where it looks like a TLS mismatch); exit status 1."""
    from omnistage_cli.connection_hints import tls_hint

    hint = tls_hint(err.code, err.message, getattr(args, "ca_cert", ""))
    print(f"error: {err.code.name}: {err.message}{hint}", file=sys.stderr)
    return 1


def _output_path(args: argparse.Namespace) -> Path:
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _show_event(bars: dict[str, Any], event: Any, quiet: bool) -> None:
    """Token progress and waits for a replica, which image and speech requests share."""
    if event.HasField("tokens"):
        tokens = event.tokens
        _advance(bars, f"{tokens.step} tokens", "tok", tokens.tokens, tokens.total, quiet)
    elif event.HasField("waiting") and not quiet:
        waiting = event.waiting
        print(f"waiting up to {waiting.max_wait_ms / 1e3:g} s for a {waiting.stage} replica", file=sys.stderr)


def _advance(bars: dict[str, Any], name: str, unit: str, done: int, total: int, quiet: bool) -> None:
    """Move the progress bar `name` (made on first use) to `done` of `total`."""
    from tqdm import tqdm

    bar = bars.get(name)
    if bar is None:  # total 0: unknown in advance (speech)
        bar = bars[name] = tqdm(total=total or None, desc=name, unit=unit, disable=quiet)
    bar.update(done - bar.n)


def _parse_option(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise SystemExit(f"--option takes NAME=VALUE, not {item!r}")
    return name, value


def _parse_lora(item: str) -> str | tuple[str, float]:
    """ "NAME" or "NAME:SCALE"."""
    name, sep, scale = item.rpartition(":")
    if not sep:
        return item
    try:
        return name, float(scale)
    except ValueError:
        raise SystemExit(f"--lora takes NAME or NAME:SCALE, not {item!r}") from None


def _models(args: argparse.Namespace) -> int:
    from omni_common.errors import OmniError

    with _client(args, 10) as client:
        try:
            models = client.list_models()
        except OmniError as err:
            return _failed(err, args)
    for model in models:
        state = "ready" if model.ready else "not ready"
        print(f"{model.name} ({model.family}, {state}): takes {', '.join(model.inputs)}", end="")
        print(f" (up to {model.max_images} images)" if model.max_images else "", end="")
        print(f"; gives {', '.join(model.outputs)}; sizes multiples of {model.size_multiple}")
        print("  replicas: " + ", ".join(f"{role} {n}" for role, n in sorted(model.roles.items())))
        defaults = ", ".join(f"{name} {value:g}" for name, value in sorted(model.defaults.items()))
        print(f"  defaults: {defaults}")
        for option in model.options:
            print(
                f"  --option {option.name}=<{option.type} in [{option.minimum:g}, {option.maximum:g}], "
                f"default {option.default_value}>: {option.description}"
            )
    return 0


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get("OMNISTAGE_ADDRESS", "127.0.0.1:50051"),
        metavar="HOST:PORT",
        help="the coordinator (default: OMNISTAGE_ADDRESS, else 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--ca-cert",
        default="",
        help="CA bundle (PEM) to verify the coordinator's TLS certificate (default: OMNISTAGE_TLS_CA; "
        "neither: plaintext); `omnistage cluster up` serves TLS: pass .secrets/tls/ca.pem",
    )


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """What every generation request takes from the command line (images and speech alike)."""
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a model family option (repeatable); `omnistage models` lists them",
    )
    parser.add_argument("--seed", type=int, default=0, help="the request's random seed (default 0)")
    parser.add_argument("--model", default="", help="the served model's name (default: the only one served)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before the request is abandoned"
    )
    parser.add_argument("--wait-ready", type=float, default=0.0, help="wait this long for the cluster")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or waiting notes")


def _client(args: argparse.Namespace, timeout: float | None) -> Any:
    from omni_common.client import Client

    return Client(args.address, timeout=timeout, ca_cert=args.ca_cert or None)
