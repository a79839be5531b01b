"""`omnistage`: serve a service, run the local cluster, generate an image, build the fixture."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_MODEL_NAME = "qwen-image-tiny"


def _serve(args: argparse.Namespace) -> int:
    from omni_common.runtime.config import coordinator_config, stage_config
    from omni_common.runtime.logging import setup_logging

    setup_logging(args.service)
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


def _ensure_default_model(plan_env: list[dict[str, str]]) -> None:
    """Build the embedded tiny model the first time the default cluster starts."""
    from omni_common.models.qwenimage.fixture import build_tiny_fixture

    for env in plan_env:
        model = env.get("OMNISTAGE_MODEL")
        if model and not Path(model).exists() and Path(model).name == DEFAULT_MODEL_NAME:
            print(f"building the default model {DEFAULT_MODEL_NAME} in {model}", flush=True)
            build_tiny_fixture(Path(model))


def _parse_scale(item: str) -> tuple[str, int]:
    name, sep, count = item.partition("=")
    if not sep or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"--scale takes SERVICE=N with N >= 1, not {item!r}")
    return name, int(count)


def _cluster_up(args: argparse.Namespace) -> int:
    from omni_common.cluster import LocalCluster, load_compose, local_plan
    from omni_common.transport import sweep_stale_segments

    compose = Path(args.compose).resolve()
    scale = dict(_parse_scale(item) for item in args.scale)
    plan = local_plan(load_compose(compose), compose.parent, scale)
    _ensure_default_model([p.environment for p in plan])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(plan, log_dir=Path(args.logs) if args.logs else None)
    try:
        cluster.start(timeout_s=args.timeout)
        print(
            f"cluster ready: {', '.join(p.name for p in plan)}; "
            f"coordinator at {cluster.coordinator}. Ctrl-C stops it.",
            flush=True,
        )
        stop.wait()
        print("stopping the cluster", flush=True)
    finally:
        cluster.stop()
        sweep_stale_segments()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from omni_common.client import Client, ResultBuilder
    from omni_common.errors import OmniError

    with Client(args.address, timeout=args.timeout) as client:
        try:
            if args.wait_ready:
                client.wait_ready(args.wait_ready)
            builder = ResultBuilder()
            bar = tqdm(total=args.steps, desc="denoising", unit="step", disable=args.quiet)
            for event in client.events(
                args.prompt,
                negative_prompt=args.negative_prompt,
                width=args.width,
                height=args.height,
                steps=args.steps,
                guidance=args.guidance,
                seed=args.seed,
                model=args.model,
                image_format="png",
            ):
                builder.add(event)
                if event.HasField("step"):
                    bar.update(event.step.step - bar.n)
            bar.close()
            result = builder.build()
        except OmniError as err:
            print(f"error: {err.code.name}: {err.message}", file=sys.stderr)
            return 1
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(result.encoded)
    stages = ", ".join(f"{k} {v:.0f} ms" for k, v in result.stage_ms.items())
    print(
        f"saved {out.resolve()} ({result.image.width}x{result.image.height}, "
        f"{result.total_ms:.0f} ms: {stages})"
    )
    return 0


def _health(args: argparse.Namespace) -> int:
    from omni_common.health import check_health

    return 0 if check_health(args.address, timeout_s=args.timeout) else 1


def _fixture(args: argparse.Namespace) -> int:
    from omni_common.models.qwenimage.fixture import build_tiny_fixture
    from omni_common.models.qwenimage.random_model import write_random_model

    if args.random_weights:
        path = write_random_model(Path(args.out), full_size=args.random_weights == "full", seed=args.seed)
    else:
        path = build_tiny_fixture(Path(args.out), head_dim=args.head_dim, seed=args.seed)
    print(f"wrote {path}")
    return 0


def _protos(args: argparse.Namespace) -> int:
    from omni_common.protogen import generate

    for path in generate():
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from omni_common.runtime.config import STAGES, add_coordinator_args, add_stage_args

    parser = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    add_coordinator_args(services.add_parser("coordinator", help="route requests over the stages"))
    for stage in STAGES:
        add_stage_args(services.add_parser(stage, help=f"serve the {stage} stage"), stage)
    serve.set_defaults(func=_serve)

    cluster = sub.add_parser("cluster", help="the local cluster of docker-compose.yml")
    cluster_sub = cluster.add_subparsers(dest="action", required=True)
    up = cluster_sub.add_parser("up", help="start every service as a local process until Ctrl-C")
    up.add_argument("--compose", default="docker-compose.yml")
    up.add_argument("--logs", default="", help="directory for one log file per service")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    up.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="SERVICE=N",
        help="run N replicas of a service (repeatable), e.g. --scale dit-denoise=3",
    )
    up.set_defaults(func=_cluster_up)

    gen = sub.add_parser("generate", help="generate one image through a coordinator")
    gen.add_argument("prompt")
    gen.add_argument("-o", "--output", default="out.png")
    gen.add_argument("--address", default=os.environ.get("OMNISTAGE_ADDRESS", "127.0.0.1:50051"))
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--width", type=int, default=256)
    gen.add_argument("--height", type=int, default=256)
    gen.add_argument("--steps", type=int, default=20)
    gen.add_argument("--guidance", type=float, default=4.0, help="true CFG scale")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--model", default="")
    gen.add_argument("--timeout", type=float, default=600.0)
    gen.add_argument("--wait-ready", type=float, default=0.0, help="wait this long for the cluster")
    gen.add_argument("--quiet", action="store_true")
    gen.set_defaults(func=_generate)

    health = sub.add_parser("health", help="exit 0 when the service at ADDRESS is serving")
    health.add_argument("address")
    health.add_argument("--timeout", type=float, default=2.0)
    health.set_defaults(func=_health)

    fixture = sub.add_parser("fixture", help="build a random Qwen-Image model offline")
    fixture.add_argument("out")
    fixture.add_argument("--head-dim", type=int, default=16)
    fixture.add_argument(
        "--random-weights",
        choices=("tiny", "full"),
        help="write configs only; every process builds the same seeded weights on its device "
        "(full: Qwen-Image's real size, for GPU measurements)",
    )
    fixture.add_argument("--seed", type=int, default=0)
    fixture.set_defaults(func=_fixture)

    protos = sub.add_parser("protos", help="regenerate omnistage/v1 from protos/")
    protos.set_defaults(func=_protos)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
