"""Files that calls name cannot hang or exhaust the process (issue 38, findings 1, 4, 10):
a FIFO among a directory's entries, an adapter of absurd rank, symlinks out of a root, NUL."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni_common.checked_files import read_safetensors_file
from omni_common.errors import InvalidArgument, NotFound, ResourceExhausted
from omni_common.models.lora import LoraLayers
from omni_common.runtime.hot_reload import read_weights


def layers(max_bytes: int = 1 << 20, directory: Path | None = None) -> LoraLayers:
    root = torch.nn.Sequential(torch.nn.Linear(16, 16))
    return LoraLayers(
        root,
        lambda t: t,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_bytes=max_bytes,
        directory=directory,
    )


def finishes(fn, *args) -> BaseException | None:
    """What `fn(*args)` raised, from a thread that must end: a blocked open would hang it."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn(*args)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(30)  # a bound for a hang, not a timing assertion: it returns at once
    assert not thread.is_alive(), "the call blocked on the FIFO"
    return outcome[0]


def test_a_fifo_among_a_directorys_entries_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "a.safetensors")
    err = finishes(layers().read, "f", tmp_path)
    assert isinstance(err, InvalidArgument) and "regular file" in err.message
    err = finishes(read_weights, [str(tmp_path)])
    assert isinstance(err, InvalidArgument)


def test_a_fifo_in_the_adapter_directory_is_refused_for_a_request(tmp_path: Path) -> None:
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / "a.safetensors")
    os.mkfifo(tmp_path / "g.safetensors")
    adapters = layers(directory=tmp_path)
    for name in ("f", "g"):
        err = finishes(adapters.read_from_directory, name)
        assert isinstance(err, InvalidArgument)


def sparse_adapter(path: Path, rank: int) -> Path:
    """An adapter whose header declares factors of `rank` over a sparse file of that size."""
    a_bytes = rank * 16 * 4
    header = {
        "0.lora_A.weight": {"dtype": "F32", "shape": [rank, 16], "data_offsets": [0, a_bytes]},
        "0.lora_B.weight": {"dtype": "F32", "shape": [16, rank], "data_offsets": [a_bytes, 2 * a_bytes]},
    }
    text = json.dumps(header).encode()
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.truncate(8 + len(text) + 2 * a_bytes)
    return path


def read_bytes_of_this_process() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_a_3_gib_adapter_is_refused_from_its_header_before_64_mib_are_read(tmp_path: Path) -> None:
    file = sparse_adapter(tmp_path / "huge.safetensors", rank=(3 << 30) // 128)
    assert file.stat().st_size > 3 << 30
    before = read_bytes_of_this_process()
    with pytest.raises(ResourceExhausted, match="adapter memory"):
        layers(max_bytes=1 << 30).read("huge", file)
    assert read_bytes_of_this_process() - before < 64 << 20


def test_a_push_of_a_tensor_the_model_lacks_is_refused_from_its_header(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(InvalidArgument, match="shape"):
        read_weights([str(tmp_path / "w.safetensors")], {"w": (2, 2)})
    with pytest.raises(InvalidArgument, match="no weight"):
        read_weights([str(tmp_path / "w.safetensors")], {"v": (4, 4)})


def test_a_header_with_holes_or_a_lie_about_sizes_is_invalid(tmp_path: Path) -> None:
    for offsets in ([8, 72], [0, 60]):
        header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": offsets}}).encode()
        path = tmp_path / "bad.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(72))
        with pytest.raises(InvalidArgument):
            read_safetensors_file(path, "file")


def test_paths_resolve_inside_the_root_and_outside_reads_as_missing(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    save_file(
        {"0.lora_A.weight": torch.zeros(2, 16), "0.lora_B.weight": torch.zeros(16, 2)},
        str(outside / "x.safetensors"),
    )
    (root / "link.safetensors").symlink_to(outside / "x.safetensors")
    (root / "dir").symlink_to(outside)
    adapters = layers(directory=root)
    messages = set()
    for path in (
        root / "link.safetensors",
        root / "dir",
        outside / "x.safetensors",
        root / "../outside/x.safetensors",
    ):
        with pytest.raises(NotFound) as caught:
            adapters.read("a", path, root=root)
        messages.add(caught.value.message.replace(repr(str(path)[:200]), "PATH"))
    with pytest.raises(NotFound) as caught:
        adapters.read("a", root / "absent.safetensors", root=root)
    assert messages == {caught.value.message.replace(repr(str(root / "absent.safetensors")), "PATH")}
    for name in ("link", "dir"):  # the adapter directory's entries: the same rule
        with pytest.raises(NotFound):
            adapters.read_from_directory(name)
    inside = root / "ok.safetensors"
    inside.write_bytes((outside / "x.safetensors").read_bytes())
    assert adapters.read("ok", inside, root=root).rank == 2


def test_a_path_with_nul_is_invalid_argument(tmp_path: Path) -> None:
    for call in (lambda: layers().read("a", Path("/tmp/a\0b")), lambda: read_weights(["/tmp/a\0b"])):
        with pytest.raises(InvalidArgument):
            call()


def test_addlora_scales_share_the_requests_limit(tmp_path: Path) -> None:
    save_file(
        {"0.lora_A.weight": torch.zeros(2, 16), "0.lora_B.weight": torch.zeros(16, 2)},
        str(tmp_path / "a.safetensors"),
    )
    for scale in (1e38, -101.0, float("nan")):
        with pytest.raises(InvalidArgument, match="finite, in"):
            layers().read("a", tmp_path / "a.safetensors", scale)
    assert layers().read("a", tmp_path / "a.safetensors", 100.0).scale == 100.0


def test_without_a_root_a_symlinked_adapter_is_followed_deliberately(tmp_path: Path) -> None:
    tensors = {"0.lora_A.weight": torch.zeros(2, 16), "0.lora_B.weight": torch.zeros(16, 2)}
    save_file(tensors, str(tmp_path / "real.safetensors"))
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real.safetensors")
    assert layers().read("a", tmp_path / "link.safetensors").source == "real.safetensors"


def test_pushed_weights_resolve_inside_the_control_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    (root / "in.safetensors").symlink_to(tmp_path / "outside.safetensors")
    for path in (tmp_path / "outside.safetensors", root / "in.safetensors", root):
        with pytest.raises((NotFound, InvalidArgument)) as caught:
            read_weights([str(path)], {"w": (2,)}, root)
        assert caught.type is NotFound or "holds no" in caught.value.message
    save_file({"w": torch.ones(2)}, str(root / "ok.safetensors"))
    assert torch.equal(read_weights(["ok.safetensors"], {"w": (2,)}, root)["w"], torch.ones(2))
