"""The compile cache: PyTorch's caches pointed at the deployment's directory, and the CUDA
graphs' measured speed-ups (their keep decisions) remembered there across restarts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from omni_common.execution import compile_cache
from omni_common.execution.compile_cache import KeepDecisions


def test_the_caches_go_where_the_deployment_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(compile_cache, "_directory", None)
    monkeypatch.setattr(compile_cache, "_warm", False)
    directory = tmp_path / "compile"
    compile_cache.use_compile_cache(directory)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(directory / "triton")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert compile_cache.compile_cache_dir() == directory
    assert not compile_cache.compile_cache_is_warm()  # empty: a cold start
    (directory / "inductor").mkdir()
    (directory / "inductor" / "entry").write_bytes(b"compiled")
    compile_cache.use_compile_cache(directory)  # a restart on the same volume
    assert compile_cache.compile_cache_is_warm()


def test_keep_decisions_outlive_the_process_that_timed_them(tmp_path: Path) -> None:
    path = tmp_path / "cuda-graphs.json"
    first = KeepDecisions(path)
    assert first.get((1, 32, 1024)) is None
    first.put((1, 32, 1024), 2.7)
    first.put((8, 64, 4096), 0.97)
    again = KeepDecisions(path)  # a restarted replica
    assert again.get((1, 32, 1024)) == 2.7 and again.get((8, 64, 4096)) == 0.97
    assert not list(tmp_path.glob("*.tmp"))


def test_an_unreadable_decision_file_is_ignored_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "cuda-graphs.json"
    path.write_text("{not json")
    decisions = KeepDecisions(path)
    assert decisions.get((1,)) is None
    decisions.put((1,), 1.5)
    assert KeepDecisions(path).get((1,)) == 1.5
