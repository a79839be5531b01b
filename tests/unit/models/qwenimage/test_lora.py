"""LoRA adapters on the Qwen-Image denoiser (omni_common/models/lora.py) against diffusers'
`load_lora_weights` (PEFT) on the tiny model.

Unfused (`set_adapters` with a weight) PEFT computes `result + lora_B(lora_A(x)) * scaling`
after each adapted linear layer, which is what the served hooks compute, term for term: the
images are equal bit for bit on the CPU in fp32. `fuse_lora` folds `scale * B @ A` into the
weight first, which rounds differently: allclose (measured 4.2e-7 on these images; ATOL 1e-5).
Two requests with different adapters in one step equal their lone runs within batching's own
tolerance (test_batching.py: ATOL 1e-5).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import save_file

from omni_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from omni_common.models.base import DenoiserOptions, GenerationRequest
from omni_common.models.lora_files import save_random_lora
from omni_common.models.qwenimage.denoise import QwenImageDenoiser

ATOL = 1e-5
PROMPT = "a red cat sitting on a blue mat"
NEGATIVE = "blurry"
CPU = torch.device("cpu")


def request(cfg: bool = False, **changes: Any) -> GenerationRequest:
    base = GenerationRequest(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if cfg else "",
        width=64,
        height=64,
        num_inference_steps=3,
        true_cfg_scale=4.0 if cfg else 1.0,
        seed=11,
    )
    return replace(base, **changes)


@pytest.fixture(scope="module")
def runners(tiny_model: Path, split_runners):
    """The shared encoder and decoder, and a denoiser of this module's own (adapters change it)."""
    encoder, _, decoder = split_runners(torch.float32)
    return encoder, QwenImageDenoiser.load(tiny_model, CPU, torch.float32), decoder


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory: pytest.TempPathFactory, runners) -> dict[str, Path]:
    """Two random adapters in diffusers' format: "a" on every linear layer (rank 4), "b" on
    the attention projections only (rank 3)."""
    root = tmp_path_factory.mktemp("loras")
    transformer = runners[1].transformer
    attention = [
        n for n, _ in transformer.named_modules() if n.endswith(("to_q", "to_k", "to_v", "to_out.0"))
    ]
    return {
        "a": save_random_lora(root / "a.safetensors", transformer, seed=1),
        "b": save_random_lora(
            root / "b" / "pytorch_lora_weights.safetensors", transformer, seed=2, rank=3, modules=attention
        ),
    }


@pytest.fixture
def denoiser(runners, adapter_files):
    """The module's denoiser with adapters a and b, and nothing else left over afterwards."""
    denoiser = runners[1]
    denoiser.loras.add("a", adapter_files["a"])
    denoiser.loras.add("b", adapter_files["b"].parent, scale=0.5)
    yield denoiser
    for name in list(denoiser.loras.adapters):
        denoiser.loras.adapters[name].users = 0
        denoiser.loras.remove(name)
    denoiser.loras.max_bytes, denoiser.loras.directory, denoiser.lora_grouped = 1 << 30, None, False


def generate(runners, requests: list[GenerationRequest]) -> list[torch.Tensor]:
    """Denoise the requests together (one step() per batch key and tick) and decode them."""
    encoder, denoiser, decoder = runners
    states = [denoiser.prepare(r, e) for r, e in zip(requests, encoder.encode(requests), strict=True)]
    while not all(denoiser.is_done(s) for s in states):
        groups: dict[object, list[Any]] = {}
        for state in states:
            if not denoiser.is_done(state):
                groups.setdefault(denoiser.batch_key(state), []).append(state)
        for group in groups.values():
            denoiser.step(group)
    return decoder.decode([denoiser.finish(s) for s in states])


