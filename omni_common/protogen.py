"""Generate the Python gRPC/protobuf code under omnistage/v1 from protos/ (grpcio-tools)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("tensor.proto", "stage.proto", "coordinator.proto")


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every proto into `out_dir/omnistage/v1`; returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(PROTO_ROOT / "omnistage" / "v1" / name) for name in PROTO_FILES]
    (out_dir / "omnistage" / "v1").mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see its output above")
    return sorted((out_dir / "omnistage" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO_ROOT))
    sys.exit(0)
