"""Authenticate before allocating (issue 38, finding 2): a call without the cluster token is
refused on its metadata, before its body is received, so a flood of large calls without a
token leaves the server's memory flat. The server is a real `serve()` process (its peak RSS
is its own), with the Stage service registered behind the same interceptors every replica has."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from omni_common.net.auth import CLUSTER_TOKEN_HEADER

REPO = Path(__file__).resolve().parents[2]
TOKEN = "flood-test-token"
SERVER = """
import asyncio
from omni_common.runtime.serve import serve
from omnistage.v1 import stage_pb2_grpc

async def setup(server, address):
    stage_pb2_grpc.add_StageServicer_to_server(stage_pb2_grpc.StageServicer(), server)

asyncio.run(serve("flood-probe", "127.0.0.1:0", setup))
"""


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "OMNISTAGE_CLUSTER_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert "ready on" in line, line
    yield process, line.rsplit(" ", 1)[1].strip()
    process.terminate()
    process.wait(30)


def test_a_flood_of_60_mib_calls_without_the_token_leaves_the_rss_flat(server) -> None:
    process, address = server
    run = "/omnistage.v1.Stage/Run"
    payload = bytes(60 << 20)  # never parsed: the refusal comes before the body
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(run)
        # A first refused call warms up the server's code paths, so the baseline is fair.
        with pytest.raises(grpc.RpcError) as first:
            list(call(b"", timeout=30))
        assert first.value.code() == grpc.StatusCode.UNAUTHENTICATED
        before = peak_rss_bytes(process.pid)
        calls = [
            call(payload, timeout=60, metadata=((CLUSTER_TOKEN_HEADER, "wrong"),) * (i % 2))
            for i in range(16)
        ]
        codes = []
        for pending in calls:
            with pytest.raises(grpc.RpcError) as refused:
                list(pending)
            codes.append(refused.value.code())
    growth = peak_rss_bytes(process.pid) - before
    print(f"peak RSS growth under the flood: {growth / 2**20:.1f} MiB")
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    assert growth < 100 << 20, f"peak RSS grew by {growth / 2**20:.0f} MiB"