def reference(
    tiny_model: Path, adapter_files: dict[str, Path], gen: GenerationRequest, *, fuse: bool = False
) -> torch.Tensor:
    """diffusers: a fresh pipeline, load_lora_weights for each of the request's adapters, then
    set_adapters with the request's scales (or fuse_lora with them)."""
    pipe = QwenImagePipeline.from_pretrained(tiny_model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, _ in gen.loras:
        source = adapter_files[name]
        pipe.load_lora_weights(str(source.parent if name == "b" else source), adapter_name=name)
    names = [name for name, _ in gen.loras]
    scales = [scale for _, scale in gen.loras]
    if fuse:
        assert len(names) == 1
        pipe.fuse_lora(lora_scale=scales[0], adapter_names=names)
        pipe.unload_lora_weights()
    else:
        pipe.set_adapters(names, scales)
    return pipe(
        gen.prompt,
        negative_prompt=gen.negative_prompt or None,
        width=gen.width,
        height=gen.height,
        num_inference_steps=gen.num_inference_steps,
        true_cfg_scale=gen.true_cfg_scale,
        generator=torch.Generator().manual_seed(gen.seed),
        output_type="pt",
    ).images[0]


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_one_adapter_equals_diffusers_bitwise(
    cfg: bool, tiny_model, adapter_files, runners, denoiser
) -> None:
    gen = request(cfg, loras=(("a", 0.7),))
    [image] = generate(runners, [gen])
    [plain] = generate(runners, [request(cfg)])
    assert (image - plain).abs().max() > 1e-3  # the adapter changes the image
    assert torch.equal(image, reference(tiny_model, adapter_files, gen))
    assert all(adapter.users == 0 for adapter in denoiser.loras.adapters.values())


def test_two_adapters_in_order_equal_diffusers_bitwise(tiny_model, adapter_files, runners, denoiser) -> None:
    gen = request(loras=(("a", 0.7), ("b", -0.4)))
    [image] = generate(runners, [gen])
    assert torch.equal(image, reference(tiny_model, adapter_files, gen))


def test_fused_adapter_is_close_to_the_unfused_one(tiny_model, adapter_files, runners, denoiser) -> None:
    gen = request(loras=(("a", 0.7),))
    [image] = generate(runners, [gen])
    fused = reference(tiny_model, adapter_files, gen, fuse=True)
    assert not torch.equal(image, fused)  # the fused weight rounds differently ...
    torch.testing.assert_close(image, fused, atol=ATOL, rtol=0)  # ... by float rounding only


def test_default_scale_is_the_added_one(runners, denoiser) -> None:
    explicit, default = generate(runners, [request(loras=(("b", 0.5),)), request(loras=(("b", None),))])
    torch.testing.assert_close(explicit, default, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
@pytest.mark.parametrize("batching", ["mixed", "grouped"])
def test_different_adapters_in_one_step_equal_their_lone_runs(
    cfg: bool, batching: str, runners, denoiser
) -> None:
    denoiser.lora_grouped = batching == "grouped"
    requests = [
        request(cfg, loras=(("a", 0.7),)),
        request(cfg, loras=(("b", 1.5), ("a", -0.3)), seed=5, prompt="a dog"),
        request(cfg, seed=6),  # no adapter at all
    ]
    states = [denoiser.prepare(r, runners[0].encode([r])[0]) for r in requests]
    keys = {denoiser.batch_key(state) for state in states}
    for state in states:
        denoiser.release(state)
    assert len(keys) == (3 if batching == "grouped" else 1)  # mixed: one forward for all three
    together = generate(runners, requests)
    for gen, image in zip(requests, together, strict=True):
        [alone] = generate(runners, [gen])
        torch.testing.assert_close(image, alone, atol=ATOL, rtol=0)
    assert not torch.allclose(together[0], together[2], atol=1e-3)


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_bad_adapter_files_are_refused_and_change_nothing(
    tmp_path: Path, adapter_files, runners, denoiser
) -> None:
    [before] = generate(runners, [request(loras=(("a", 0.7),))])
    good = {k: v for k, v in __import__("safetensors.torch").torch.load_file(str(adapter_files["a"])).items()}
    key_a = next(k for k in good if k.endswith("to_q.lora_A.weight"))
    bad = {
        "wrong shape": {**good, key_a: torch.zeros(4, 7)},
        "unknown module": {
            **good,
            "transformer.nowhere.lora_A.weight": torch.zeros(4, 4),
            "transformer.nowhere.lora_B.weight": torch.zeros(4, 4),
        },
        "NaN": {**good, key_a: torch.full_like(good[key_a], float("nan"))},
        "lacks lora_B": {key_a: good[key_a]},
        "text encoder": {
            **good,
            "text_encoder.layers.0.q_proj.lora_A.weight": torch.zeros(4, 16),
            "text_encoder.layers.0.q_proj.lora_B.weight": torch.zeros(16, 4),
        },
    }
    for what, tensors in bad.items():
        path = write(tmp_path / f"{what.replace(' ', '_')}.safetensors", tensors)
        with pytest.raises(InvalidArgument):
            denoiser.loras.add("a", path)  # same name: a failed replace keeps the old one
    dora = write(
        tmp_path / "dora.safetensors",
        good,
        {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 4, "use_dora": True})},
    )
    with pytest.raises(InvalidArgument, match="DoRA"):
        denoiser.loras.add("c", dora)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidArgument, match="safetensors"):
        denoiser.loras.add("c", tmp_path / "junk.safetensors")
    with pytest.raises(NotFound):
        denoiser.loras.add("c", tmp_path / "missing.safetensors")
    with pytest.raises(InvalidArgument, match="name"):
        denoiser.loras.add("../etc", adapter_files["a"])
    assert denoiser.loras.names == ("a", "b")
    [after] = generate(runners, [request(loras=(("a", 0.7),))])
    assert torch.equal(before, after)


