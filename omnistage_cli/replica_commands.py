"""The commands that call one service at ADDRESS: `health`, `lora`, `load-weights` and
`profile`."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_replica_parsers(sub: Any) -> None:
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
                try:  # from the line on: a Ctrl-C right after it still stops the replica's profile
                    said = f"profiling {args.address} into {started.path} for {args.seconds:g} s"
                    print(said, file=sys.stderr)
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
