"""Where torch.compile keeps what it made, so a restarted replica loads instead of compiling.

PyTorch caches compiled graphs (inductor's FX graph cache), AOT autograd results, Triton
kernels and its dynamic-shape decisions (profile-guided "automatic dynamic") on disk, by
default under /tmp, which a container loses on restart. `--compile-cache DIR` puts them all
in DIR: a volume the deployment names (docker-compose.yml, deploy/k8s/) survives restarts,
and a restarted DiT replica spends seconds where a cold one spends minutes (measured in
docs/benchmarks.md). CUDA graphs hold device addresses and are captured again each start;
which of them paid is kept here too (cuda_graphs.KeepDecisions), so a warm start captures
only those and times none.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("omnistage.compile_cache")
_directory: Path | None = None  # this process's compile cache, once use_compile_cache ran


def compile_cache_dir() -> Path | None:
    """The directory `use_compile_cache` named for this process; None without one."""
    return _directory


def use_compile_cache(directory: Path) -> None:
    """Point PyTorch's compile caches at `directory` (created, owner-only); call it before
    the first compilation of the process."""
    global _directory
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _directory = directory
    inductor, triton = directory / "inductor", directory / "triton"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ["TRITON_CACHE_DIR"] = str(triton)
    # On by default in current PyTorch; said here so that a warm start never depends on it.
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    entries = sum(1 for path in directory.rglob("*") if path.is_file())
    log.info("compile cache %s: %s", directory, f"{entries} files (warm)" if entries else "empty (cold)")
