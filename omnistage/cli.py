"""`omnistage`: serve a service, run the local cluster, generate an image, speak, build a fixture."""

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


def _serve(args: argparse.Namespace) -> int:
    """Run one service; a failure ends it with one line that names the service and the cause
    (the traceback goes to the log at OMNISTAGE_LOG_LEVEL=DEBUG), what `cluster up` shows."""
    import logging

    from omni_common.errors import OmniError

    try:
        return _run_service(args)
    except Exception as err:  # SystemExit and KeyboardInterrupt pass: they are no faults
        logging.getLogger(f"omnistage.{args.service}").debug("the service failed", exc_info=True)
        cause = err.message if isinstance(err, OmniError) else f"{type(err).__name__}: {err}"
        print(f"{args.service}: {cause}".splitlines()[0], file=sys.stderr, flush=True)
        return 1


def _run_service(args: argparse.Namespace) -> int:
    from omni_common.net import tracing
    from omni_common.runtime.config import coordinator_config, gateway_config, stage_config
    from omni_common.runtime.logging import setup_logging

    setup_logging(args.service)
    tracing.setup(args.service)  # OTLP export when OTEL_EXPORTER_OTLP_ENDPOINT is set
    if args.service == "gateway":
        from services.gateway.server import main as gateway_main

        gateway_main(gateway_config(args))
        return 0
    if args.service == "coordinator":
        from services.coordinator.server import main as coordinator_main

        coordinator_main(coordinator_config(args))
        return 0
    config = stage_config(args.service, args)
    if args.service == "ar-encoder":
        from services.ar_encoder.server import main
    elif args.service == "dit-denoise":
        from services.dit_denoise.server import main
    else:
        from services.vae_decode.server import main
    main(config)
    return 0


def _cluster_up(args: argparse.Namespace) -> int:
    from omnistage.cluster_command import cluster_up

    return cluster_up(args)


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

    options = dict(_parse_option(item) for item in args.option)
    request = chat_request(
        args.prompt,
        audio=[Path(path) for path in args.audio],
        images=[Path(path) for path in args.image],
        speaker=args.speaker,
        model=args.model,
        seed=args.seed,
        options=options,
    )
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
    from omnistage.connection_hints import tls_hint

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


def _control(args: argparse.Namespace) -> int:
    """One StageControl call to a replica (LoRA adapters, weights, profiler); prints its reply."""
    import time

    import grpc
    from google.protobuf import json_format

    from omni_common.net.auth import cluster_metadata
    from omni_common.net.rpc import sync_channel
    from omnistage.v1 import stage_pb2, stage_pb2_grpc

    with sync_channel(args.address, metadata=cluster_metadata()) as channel:
        stub = stage_pb2_grpc.StageControlStub(channel)
        try:
            if args.command == "profile":
                started = stub.StartProfile(stage_pb2.StartProfileRequest(name=args.name), timeout=30)
                print(f"profiling {args.address} into {started.path} for {args.seconds:g} s", file=sys.stderr)
                try:
                    time.sleep(args.seconds)
                except KeyboardInterrupt:  # Ctrl-C ends the recording early; the replica must stop it
                    print("interrupted: stopping the profile", file=sys.stderr)
                reply = stub.StopProfile(stage_pb2.StopProfileRequest(), timeout=300)
            elif args.command == "load-weights":
                reply = stub.LoadWeights(stage_pb2.LoadWeightsRequest(paths=args.paths), timeout=args.timeout)
            elif args.action == "add":
                request = stage_pb2.AddLoraRequest(name=args.name, path=args.path, pinned=args.pin)
                if args.scale is not None:
                    request.scale = args.scale
                reply = stub.AddLora(request, timeout=args.timeout)
            elif args.action == "remove":
                reply = stub.RemoveLora(stage_pb2.RemoveLoraRequest(name=args.name), timeout=args.timeout)
            elif args.action in ("pin", "unpin"):
                pin = stage_pb2.PinLoraRequest(name=args.name, pinned=args.action == "pin")
                reply = stub.PinLora(pin, timeout=args.timeout)
            else:
                reply = stub.ListLoras(stage_pb2.ListLorasRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(reply, indent=None))
    return 0


def _health(args: argparse.Namespace) -> int:
    from omni_common.health import check_health

    return 0 if check_health(args.address, timeout_s=args.timeout) else 1


def _fixture(args: argparse.Namespace) -> int:
    if args.family == "qwen2.5-omni":
        from omni_common.models.qwen_omni.fixture import build_tiny_fixture as build_omni
        from omni_common.models.qwen_omni.random_model import write_random_model as random_omni

        if args.random_weights:
            path = random_omni(Path(args.out), full_size=args.random_weights == "full", seed=args.seed)
        else:
            path = build_omni(Path(args.out), seed=args.seed)
        print(f"wrote {path}")
        return 0
    if args.family == "glm-image":
        from omni_common.models.glm_image.fixture import build_tiny_fixture as build_glm_image
        from omni_common.models.glm_image.random_model import write_random_model as random_glm

        if args.random_weights:
            path = random_glm(Path(args.out), full_size=args.random_weights == "full", seed=args.seed)
        else:
            path = build_glm_image(Path(args.out), seed=args.seed)
        print(f"wrote {path}")
        return 0
    from omni_common.models.qwenimage.fixture import build_tiny_fixture
    from omni_common.models.qwenimage.random_model import write_random_model

    if args.random_weights:
        path = write_random_model(Path(args.out), full_size=args.random_weights == "full", seed=args.seed)
    else:
        path = build_tiny_fixture(Path(args.out), head_dim=args.head_dim, seed=args.seed)
    print(f"wrote {path}")
    return 0


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


