"""What each Qwen2.5-Omni stage replica loads: the sub-models of the roles it serves, as one
stage model whose attribute names are the module paths family.MODULES declares."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from omni_common.models.base import Runner, StageContext, StageModel


class QwenOmniStage:
    """One stage's runners: ar-encoder thinker and/or talker (`--roles` scales them apart),
    dit-denoise token2wav, vae-decode vocoder."""

    def __init__(self, stage: str, model_dir: Path, context: StageContext) -> None:
        self._runners: dict[str, Runner] = {}
        self.thinker: nn.Module | None = None
        self.talker: nn.Module | None = None
        self.dit: nn.Module | None = None
        self.bigvgan: nn.Module | None = None
        if stage == "ar-encoder":
            if context.backend != "torch":
                raise SystemExit(
                    "ar-encoder: the Qwen2.5-Omni thinker and talker run on the torch backend; vLLM 0.32 "
                    "serves the thinker but returns no per-token hidden states of generated tokens"
                )
            if context.wants("thinker"):
                from omni_common.models.qwen_omni.thinker import Thinker

                thinker = Thinker.load(
                    model_dir,
                    context.device,
                    context.dtype,
                    max_slots=context.max_queue,
                    prefix_bytes=0 if context.cache_bypass else context.cache_bytes,
                    prefill_chunk_tokens=context.prefill_chunk_tokens,
                    decode=context.ar_decode,
                )
                self.thinker, self._runners["thinker"] = thinker.model, thinker
            if context.wants("talker"):
                from omni_common.models.qwen_omni.talker import Talker

                talker = Talker.load(
                    model_dir,
                    context.device,
                    context.dtype,
                    max_slots=context.max_queue,
                    decode=context.ar_decode,
                )
                self.talker, self._runners["talker"] = talker.model, talker
        elif stage == "dit-denoise":
            from omni_common.models.qwen_omni.token2wav import MAX_OPEN, Token2Wav

            options = context.denoiser
            token2wav = Token2Wav.load(
                model_dir,
                context.device,
                options.cuda_graphs,
                options.compile,
                max_open=min(MAX_OPEN, context.max_batch),
                dtype=torch.bfloat16 if options.quantization == "bf16" else torch.float32,
            )
            self.dit, self._runners["token2wav"] = token2wav.dit, token2wav
        else:
            from omni_common.models.qwen_omni.vocoder import Vocoder

            vocoder = Vocoder.load(model_dir, context.device, context.cuda_graphs)
            self.bigvgan, self._runners["vocoder"] = vocoder.bigvgan, vocoder

    @property
    def runners(self) -> Mapping[str, Runner]:
        return self._runners


def load_stage(stage: str, model_dir: Path, context: StageContext) -> StageModel:
    return QwenOmniStage(stage, model_dir, context)
