"""Qwen2.5-Omni thinker role: writes the reply token by token (continuously batched) and streams,
as it goes, what the talker reads and what the client shows.

Reads like the thinker half of `Qwen2_5OmniForConditionalGeneration.generate` for one text
prompt: `thinker.generate(output_hidden_states=True)` split into a prefill and decode steps
(generation.py), then, per token, the talker's input row: the last layer's hidden state plus
the embedding (layer 0) of the token that step fed in. The prefill gives the prompt's rows;
decode step k gives the row of token k-1 (the last token picked is never fed back, so it has
none), exactly the rows `generate` sums into `talker_inputs_embeds` and `thinker_reply_part`.

Chunks (StreamingRunner.take_partial), one per decode step once the first row exists:
chunk 0 holds "prompt" [L, H] (the prompt's rows), "specials" [3, H]
(the embeddings of the speaker's text-bos, the talker's text-eos and text-pad tokens, which the
talker appends to the stream) and "reply" [1, H]; later chunks "reply" [n, H]. Meta "text" is
the reply text the chunk adds. Text-only requests send text alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, Qwen2_5OmniThinkerForConditionalGeneration

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.generation import GenerationState, SlotGenerator, decode_mode
from omni_common.models.graphed_decode import Launched
from omni_common.models.qwen_omni.checkpoint import (
    chat_input_ids,
    load_config,
    load_part,
    load_speakers,
    load_tokenizer,
    speaker,
)
from omni_common.models.qwen_omni.options import option_int, speaker_of
from omni_common.models.sampling import Sampling

MAX_SLOTS = 64
MAX_TOKENS = 16384  # per request (prompt + reply) with the eager decode
# The graphed decode reserves every slot's KV up front (~56 KiB a token at 7B): 64 x 4096 is
# ~15 GiB on the GPU, beside the thinker's 15 GiB of weights.
GRAPHED_MAX_TOKENS = 4096


@dataclass(kw_only=True, eq=False)
class ThinkerState(GenerationState):
    speak: bool
    rows: list[torch.Tensor] = field(default_factory=list)  # talker rows not sent yet, [n, H] each
    first: dict[str, torch.Tensor] = field(default_factory=dict)  # what chunk 0 adds
    text_sent: str = ""


class Thinker(SlotGenerator):
    """The "thinker" role (a StreamingRunner)."""

    def __init__(
        self,
        model: Qwen2_5OmniThinkerForConditionalGeneration,
        tokenizer: Any,
        speakers: dict[str, dict[str, Any]],
        talker_text_ids: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = MAX_SLOTS,
        *,
        max_tokens: int = MAX_TOKENS,
        decode: str = "auto",
    ) -> None:
        # The text decoder: `model.model` up to transformers 5.20, `model.model.language_model` after.
        super().__init__(
            model.get_decoder(),
            device,
            dtype,
            max_slots,
            max_tokens,
            decode=decode,
            model=model,
            position_rows=4,
            keep_rows=True,
        )
        self.model = model
        self.tokenizer = tokenizer
        self.speakers = speakers
        self.talker_text_ids = talker_text_ids  # (text eos, text pad) of the talker's config

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = MAX_SLOTS,
        *,
        max_tokens: int | None = None,
        decode: str = "auto",
    ) -> Thinker:
        config = load_config(model_dir)
        model = load_part(
            Qwen2_5OmniThinkerForConditionalGeneration,
            config.thinker_config,
            model_dir,
            "thinker",
            device,
            dtype,
        )
        talker: Any = config.talker_config
        ids = (talker.tts_text_end_token_id, talker.tts_text_pad_token_id)
        if max_tokens is None:
            max_tokens = GRAPHED_MAX_TOKENS if decode_mode(decode, device) == "graphs" else MAX_TOKENS
        return cls(
            model,
            load_tokenizer(model_dir),
            load_speakers(model_dir),
            ids,
            device,
            dtype,
            max_slots,
            max_tokens=max_tokens,
            decode=decode,
        )

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, inputs: StageState) -> ThinkerState:
        """The prompt's prefill, which picks the first token."""
        bos = int(speaker(self.speakers, speaker_of(request))["bos_token"])
        input_ids = chat_input_ids(self.tokenizer, request.prompt).to(self.device)
        total = option_int(request, "max_new_tokens")
        length = input_ids.shape[1]
        slot = self.slots.acquire(length + total)
        try:
            state = ThinkerState(
                request=request,
                step_index=0,
                total_steps=total,
                slot=slot,
                sampling=Sampling.build(
                    self.model,
                    input_ids,
                    total,
                    request.seed,
                    do_sample=bool(option_int(request, "thinker_do_sample")),
                ),
                eos=frozenset(_eos_ids(self.model)),
                sequence=torch.cat([input_ids, input_ids.new_zeros(1, total)], dim=1),
                prompt_length=length,
                speak=bool(option_int(request, "audio")),
            )
            self.check_graphable(state.sampling)
            cache = DynamicCache(config=self.model.config.get_text_config())
            output = self.model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1,
            )
            self.fill_slot(state, cache)
            if state.speak:
                hidden = output.hidden_states
                embed = self.model.get_input_embeddings()
                specials = torch.tensor([bos, *self.talker_text_ids], device=self.device)
                state.first = {"prompt": hidden[-1][0] + hidden[0][0], "specials": embed(specials)}
            self.pick([state], output.logits)
            self.join(state, None)
        except BaseException:
            self.slots.release(slot)
            raise
        return state

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        """One decode forward for every state not done: a row each, then a token each."""
        live = self.live(states)
        if self.graphed is not None:
            self.graphed_rows(self.graphed_step(live))
            return
        if not live:
            return
        cache = self.slots.batch([state.slot for state in live])
        tokens = torch.stack(
            [state.sequence[:, state.prompt_length + state.step_index - 1] for state in live]
        )
        output = self.model(
            input_ids=tokens,
            position_ids=self.positions(live, rows=4),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
            **cache.attention_kwargs,
        )
        rows = output.hidden_states[-1][:, 0] + output.hidden_states[0][:, 0]
        for row, state in enumerate(live):
            if isinstance(state, ThinkerState) and state.speak:
                state.rows.append(rows[row : row + 1])
        self.pick(live, output.logits)
        cache.advance()

    def graphed_rows(self, read: tuple[Launched, list[GenerationState]] | None) -> None:
        """The talker rows of a graphed step just read (the row of the token each state fed
        in, as the eager step appends it): a view of the step's rows per speaking state."""
        if read is None:
            return
        launched, states = read
        rows = launched.extra["rows"]
        for state in states:
            if isinstance(state, ThinkerState) and state.speak:
                state.rows.append(rows[state.slot.index : state.slot.index + 1])

    def feed(self, state: StepState, chunk: StageState, end: bool) -> None:
        raise InvalidArgument("the thinker takes no streamed input")

    def ready(self, state: StepState) -> bool:
        return True

    def take_partial(self, state: StepState) -> StageState | None:
        """The rows and text made since the last chunk (chunk 0 waits for the first row)."""
        assert isinstance(state, ThinkerState)
        text = self.tokenizer.decode(state.generated, skip_special_tokens=True)
        if not self.is_done(state):  # a character whose bytes are not all here yet waits
            text = text.rstrip("\ufffd")
        delta = text[len(state.text_sent) :] if text.startswith(state.text_sent) else ""
        tensors: dict[str, torch.Tensor] = {}
        if state.speak and state.rows:
            tensors = {**state.first, "reply": torch.cat(state.rows)} if state.chunks_sent == 0 else {}
            tensors.setdefault("reply", torch.cat(state.rows))
            state.rows.clear()
        elif state.speak and state.chunks_sent == 0 and not self.is_done(state):
            return None  # the talker's first step needs the first row
        if not tensors and not delta:
            return None
        state.text_sent += delta
        meta = {"chunk": str(state.chunks_sent), "text": delta}
        state.chunks_sent += 1
        return StageState(tensors=tensors, meta=meta)

    def finish(self, state: StepState) -> StageState:
        """{"text_ids": [n]} (the reply's tokens, eos kept); meta "tokens"."""
        assert isinstance(state, ThinkerState)
        try:
            return StageState(
                tensors={"text_ids": state.generated.clone()}, meta={"tokens": str(state.step_index)}
            )
        finally:
            self.release(state)


def _eos_ids(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