def _protos(args: argparse.Namespace) -> int:
    from omni_common.protogen import generate

    for path in generate():
        print(path)
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


def _certs(args: argparse.Namespace) -> int:
    from omni_common.certs import SERVICES, make_certs

    made = make_certs(Path(args.dir), SERVICES, hosts=args.host, force=args.force)
    kept = [s for s in SERVICES if s not in made]
    print(f"certificates in {args.dir}: made {', '.join(made) or 'none'}; kept {', '.join(kept) or 'none'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `omnistage` command; every argument has a help text (tests/unit/test_cli_help.py)."""
    from omni_common.runtime.config import STAGES, add_coordinator_args, add_gateway_args, add_stage_args
    from omnistage.cluster_command import add_cluster_up_args

    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    add_coordinator_args(services.add_parser("coordinator", help="route requests over the stages"))
    for stage in STAGES:
        add_stage_args(services.add_parser(stage, help=f"serve the {stage} stage"), stage)
    add_gateway_args(
        services.add_parser(
            "gateway", help="the OpenAI-compatible HTTP API and the try-it page, over the coordinator"
        )
    )
    serve.set_defaults(func=_serve)

    cluster = sub.add_parser("cluster", help="the local cluster of docker-compose.yml")
    cluster_sub = cluster.add_subparsers(dest="action", required=True)
    up = cluster_sub.add_parser("up", help="start every service as a local process until Ctrl-C")
    add_cluster_up_args(up)
    up.set_defaults(func=_cluster_up)

    _add_request_parsers(sub)
    _add_replica_parsers(sub)
    _add_tool_parsers(sub)
    return parser


def _add_request_parsers(sub: Any) -> None:
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
    _add_request_args(speak)
    speak.set_defaults(func=_speak)

    models = sub.add_parser("models", help="list the models a coordinator serves, with their options")
    _add_client_args(models)
    models.set_defaults(func=_models)


def _add_replica_parsers(sub: Any) -> None:
    """`health`, `lora`, `load-weights` and `profile`: calls to one service at ADDRESS."""
    address = "the replica, HOST:PORT"
    health = sub.add_parser("health", help="exit 0 when the service at ADDRESS is serving")
    health.add_argument("address", help="HOST:PORT of a gRPC service, or http(s)://HOST:PORT/health")
    health.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    health.set_defaults(func=_health)

    lora = sub.add_parser("lora", help="LoRA adapters of a dit-denoise replica at ADDRESS")
    lora_sub = lora.add_subparsers(dest="action", required=True)
    lora_add = lora_sub.add_parser("add", help="load an adapter file or directory (on the replica's machine)")
    lora_add.add_argument("address", help=address)
    lora_add.add_argument("name", help="the name requests use (1-64 letters, digits, '.', '_', '-')")
    lora_add.add_argument("path", help="the adapter's file or directory, as the replica sees it")
    lora_add.add_argument("--scale", type=float, default=None, help="default scale (1.0)")
    lora_add.add_argument("--pin", action="store_true", help="never evict it")
    for action, text in (("remove", "unload it"), ("pin", "never evict it"), ("unpin", "evictable again")):
        item = lora_sub.add_parser(action, help=text)
        item.add_argument("address", help=address)
        item.add_argument("name", help="the adapter's name")
    lora_list = lora_sub.add_parser("list", help="the loaded adapters")
    lora_list.add_argument("address", help=address)
    lora.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the replica")
    lora.set_defaults(func=_control)

    weights = sub.add_parser(
        "load-weights",
        help="copy new weights (safetensors files or directories) into a replica between steps",
    )
    weights.add_argument("address", help=address)
    weights.add_argument(
        "paths", nargs="+", help="safetensors files or directories, as the replica sees them"
    )
    weights.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the replica")
    weights.set_defaults(func=_control)

    profile = sub.add_parser("profile", help="record a torch.profiler trace of the replica at ADDRESS")
    profile.add_argument("address", help=address)
    profile.add_argument("--seconds", type=float, default=10.0, help="how long to record (default 10)")
    profile.add_argument(
        "--name",
        default="",
        help="subdirectory of the replica's --profile-dir for the trace (default: a new one)",
    )
    profile.set_defaults(func=_control)


def _add_tool_parsers(sub: Any) -> None:
    """`fixture`, `certs` and `protos`: local tools that call no service."""
    fixture = sub.add_parser("fixture", help="build a random tiny model offline (any family)")
    fixture.add_argument("out", help="the directory to write; its name is the name it is served under")
    fixture.add_argument(
        "--family",
        choices=("qwenimage", "glm-image", "qwen2.5-omni"),
        default="qwenimage",
        help="the model family (default qwenimage)",
    )
    fixture.add_argument(
        "--head-dim", type=int, default=16, help="qwenimage: the text encoder's head size (vLLM needs 32)"
    )
    fixture.add_argument(
        "--random-weights",
        choices=("tiny", "full"),
        help="write configs only; every process builds the same seeded weights on its device "
        "(full: the family's real size, for GPU measurements)",
    )
    fixture.add_argument("--seed", type=int, default=0, help="the weights' random seed (default 0)")
    fixture.set_defaults(func=_fixture)

    certs = sub.add_parser("certs", help="make a local CA and a TLS certificate per service in DIR")
    certs.add_argument("dir", help="where the CA and certificates go (kept when present)")
    certs.add_argument(
        "--host", action="append", default=[], help="another name or IP for every certificate (repeatable)"
    )
    certs.add_argument("--force", action="store_true", help="make everything anew (rotation), CA included")
    certs.set_defaults(func=_certs)

    protos = sub.add_parser("protos", help="regenerate omnistage/v1 from protos/")
    protos.set_defaults(func=_protos)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
