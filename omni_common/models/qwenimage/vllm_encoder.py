"""The vLLM encoder backend: Qwen2.5-VL's language model served by vLLM's engine in pooling
mode, returning the last layer's per-token hidden states.

Text-only, Qwen2.5-VL's LM is a plain Qwen2 model with the same weights, so at start the
text encoder's LM weights and a Qwen2 config are exported into a temporary directory that
vLLM loads as `Qwen2ForCausalLM` (`runner="pooling"`: no LM head runs). Templating, the
34-token prefix drop and the masks stay the family's code (omni_common.models.qwenimage.
encode); vLLM only sees token ids. Concurrent texts go to the engine as separate requests
and the engine batches them. vLLM spawns its engine process: the program that starts this
backend needs a `__main__` guard.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2Tokenizer

from omni_common.models.qwenimage.encode import template_tokens
from omni_common.models.qwenimage.prompt_template import PROMPT_TEMPLATE_DROP, TOKENIZER_MAX_LENGTH

log = logging.getLogger("omnistage.ar_encoder.vllm")

# Qwen2 config keys taken from Qwen2.5-VL's text_config (everything a Qwen2Model needs).
_QWEN2_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "initializer_range",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
)


_VLLM_DTYPES: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


class EngineStartError(RuntimeError):
    """vLLM's engine could not start; the service must not become ready."""


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _lm_weight_name(name: str) -> str | None:
    """Qwen2.5-VL checkpoint name -> Qwen2ForCausalLM name; None for the vision tower."""
    if name.startswith(("visual.", "model.visual.")):
        return None
    if name.startswith("model.language_model."):  # transformers 5's own layout
        return "model." + name.removeprefix("model.language_model.")
    return name  # the released checkpoints' layout: model.*, lm_head.weight


def export_qwen2(model_dir: Path, out_dir: Path) -> Path:
    """Write text_encoder/'s language model as a Qwen2 checkpoint (config, weights, tokenizer)
    into `out_dir`, shard by shard (a 7B LM never sits twice in memory)."""
    src = model_dir / "text_encoder"
    full = json.loads((src / "config.json").read_text())
    text = full.get("text_config", full)
    config: dict[str, Any] = {k: text[k] for k in _QWEN2_KEYS if k in text}
    rope = dict(text.get("rope_parameters") or {})
    rope.pop("mrope_section", None)  # text-only mrope positions are 1-D rope positions
    rope_theta = rope.get("rope_theta", text.get("rope_theta", 1000000.0))
    config.update(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rope_theta=rope_theta,
        rope_parameters={"rope_type": "default", **rope, "rope_theta": rope_theta},
        tie_word_embeddings=bool(full.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        torch_dtype=str(full.get("dtype") or full.get("torch_dtype") or "float32"),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for shard in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                new = _lm_weight_name(name)
                if new is not None:
                    tensors[new] = f.get_tensor(name)
        if tensors:
            save_file(tensors, str(out_dir / shard.name), metadata={"format": "pt"})
    # vLLM finds the shards by pattern; no index file is needed.
    for item in (model_dir / "tokenizer").iterdir():
        if item.is_file():
            shutil.copy(item, out_dir / item.name)
    return out_dir


class VllmTextEncoder:
    """Per-text prompt hidden states from vLLM's AsyncLLM (one engine per service)."""

    name = "vllm"

    def __init__(
        self, model_dir: Path, dtype: torch.dtype, *, memory_fraction: float = 0.1, seed: int = 0
    ) -> None:
        """Export the LM, then start the engine (~25 s on CPU). Raises EngineStartError."""
        from vllm import AsyncEngineArgs
        from vllm.config import PoolerConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        self.dtype = dtype
        self.tokenizer = Qwen2Tokenizer.from_pretrained(model_dir / "tokenizer")
        self._export = Path(tempfile.mkdtemp(prefix="omnistage-vllm-"))
        self._ids = itertools.count()
        self.engine: Any = None
        try:
            export_qwen2(model_dir, self._export)
        except (OSError, ValueError, KeyError) as exc:
            self._cleanup()
            raise EngineStartError(f"cannot export the text encoder for vLLM: {exc}") from exc
        args = AsyncEngineArgs(
            model=str(self._export),
            runner="pooling",
            pooler_config=PoolerConfig(task="token_embed", use_activation=False),
            dtype=_VLLM_DTYPES[dtype],
            max_model_len=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP,
            # Every prompt shares the system prefix; cached prefix blocks would skip its states.
            enable_prefix_caching=False,
            enforce_eager=True,
            gpu_memory_utilization=memory_fraction,
            seed=seed,
        )
        try:
            self.engine = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM raises plain RuntimeErrors (and more) for a failed start
            self._cleanup()
            raise EngineStartError(f"the vLLM engine failed to start: {exc}") from exc
        self._pooling_params = self._make_pooling_params()
        log.info("vLLM engine ready (Qwen2 export of the text encoder, %s)", self.dtype)

    @staticmethod
    def _make_pooling_params() -> Any:
        from vllm import PoolingParams

        return PoolingParams(task="token_embed", use_activation=False)

    async def _embed_one(self, token_ids: list[int]) -> torch.Tensor:
        from vllm.inputs import TokensPrompt

        final = None
        request_id = f"omnistage-{next(self._ids)}"
        async for output in self.engine.encode(
            TokensPrompt(prompt_token_ids=token_ids), self._pooling_params, request_id
        ):
            final = output
        if final is None:
            raise RuntimeError("vLLM returned no output")
        hidden = final.outputs.data
        return hidden[PROMPT_TEMPLATE_DROP:].to(self.dtype)

    async def embed_texts(self, texts: list[str]) -> list[torch.Tensor]:
        """Per text its states [L_i, D] without the system prefix; the engine batches them."""
        token_ids = template_tokens(self.tokenizer, texts).input_ids
        return list(await asyncio.gather(*(self._embed_one(list(ids)) for ids in token_ids)))

    def _cleanup(self) -> None:
        shutil.rmtree(self._export, ignore_errors=True)

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
            del engine  # collected now, not by vLLM's __del__ at interpreter exit
        self._cleanup()
