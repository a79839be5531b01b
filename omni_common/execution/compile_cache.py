"""Where torch.compile keeps what it made, so a restarted replica loads instead of compiling.

PyTorch caches compiled graphs (inductor's FX graph cache), AOT autograd results, Triton
kernels and its dynamic-shape decisions (profile-guided "automatic dynamic") on disk, by
default under /tmp, which a container loses on restart. `--compile-cache DIR` puts them all
in DIR: a volume the deployment names (docker-compose.yml, deploy/k8s/) survives restarts,
and a restarted DiT replica spends seconds where a cold one spends minutes (measured in
docs/benchmarks.md). CUDA graphs hold device addresses and are captured again each start;
which of them paid is kept here too (KeepDecisions), so a warm start captures only those
and times none; so is where a compiled VAE decode beat the eager one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("omnistage.compile_cache")
_directory: Path | None = None  # this process's compile cache, once use_compile_cache ran
_warm = False  # it held files when this process started using it


def compile_cache_dir() -> Path | None:
    """The directory `use_compile_cache` named for this process; None without one."""
    return _directory


def compile_cache_is_warm() -> bool:
    """Whether this process's compile cache held files when the process began using it: a
    restart's compiles then mostly load (a warm start)."""
    return _warm


def use_compile_cache(directory: Path) -> None:
    """Point PyTorch's compile caches at `directory` (created, owner-only); call it before
    the first compilation of the process."""
    global _directory, _warm
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _directory = directory
    inductor, triton = directory / "inductor", directory / "triton"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ["TRITON_CACHE_DIR"] = str(triton)
    # On by default in current PyTorch; said here so that a warm start never depends on it.
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    entries = sum(1 for path in directory.rglob("*") if path.is_file())
    _warm = entries > 0
    log.info("compile cache %s: %s", directory, f"{entries} files (warm)" if entries else "empty (cold)")


class KeepDecisions:
    """Each key's measured speed-up (eager time / the faster path's: a CUDA graph replay, a
    compiled call), remembered in a JSON file (in the compile cache) across restarts: the gain
    depends on the model, the shapes and the GPU, not on the run. A known key skips the timing
    runs. A file that cannot be read is ignored and rewritten."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._speedups: dict[str, float] = {k: float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            self._speedups = {}

    def get(self, key: Hashable) -> float | None:
        return self._speedups.get(repr(key))

    def put(self, key: Hashable, speedup: float) -> None:
        self._speedups[repr(key)] = speedup
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            partial.write_text(json.dumps(self._speedups, indent=0, sort_keys=True))
            partial.replace(self.path)  # atomic: replicas sharing the cache never read half a file
        except OSError as err:
            log.warning("cannot keep decisions in %s: %s", self.path, err)


def decisions_for(kind: str, device: torch.device, model_config: dict[str, Any]) -> KeepDecisions | None:
    """The KeepDecisions of `kind` ("cuda-graphs", "encoder-graphs", "vae-compile") in this
    process's compile cache (None without one), named by what decides them: the GPU, PyTorch
    and the model's architecture."""
    if _directory is None:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    what = json.dumps([name, torch.__version__, model_config], sort_keys=True, default=str)
    return KeepDecisions(_directory / f"{kind}-{hashlib.sha256(what.encode()).hexdigest()[:16]}.json")
