"""The local tools that call no service: `fixture`, `certs` and `protos`."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

from omni_common.models.registry import fixture_maker, registered


def add_tool_parsers(sub: Any) -> None:
    """`fixture`, `certs` and `protos`: local tools that call no service."""
    fixture = sub.add_parser("fixture", help="build a random tiny model offline (any family)")
    fixture.add_argument("out", help="the directory to write; its name is the name it is served under")
    fixture.add_argument(
        "--family",
        choices=[entry.name for entry in registered() if entry.fixture],
        default="qwenimage",
        help="the model family (default qwenimage)",
    )
    fixture.add_argument(
        "--head-dim", type=int, help="qwenimage: the text encoder's head size (default 16; vLLM needs 32)"
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


def _fixture(args: argparse.Namespace) -> int:
    """The family's own builder, from the registry (FamilyEntry.fixture)."""
    make = fixture_maker(args.family)
    options = {} if args.head_dim is None else {"head_dim": args.head_dim}
    unknown = set(options) - set(inspect.signature(make).parameters)
    if unknown:
        print(f"omnistage fixture: --head-dim does not apply to {args.family}", file=sys.stderr)
        return 2
    path = make(Path(args.out), random_weights=args.random_weights, seed=args.seed, **options)
    print(f"wrote {path}")
    return 0


def _certs(args: argparse.Namespace) -> int:
    from omni_common.certs import SERVICES, make_certs

    made = make_certs(Path(args.dir), SERVICES, hosts=args.host, force=args.force)
    kept = [s for s in SERVICES if s not in made]
    print(f"certificates in {args.dir}: made {', '.join(made) or 'none'}; kept {', '.join(kept) or 'none'}")
    return 0


def _protos(args: argparse.Namespace) -> int:
    from omni_common.protogen import generate

    for path in generate():
        print(path)
    return 0
