"""Qwen2.5-Omni thinker role: writes the reply token by token (continuously batched) and streams,
as it goes, what the talker reads and what the client shows.

Reads like the thinker half of `Qwen2_5OmniForConditionalGeneration.generate` for one text
prompt: `thinker.generate(output_hidden_states=True)` split into a prefill and decode steps
(generation.py), then, per token, the talker's input row: the last layer's hidden state plus
the embedding (layer 0) of the token that step fed in. The prefill gives the prompt's rows;
decode step k gives the row of token k-1 (the last token picked is never fed back, so it has
none), exactly the rows `generate` sums into `talker_inputs_embeds` and `thinker_reply_part`.

Chunks (StreamingRunner.take_partial), once the first row exists, after every decode step that
adds text or completes a group of rows: chunk 0 holds "prompt" [L, H] (the prompt's rows),
"specials" [3, H] (the embeddings of the speaker's text-bos, the talker's text-eos and text-pad
tokens, which the talker appends to the stream) and "reply" [1, H], the first row alone, so the
talker starts at once; later chunks hold "reply" [k, H] every k tokens (option feed_tokens; the
rest at the end): the talker is fed a group per k tokens, not an RPC per token, and trails the
thinker by fewer than k rows. Chunks in between carry text alone (the coordinator feeds the
talker none of them). Meta "text" is the reply text the chunk adds. The chunks depend on the
tokens alone, never on timing, so a thinker that restarts elsewhere sends the same ones.
Text-only requests send text alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import DynamicCache, Qwen2_5OmniThinkerForConditionalGeneration

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.generation import GenerationState, Prefill, SlotGenerator, decode_mode
from omni_common.models.graphed_decode import Launched
from omni_common.models.kv_slots import KVSlot, cache_keyword
from omni_common.models.prefix_cache import (
    DEFAULT_MAX_BYTES,
    PrefixCache,
    PrefixEntry,
    PrefixStats,
    prefix_key,
)
from omni_common.models.prefix_transfer import entry_of, kv_shape_of, prefix_state, split_moved
from omni_common.models.qwen_omni.chat_tokens import ChatTokens
from omni_common.models.qwen_omni.checkpoint import load_config, load_part, load_speakers, speaker
from omni_common.models.qwen_omni.last_position_head import head_on_last_position
from omni_common.models.qwen_omni.options import option_int, speaker_of
from omni_common.models.qwen_omni.processor import OmniProcessor, ThinkerPrompt, load_processor
from omni_common.models.sampling import Sampling

MAX_SLOTS = 64
MAX_TOKENS = 16384  # per request (prompt + reply) with the eager decode
# The graphed decode reserves every slot's KV up front (~56 KiB a token at 7B): 64 x 4096 is
# ~15 GiB on the GPU, beside the thinker's 15 GiB of weights.
GRAPHED_MAX_TOKENS = 4096


@dataclass(kw_only=True, eq=False)
class ThinkerState(GenerationState):
    speak: bool
    feed_rows: int  # talker rows per chunk after the first
    rows: list[torch.Tensor] = field(default_factory=list)  # talker rows not sent yet, [n, H] each
    first: dict[str, torch.Tensor] = field(default_factory=dict)  # what chunk 0 adds
    text_sent: str = ""
    prompt: ThinkerPrompt
    history: list[torch.Tensor] = field(default_factory=list)  # the reply's talker rows sent so far
    # The prompt's KV to keep, (its key, its talker rows): copied once the first token has gone
    # out (`_keep_prompt`), not on its way.
    keep: tuple[str, torch.Tensor | None] | None = None


class Thinker(SlotGenerator):
    """The "thinker" role (a StreamingRunner)."""

    def __init__(
        self,
        model: Qwen2_5OmniThinkerForConditionalGeneration,
        processor: OmniProcessor,
        speakers: dict[str, dict[str, Any]],
        talker_text_ids: tuple[int, int],
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = MAX_SLOTS,
        *,
        max_tokens: int = MAX_TOKENS,
        decode: str = "auto",
        prefix_bytes: int = DEFAULT_MAX_BYTES,
        prefill_chunk_tokens: int = 0,
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
            prefill_chunk_tokens=prefill_chunk_tokens,
            extend=True,
        )
        self.model = model
        self.processor = processor
        self.tokenizer: Any = processor.tokenizer
        self.chat_tokens = ChatTokens(self.tokenizer)  # a conversation's earlier messages' ids
        self.prefixes = PrefixCache(prefix_bytes)
        config: Any = model.config
        self.kv_shape = kv_shape_of(config.get_text_config(), dtype)  # what a moved prefix must be
        self.media_token_ids = torch.tensor(
            [config.audio_token_index, config.image_token_index, config.video_token_index], device=device
        )
        self.speakers = speakers
        self.talker_text_ids = talker_text_ids  # (text eos, text pad) of the talker's config
        # A prefill's logits of its last position only, on CUDA. On the CPU the head runs as in
        # transformers: a product's rounding depends on its row count, and CPU replies equal
        # `generate`'s bit for bit.
        self.last_position_head = device.type == "cuda"
        # A request with the default options: its graphed steps get recorded while idle.
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.expect_sampling(self._sampling(GenerationRequest(prompt=""), token, 1))

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
        prefix_bytes: int = DEFAULT_MAX_BYTES,
        prefill_chunk_tokens: int = 0,
    ) -> Thinker:
        """The checkpoint's thinker; `prefix_bytes` bounds its prefix KV cache (0: off);
        `prefill_chunk_tokens` chunks longer prompts' prefills (0: off; SlotGenerator)."""
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
            load_processor(model_dir),
            load_speakers(model_dir),
            ids,
            device,
            dtype,
            max_slots,
            max_tokens=max_tokens,
            decode=decode,
            prefix_bytes=prefix_bytes,
            prefill_chunk_tokens=prefill_chunk_tokens,
        )

    def weights_changed(self) -> None:
        """New weights (LoadWeights): the kept prefixes' KV was computed with the old ones."""
        self.prefixes.clear()

    def prefix_stats(self) -> PrefixStats:
        """The prefix cache's counters (SupportsPrefixCache: the stage's metrics)."""
        return self.prefixes.stats

    @torch.no_grad()
    def export_prefix(self, request: GenerationRequest, inputs: StageState) -> StageState:
        """The KV of the longest prefix of `request`'s prompt kept here, for another replica
        (ExportsPrefixes; prefix_transfer.py); empty when none is."""
        prompt = self._prompt(request, inputs.tensors)
        found = self.prefixes.peek(prompt.length, prompt.key, rows=bool(option_int(request, "audio")))
        return StageState(tensors={}, meta={}) if found is None else prefix_state(*found)

    def _prompt(self, request: GenerationRequest, tensors: Mapping[str, torch.Tensor]) -> ThinkerPrompt:
        return ThinkerPrompt.of(self.processor, self.model, request, tensors, self.device, self.chat_tokens)

    @torch.no_grad()
    def _sampling(self, request: GenerationRequest, input_ids: torch.Tensor, total: int) -> Sampling:
        do_sample = bool(option_int(request, "thinker_do_sample"))
        return Sampling.build(self.model, input_ids, total, request.seed, do_sample=do_sample)

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, inputs: StageState) -> ThinkerState:
        """The prompt's prefill, which picks the first token; a prefix of the prompt whose KV this
        replica kept (an earlier turn of the conversation), or that came with the inputs from
        another replica, is not computed again. A prompt with more than `prefill_chunk_tokens`
        tokens left to compute, or any while other requests hold slots, is prefilled by the steps
        instead, a chunk each (`step`, `prefills_at_once`)."""
        speaker(self.speakers, speaker_of(request))  # an unknown speaker fails here, not mid-prefill
        tensors, moved = split_moved(inputs.tensors)
        prompt = self._prompt(request, tensors)
        if moved:
            self._install(prompt, moved, inputs.meta)
        total = option_int(request, "max_new_tokens")
        length = prompt.length
        speak = bool(option_int(request, "audio"))
        slot = self.slots.acquire(length + total)
        try:
            sampling = self._sampling(request, prompt.input_ids, total)
            self.check_graphable(sampling)
            prefill = self._start_prefill(prompt, speak, slot)
            state = ThinkerState(
                request=request,
                step_index=0,
                total_steps=total,
                slot=slot,
                sampling=sampling,
                eos=frozenset(_eos_ids(self.model)),
                sequence=torch.cat([prompt.input_ids, prompt.input_ids.new_zeros(1, total)], dim=1),
                prompt_length=length,
                position_offset=prompt.rope_delta,
                speak=speak,
                feed_rows=option_int(request, "feed_tokens"),
                prompt=prompt,
                prefill=prefill,
            )
            if self.prefills_at_once(length - prefill.done):
                self._prefill_chunk(state)
        except BaseException:
            self.slots.release(slot)
            raise
        return state

    def _install(self, prompt: ThinkerPrompt, moved: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Keep a prefix moved from another replica, checked against this model, when it is a
        prefix of `prompt` (its key says so); else the prompt is computed in full."""
        key, entry = entry_of(moved, meta, self.kv_shape, self.device)
        if entry.length < prompt.length and prompt.key(entry.length) == key:
            self.prefixes.put(key, entry)

    def _decode_positions(self, state: ThinkerState) -> torch.Tensor | None:
        """The graphed decode's rope positions for `state`'s picked tokens: past the prompt,
        from its offset (media shift them); None for a text prompt (the graph's own count)."""
        if self.graphed is None or not state.position_offset:
            return None
        start = state.slot.length + state.position_offset
        count = self.graphed.rope.shape[2]
        return torch.arange(start, start + count, device=self.device).expand(4, -1)

    def _start_prefill(self, prompt: ThinkerPrompt, speak: bool, slot: KVSlot) -> Prefill:
        """The prefill of `prompt` before its first forward, with the KV (and talker rows) of
        the longest prefix this replica kept, if any: in `slot` when the rest runs as a graphed
        extend (which reads the slot), else as its transformers cache."""
        cache = DynamicCache(config=self.model.config.get_text_config())
        prefix = self.prefixes.lookup(prompt.length, prompt.key, rows=speak)
        if prefix is None:
            return Prefill(cache, 0)
        if self._extends(prompt, prefix.length, self._chunk_end(prompt, prefix.length)):
            self.slots.fill(slot, prefix.keys, prefix.values)
        else:
            for layer, (keys, values) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
                cache.update(keys.clone(), values.clone(), layer)
        return Prefill(cache, prefix.length, [] if prefix.rows is None else [prefix.rows])

    def _chunk_end(self, prompt: ThinkerPrompt, start: int) -> int:
        """Where the prefill's chunk from `start` ends (the prompt's end when chunking is off)."""
        if self.prefill_chunk_tokens:
            return prompt.chunk_end(start, self.prefill_chunk_tokens)
        return prompt.length

    def _prefill_chunk(self, state: ThinkerState) -> None:
        """The forward over the prompt's next chunk (the rest of it when chunking is off) and
        its talker rows (last hidden + embedding); after the last chunk, the prompt's cache goes
        into the slot, chunk 0's tensors are made and the first token is picked."""
        prompt, prefill = state.prompt, state.prefill
        assert prefill is not None
        start = prefill.done
        end = self._chunk_end(prompt, start)
        if self._extends(prompt, start, end):
            logits = self._extend(state, prefill, start, end)
        else:
            logits = self._eager_chunk(prompt, prefill, start, end)
        prefill.done = end
        if end < prompt.length:
            return
        rows = prefill.kept[0] if len(prefill.kept) == 1 else torch.cat(prefill.kept)
        state.prefill = None
        if state.slot.length != end:  # (an extend wrote the slot itself)
            self.fill_slot(state, prefill.cache)
        if state.speak:
            bos = int(speaker(self.speakers, speaker_of(state.request))["bos_token"])
            specials = torch.tensor([bos, *self.talker_text_ids], device=self.device)
            state.first = {"prompt": rows, "specials": self.model.get_input_embeddings()(specials)}
        self.pick([state], logits)
        state.keep = (prompt.key(end), rows)
        self.join(state, self._decode_positions(state))

    def _eager_chunk(self, prompt: ThinkerPrompt, prefill: Prefill, start: int, end: int) -> torch.Tensor:
        """transformers' forward over tokens [start, end) into the prefill's cache; their talker
        rows kept; the last token's logits."""
        with head_on_last_position(self.model, self.last_position_head):
            output = self.model(
                input_ids=prompt.input_ids[:, start:end],
                attention_mask=torch.ones_like(prompt.input_ids[:, :end]),
                position_ids=prompt.positions[..., start:end],
                **{cache_keyword(self.model): prefill.cache},
                use_cache=True,
                output_hidden_states=True,
                logits_to_keep=1,
                **prompt.media_between(start, end),
            )
        hidden = output.hidden_states
        # `generate` zeroes the embedding half of the talker's row at audio and image
        # placeholders (the talker hears the thinker's last layer there, not the features).
        placeholders = torch.isin(prompt.input_ids[0, start:end], self.media_token_ids)
        prefill.kept.append(hidden[-1][0] + hidden[0][0].masked_fill(placeholders.unsqueeze(-1), 0))
        return cast(torch.Tensor, output.logits)

    def _extends(self, prompt: ThinkerPrompt, start: int, end: int) -> bool:
        """Whether tokens [start, end) run as a graphed extend: the prompt's last chunk, short
        enough for a bucket already recorded (GraphedExtend.ready), text only (a clip or
        picture takes its features' eager path)."""
        extend = self.extend
        if extend is None or end < prompt.length or not extend.ready(end - start):
            return False
        return not any(opens < end and start <= closes for opens, closes in prompt.spans)

    def _extend(self, state: ThinkerState, prefill: Prefill, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) as a recorded forward into the slot, after what the prefill
        cached (a kept prefix, earlier chunks); their talker rows kept; the last token's logits."""
        assert self.extend is not None
        if state.slot.length != start:  # (the cache of earlier eager chunks; a prefix is there)
            self.fill_slot(state, prefill.cache)
        prompt = state.prompt
        hidden, embeds, logits = self.extend.run(
            state.slot, prompt.input_ids[0, start:end], prompt.positions[:, 0, start:end]
        )
        prefill.kept.append(hidden + embeds)  # text only: no placeholder to zero
        return logits.view(1, 1, -1)

    def _keep_prompt(self, state: ThinkerState) -> None:
        """Keep the prompt's KV that `state`'s slot caches (copies) for later prompts that start
        so, once: after its first token went out (the next step, or its end). The prompt's
        part of the slot stays as it is until the slot is released (a step writes past it)."""
        if state.keep is None or state.slot.released:
            return
        (key, rows), state.keep = state.keep, None
        if self.prefixes.max_bytes <= 0:
            return
        length = state.prompt_length
        keys, values = self.slots.read(state.slot, length)
        kept = None if rows is None else rows[:length].clone()
        self.prefixes.put(key, PrefixEntry(length, keys, values, kept))

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        """One decode forward for every prefilled state not done (a row each, then a token
        each), then the next chunk of the earliest prompt being prefilled a chunk per step
        (`next_prefill`): a running reply waits for one chunk, never for a whole long prompt."""
        self._decode(self.live(states))
        for state in states:  # (while the step runs on the device)
            assert isinstance(state, ThinkerState)
            self._keep_prompt(state)
        prefilling = self.next_prefill(states)
        if prefilling is not None:
            assert isinstance(prefilling, ThinkerState)
            self._prefill_chunk(prefilling)
            self.chunks_prefilled += 1

    def _decode(self, live: list[GenerationState]) -> None:
        """One decode forward for `live`: a row each, then a token each."""
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
            **{cache_keyword(self.model): cache},
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
        if state.speak and state.rows and self._rows_due(state):
            tensors = {**state.first, "reply": torch.cat(state.rows)} if state.chunks_sent == 0 else {}
            tensors.setdefault("reply", torch.cat(state.rows))
            state.history.extend(state.rows)
            state.rows.clear()
        elif state.speak and state.chunks_sent == 0 and not self.is_done(state):
            return None  # the talker's first step needs the first row
        if not tensors and not delta:
            return None
        state.text_sent += delta
        meta = {"chunk": str(state.chunks_sent), "text": delta}
        state.chunks_sent += 1
        return StageState(tensors=tensors, meta=meta)

    def _rows_due(self, state: ThinkerState) -> bool:
        """Whether the rows made go now: the first at once, then a group of `feed_rows`, the
        rest at the end."""
        return state.chunks_sent == 0 or len(state.rows) >= state.feed_rows or self.is_done(state)

    def finish(self, state: StepState) -> StageState:
        """{"text_ids": [n]} (the reply's tokens, eos kept); meta "tokens"."""
        assert isinstance(state, ThinkerState)
        try:
            self._keep_prompt(state)
            self._keep_reply(state)
            return StageState(
                tensors={"text_ids": state.generated.clone()}, meta={"tokens": str(state.step_index)}
            )
        finally:
            self.release(state)

    def _keep_reply(self, state: ThinkerState) -> None:
        """Keep the prompt and the reply tokens fed so far (all but the last picked) for the
        conversation's next turn, which re-sends them; only while nothing failed."""
        fed = state.slot.length
        if self.prefixes.max_bytes <= 0 or not state.finite or fed <= state.prompt_length:
            return
        rows = None
        if state.speak:
            rows = torch.cat([state.first["prompt"], *state.history, *state.rows])
            if rows.shape[0] != fed:
                return  # rows not all made yet: the prompt's entry still serves
        keys, values = self.slots.read(state.slot)
        key = prefix_key(state.sequence[0, :fed], state.prompt.media_digests)
        self.prefixes.put(key, PrefixEntry(fed, keys, values, rows))


def _eos_ids(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
