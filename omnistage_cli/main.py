"""`omnistage`: serve a service, run the local cluster, generate an image, speak, build a fixture."""

from __future__ import annotations

import argparse
import os
import sys


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
    from omni_common.runtime.serve import stop_with_parent

    setup_logging(args.service)
    if args.parent_pid:
        stop_with_parent(args.parent_pid)
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
    from omnistage_cli.cluster_command import cluster_up

    return cluster_up(args)


def build_parser() -> argparse.ArgumentParser:
    """The `omnistage` command; every argument has a help text (tests/unit/test_cli_help.py)."""
    from omni_common.runtime.config import add_coordinator_args, add_gateway_args, add_stage_args
    from omni_common.stages import STAGES
    from omnistage_cli.client_commands import add_client_parsers
    from omnistage_cli.cluster_command import add_cluster_up_args
    from omnistage_cli.replica_commands import add_replica_parsers
    from omnistage_cli.tool_commands import add_tool_parsers

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

    add_client_parsers(sub)
    add_replica_parsers(sub)
    add_tool_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
