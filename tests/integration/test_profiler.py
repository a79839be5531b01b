"""The profiler cannot hurt serving (issue 38, findings 3 and 9): a session nobody stops stops
itself, Ctrl-C in `omnistage profile` still stops the replica's session, the profile root is
owner-only and a symlink planted in it is refused, never followed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from omni_common.client import Client
from omni_common.net.rpc import sync_channel
from omni_common.runtime.profiler import owner_only_directory
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from .conftest import InProcessCluster

REPO = Path(__file__).resolve().parents[2]
SMALL = {"width": 64, "height": 64, "steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles") / "root"  # made by the replica


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, profile_root: Path) -> Iterator[InProcessCluster]:
    options = {"profile_dir": str(profile_root), "profile_max_s": 1.0}
    running = InProcessCluster(tiny_model, stage_options={"dit-denoise": options})
    running.start()
    yield running
    running.stop()


def control(cluster: InProcessCluster) -> stage_pb2_grpc.StageControlStub:
    return stage_pb2_grpc.StageControlStub(sync_channel(cluster.addresses["dit-denoise"]))


def test_a_profile_left_running_stops_itself_and_its_trace_is_owner_only(
    cluster: InProcessCluster, profile_root: Path
) -> None:
    stub = control(cluster)
    started = time.monotonic()
    stub.StartProfile(stage_pb2.StartProfileRequest(name="forgotten"), timeout=30)
    with Client(cluster.coordinator) as client:
        client.generate("a cat", **SMALL)
        while time.monotonic() - started < 1.5:
            time.sleep(0.1)
        client.generate("a cat", **SMALL)  # its steps run past the 1 s bound: the session ends
    time.sleep(2.0)  # idle, then the StopProfile nobody sent in time
    reply = stub.StopProfile(stage_pb2.StopProfileRequest(), timeout=60)
    elapsed = time.monotonic() - started
    assert reply.seconds < elapsed - 1.5  # it ended itself, long before this StopProfile
    trace = Path(reply.path)
    assert trace.is_file() and trace.parent == profile_root / "forgotten"
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600
    for directory in (profile_root, trace.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    with pytest.raises(grpc.RpcError) as nothing:  # collected once
        stub.StopProfile(stage_pb2.StopProfileRequest(), timeout=30)
    assert nothing.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_symlink_planted_in_the_profile_directory_is_refused(
    cluster: InProcessCluster, profile_root: Path, tmp_path: Path
) -> None:
    stub = control(cluster)
    stub.StartProfile(stage_pb2.StartProfileRequest(name="made-root"), timeout=30)
    stub.StopProfile(stage_pb2.StopProfileRequest(), timeout=60)
    outside = tmp_path / "outside"
    outside.mkdir()
    (profile_root / "planted").symlink_to(outside)
    with pytest.raises(grpc.RpcError) as refused:
        stub.StartProfile(stage_pb2.StartProfileRequest(name="planted"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not any(outside.iterdir())


def test_a_profile_root_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a directory of another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(Exception, match="another user"):
        owner_only_directory(theirs, create=True)


def test_ctrl_c_in_the_profile_command_stops_the_replicas_profile(cluster: InProcessCluster) -> None:
    # `omnistage profile ADDRESS --seconds 600`, with Ctrl-C raising as in a terminal: a shell
    # that started these tests in the background had SIGINT ignored, which the command would
    # inherit (Python then raises nothing). Set in the child's Python, not by a preexec_fn:
    # that forks this process, whose gRPC threads then log into the child's stderr.
    command = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['omnistage', *sys.argv[1:]]; runpy.run_module('omnistage_cli', run_name='__main__')"
    )
    argv = [sys.executable, "-c", command, "profile", cluster.addresses["dit-denoise"], "--seconds", "600"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    line = process.stderr.readline()
    assert line.startswith("profiling"), line
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert '"path"' in out
    with pytest.raises(grpc.RpcError) as stopped:  # nothing left running on the replica
        control(cluster).StopProfile(stage_pb2.StopProfileRequest(), timeout=30)
    assert stopped.value.code() == grpc.StatusCode.FAILED_PRECONDITION
