"""omni_common/models/lora.py on a toy model: hooks only where adapters are, each row of a
mixed batch getting its own adapters (equal to the row alone up to the float rounding of a
matmul over another number of rows, as batching is anyway: 1e-6 here), and Qwen-Image's reader
taking Kohya's format the way diffusers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni_common.models.lora import LoraLayers
from omni_common.models.lora_files import save_random_lora
from omni_common.models.qwenimage.lora import read_qwenimage_lora

CPU = torch.device("cpu")


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def identity(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix("transformer."): value for key, value in tensors.items()}


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Toy, LoraLayers, dict[str, Path]]:
    model = Toy()
    files = {
        "both": save_random_lora(tmp_path / "both.safetensors", model, rank=2, seed=1, std=0.3),
        "first": save_random_lora(
            tmp_path / "first.safetensors", model, rank=3, seed=2, std=0.3, modules=["first"]
        ),
    }
    return model, LoraLayers(model, identity, device=CPU, dtype=torch.float32), files


def test_hooks_sit_only_where_adapters_are_and_leave_with_them(toy) -> None:
    model, layers, files = toy
    layers.add("first", files["first"])
    assert len(model.first._forward_hooks) == 1 and not model.second._forward_hooks
    layers.add("both", files["both"])
    assert len(model.first._forward_hooks) == 1 and len(model.second._forward_hooks) == 1
    layers.remove("both")
    assert not model.second._forward_hooks
    layers.remove("first")
    assert not model.first._forward_hooks and layers.nbytes == 0


def test_each_row_gets_its_own_adapters(toy) -> None:
    model, layers, files = toy
    layers.add("first", files["first"])
    layers.add("both", files["both"])
    both, first = layers.adapters["both"], layers.adapters["first"]
    rows = [((both, 0.5),), (), ((first, -1.0), (both, 2.0)), ((both, 0.5),)]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        with layers.rows(rows):
            together = model(x)
        for i, row in enumerate(rows):
            with layers.rows([row]):
                alone = model(x[i : i + 1])
            torch.testing.assert_close(together[i : i + 1], alone, atol=1e-6, rtol=0)
        plain = model(x)
    assert torch.equal(together[1], plain[1]) and not torch.equal(together[0], plain[0])
    with pytest.raises(ValueError, match="rows"), torch.inference_mode(), layers.rows(rows[:2]):
        model(x)


def test_kohya_files_fold_alpha_like_diffusers(tmp_path: Path) -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    kohya = {
        "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight": a,
        "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight": b,
        "lora_unet_transformer_blocks_0_attn_to_q.alpha": torch.tensor(2.0),
    }
    read = read_qwenimage_lora(kohya)
    assert set(read) == {
        "transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer_blocks.0.attn.to_q.lora_B.weight",
    }
    assert torch.equal(read["transformer_blocks.0.attn.to_q.lora_A.weight"], a * 0.5)  # alpha / rank
    assert torch.equal(read["transformer_blocks.0.attn.to_q.lora_B.weight"], b)
    save_file(kohya, str(tmp_path / "kohya.safetensors"))  # a real file of that format reads too