def test_alpha_metadata_scales_like_peft(
    tmp_path: Path, tiny_model, adapter_files, runners, denoiser
) -> None:
    """A diffusers-saved adapter with lora_alpha != r: scaling = weight * alpha / r (PEFT's)."""
    tensors = __import__("safetensors.torch").torch.load_file(str(adapter_files["a"]))
    config = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in tensors}),
    }
    path = write(tmp_path / "alpha.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
    denoiser.loras.add("alpha", path)
    [image] = generate(runners, [request(loras=(("alpha", 0.35),))])
    [doubled] = generate(runners, [request(loras=(("a", 0.7),))])
    torch.testing.assert_close(image, doubled, atol=ATOL, rtol=0)


def test_lru_eviction_pinning_and_use(tmp_path: Path, adapter_files, runners, denoiser) -> None:
    layers = denoiser.loras
    size_a = layers.adapters["a"].nbytes
    layers.remove("b")
    layers.max_bytes = 2 * size_a
    layers.add("c", adapter_files["a"])  # a, c fit
    layers.acquire((("a", None),))  # a is used, then released: now the most recent
    layers.release(((layers.adapters["a"], 1.0),))
    layers.add("d", adapter_files["a"])  # evicts c, the least recently used
    assert layers.names == ("a", "d")
    layers.pin("a", True)
    held = layers.acquire((("d", None),))
    with pytest.raises(ResourceExhausted):
        layers.add("e", adapter_files["a"])  # a pinned, d in use: no room
    with pytest.raises(FailedPrecondition):
        layers.remove("d")
    layers.release(held)
    layers.add("e", adapter_files["a"])  # d is free again: evicted
    assert layers.names == ("a", "e")
    with pytest.raises(NotFound):
        layers.acquire((("d", None),))
    assert [info.pinned for info in layers.infos()] == [True, False]


def test_adapters_load_on_demand_from_the_directory(tmp_path: Path, adapter_files, runners, denoiser) -> None:
    (tmp_path / "from-dir.safetensors").write_bytes(adapter_files["a"].read_bytes())
    denoiser.configure(DenoiserOptions(lora_dir=str(tmp_path)))
    [loaded] = generate(runners, [request(loras=(("from-dir", 0.7),))])
    [added] = generate(runners, [request(loras=(("a", 0.7),))])
    assert torch.equal(loaded, added)
    assert "from-dir" in denoiser.loras.names
    with pytest.raises(NotFound, match="adapter directory"):
        generate(runners, [request(loras=(("absent", 1.0),))])
    assert all(adapter.users == 0 for adapter in denoiser.loras.adapters.values())


def test_step_cache_with_adapters_is_refused(runners, denoiser) -> None:
    gen = request(loras=(("a", 1.0),), options=(("step_cache", "0.1"),))
    with pytest.raises(InvalidArgument, match="step_cache"):
        runners[1].prepare(gen, runners[0].encode([gen])[0])
    assert denoiser.loras.adapters["a"].users == 0
