"""Qwen2.5-Omni talker role: codec tokens from the thinker's rows, one row per step, as they
stream in (continuously batched; generation.py).

Reads like the talker half of `Qwen2_5OmniForConditionalGeneration.generate` for one request:
the prefill's inputs are the prompt's rows, the speaker's text-bos embedding and the first reply
row (`talker_inputs_embeds`), over the codec prompt [mask x L, pad, bos] (with no attention mask
and default positions, as `generate` runs the talker in transformers 5.19); decode step j adds
the codec embedding of the last code to the j-th element of `thinker_reply_part` — the reply
rows from the second on, then the text-eos and text-pad embeddings, the pad repeating once all
are used. Here that list grows as the thinker's chunks arrive: a state is `ready` when its next
element exists, or when the thinker has ended (eos and pad are then known). Sampling is
`talker.generate`'s own (top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05,
codec-bos suppressed, eos = codec pad or end) from the request's generator.

Codes leave in chunks of CODES_PER_CHUNK ("codes" [n] int64; the eos is not sent).

Checkpoints (every few codes): the codes picked so far and the request's generator, a few KB.
The KV cache is not in them (at real size ~24 KB a code, a checkpoint would grow with the
reply): a replica that takes over prefills the thinker's first chunk as usual, then, once the
stream has brought the rows those codes read, recomputes their KV in one forward (`_catch_up`,
as vLLM recomputes a preempted request) and samples on from the checkpoint's generator. That
KV equals the stepped one within float rounding, so the codes that follow are the
uninterrupted ones unless a draw falls within rounding of a boundary, as in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import DynamicCache, Qwen2_5OmniTalkerForConditionalGeneration

from omni_common.errors import InvalidArgument
from omni_common.models.base import GenerationRequest, StageState, StepState
from omni_common.models.generation import MAX_TOKENS, GenerationState, SlotGenerator, decode_mode
from omni_common.models.graphed_decode import DecodeIO
from omni_common.models.kv_slots import cache_keyword
from omni_common.models.qwen_omni.checkpoint import load_config, load_part
from omni_common.models.qwen_omni.options import option_int
from omni_common.models.qwen_omni.resume import GENERATOR, generator_state, meta_int, restore_generator
from omni_common.models.sampling import Sampling

MAX_SLOTS = 64
# The graphed decode reserves every slot's KV up front (48 KiB a token at real size: 24 layers,
# 4 KV heads of 128): 64 x 8192 is 24 GiB, beside the talker's 2.7 GB of weights.
GRAPHED_MAX_TOKENS = 8192
CODES_PER_CHUNK = 12  # one token2wav DiT block (24 mel frames at 2 frames per code)
# What `generate` passes the talker besides the caps (its keyword defaults).
TALKER_SAMPLING = {"top_k": 40, "top_p": 0.8, "temperature": 0.9, "repetition_penalty": 1.05}


@dataclass(kw_only=True, eq=False)
class TalkerState(GenerationState):
    reply: list[torch.Tensor]  # the thinker's rows [1, H] still to read, in order
    specials: torch.Tensor  # [3, H]: text-bos, text-eos, text-pad embeddings
    thinker_ended: bool = False
    eos_given: bool = False
    codes_sent: int = 0
    # Restored from a checkpoint: decode steps whose KV is still to recompute (_catch_up).
    replay: int = 0


class Talker(SlotGenerator):
    """The "talker" role (a StreamingRunner)."""

    def __init__(
        self,
        model: Qwen2_5OmniTalkerForConditionalGeneration,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int,
        *,
        decode: str = "eager",
    ) -> None:
        """`decode`: "graphs" (or "auto" on CUDA) records each batch bucket's step as a CUDA
        graph: the step's input is the code's embedding plus the thinker row the host sets for
        it, and the repetition penalty reads a mask of each row's codes seen (the stage's
        --ar-decode auto: graphs on a GPU, as the thinker's)."""
        graphed = decode_mode(decode, device) == "graphs"
        embed = model.get_input_embeddings()
        super().__init__(
            model.model,
            device,
            dtype,
            max_slots,
            GRAPHED_MAX_TOKENS if graphed else MAX_TOKENS,
            decode=decode,
            model=model,
            io=DecodeIO(
                inputs=lambda codes, rows: model.thinker_to_talker_proj(embed(codes) + rows),
                head=model.codec_head,
                row_width=model.config.embedding_size,
                # The prefill's input is its rows alone (`prepare`: the codec prompt's ids are
                # not embedded there).
                prefill=model.thinker_to_talker_proj,
            ),
            extend=True,
        )
        self.model = model
        self.eos = frozenset((model.codec_pad_token, model.codec_eos_token))
        # A request with the default options: its graphed steps get recorded while idle, before
        # the first reply (a recording holds the step loop for up to a minute at real size).
        codes = torch.tensor([[model.codec_pad_token, model.codec_bos_token]], device=device)
        self.expect_sampling(self._sampling(GenerationRequest(prompt=""), codes, 1))

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_slots: int = MAX_SLOTS,
        *,
        decode: str = "eager",
    ) -> Talker:
        config = load_config(model_dir)
        model = load_part(
            Qwen2_5OmniTalkerForConditionalGeneration,
            config.talker_config,
            model_dir,
            "talker",
            device,
            dtype,
        )
        return cls(model, device, dtype, max_slots, decode=decode)

    def _sampling(self, request: GenerationRequest, codec_prompt: torch.Tensor, total: int) -> Sampling:
        m = self.model
        return Sampling.build(
            m,
            codec_prompt,
            total,
            request.seed,
            do_sample=bool(option_int(request, "talker_do_sample")),
            suppress_tokens=[m.codec_bos_token],
            eos_token_id=sorted(self.eos),
            pad_token_id=m.codec_pad_token,
            **TALKER_SAMPLING,
        )

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, inputs: StageState) -> TalkerState:
        """The prefill over the thinker's first chunk, which picks the first code: with the
        graphed decode, one recorded forward when the prompt fits a recorded bucket
        (graphed_extend.py; transformers' eager forward of a 64-token prompt holds the compute
        thread ~35 ms at real size), else transformers' forward."""
        first = _first_chunk(inputs, self.model.config.embedding_size)
        prompt, specials = first["prompt"], first["specials"]
        reply = list(first["reply"].to(self.device, self.dtype).split(1))
        length = prompt.shape[0] + 2
        total = option_int(request, "talker_max_new_tokens")
        m = self.model
        codec_prompt = torch.tensor(
            [[m.codec_mask_token] * prompt.shape[0] + [m.codec_pad_token, m.codec_bos_token]],
            device=self.device,
        )
        slot = self.slots.acquire(length + total)
        try:
            state = TalkerState(
                request=request,
                step_index=0,
                total_steps=total,
                slot=slot,
                sampling=self._sampling(request, codec_prompt, total),
                eos=self.eos,
                sequence=torch.cat([codec_prompt, codec_prompt.new_zeros(1, total)], dim=1),
                prompt_length=length,
                reply=reply[1:],
                specials=specials.to(self.device, self.dtype),
            )
            embeds = torch.cat([prompt.to(self.device, self.dtype), state.specials[:1], reply[0]])
            self.check_graphable(state.sampling)
            self.pick([state], self._prefill(state, codec_prompt, embeds))
            self.join(state, None)
        except BaseException:
            self.slots.release(slot)
            raise
        return state

    def _prefill(self, state: TalkerState, codec_prompt: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The prompt's forward into the state's slot: `embeds` [length, embedding_size] are its
        rows (the codec prompt's ids are not embedded: `generate`'s first talker call passes
        both and its forward reads the rows alone). Returns the logits to pick the first code
        from."""
        length = embeds.shape[0]
        extend = self.extend
        if extend is not None and extend.ready(length):
            positions = torch.arange(length, device=self.device).expand(extend.decode.position_rows, -1)
            _, _, logits = extend.run(state.slot, codec_prompt[0], positions, rows=embeds)
            return logits.view(1, 1, -1)
        cache = DynamicCache(config=self.model.config)
        output = self.model(
            input_ids=codec_prompt,
            inputs_embeds=embeds.unsqueeze(0),
            **{cache_keyword(self.model): cache},
            use_cache=True,
        )
        self.fill_slot(state, cache)
        return cast(torch.Tensor, output.logits)

    def feed(self, state: StepState, chunk: StageState, end: bool) -> None:
        assert isinstance(state, TalkerState)
        rows = chunk.tensors.get("reply")
        if rows is not None:
            if rows.dim() != 2 or rows.shape[1] != self.model.config.embedding_size:
                raise InvalidArgument("a thinker chunk's reply rows must be [n, embedding_size]")
            state.reply.extend(rows.to(self.device, self.dtype).split(1))
        if end:
            state.thinker_ended = True

    def ready(self, state: StepState) -> bool:
        """Whether a step has work for `state`: its next input is here, it is done, or (graphed)
        its launched step is still to be read."""
        assert isinstance(state, TalkerState)
        if self.is_done(state) or self._has_input(state):
            return True
        return self.pending is not None and any(s is state for s in self.pending[1])

    def _has_input(self, state: TalkerState) -> bool:
        if state.replay:  # the catch-up reads a row per replayed step
            return len(state.reply) >= state.replay or state.thinker_ended
        return bool(state.reply) or state.thinker_ended

    def _next_row(self, state: TalkerState) -> torch.Tensor:
        """This step's thinker_reply_part element: the next reply row; once the thinker ended and
        its rows are read, the text-eos embedding, then the text-pad one for ever."""
        if state.reply:
            return state.reply.pop(0)
        index = 2 if state.eos_given else 1
        state.eos_given = True
        return state.specials[index : index + 1]

    @torch.no_grad()
    def step(self, states: Sequence[StepState]) -> None:
        live = [s for s in self.live(states) if isinstance(s, TalkerState) and self._has_input(s)]
        for state in live:
            if state.replay:
                self._catch_up(state)
        live = [state for state in live if self._has_input(state)]
        if self.graphed is not None:
            self._graphed_step(live)
            return
        if not live:
            return
        cache = self.slots.batch([state.slot for state in live])
        codes = torch.stack([state.sequence[:, state.prompt_length + state.step_index - 1] for state in live])
        rows = torch.stack([self._next_row(state) for state in live])  # [B, 1, H]
        output = self.model(
            input_ids=codes,
            thinker_reply_part=rows,
            position_ids=self.positions(live, rows=3),
            **{cache_keyword(self.model): cache},
            use_cache=True,
            **cache.attention_kwargs,
        )
        self.pick(live, output.logits)
        cache.advance()

    def _graphed_step(self, live: list[TalkerState]) -> None:
        """Launch a recorded step for `live` (each row's thinker input set first), and read the
        codes of the step launched before."""
        assert self.graphed is not None
        launching = [state for state in live if state.launched < state.total_steps]
        if launching:
            rows = torch.cat([self._next_row(state) for state in launching])  # [n, H]
            self.graphed.set_row_inputs([state.slot.index for state in launching], rows)
        self.graphed_step(launching)

    def checkpoint(self, state: StepState) -> StageState:
        """The codes picked so far and the generator: with the thinker's stream, what another
        replica needs to continue the request (see the module's docstring)."""
        assert isinstance(state, TalkerState)
        tensors = {"codes": state.generated.clone(), GENERATOR: generator_state(state.sampling.generator)}
        meta = {"codes_sent": str(state.codes_sent), "chunks_sent": str(state.chunks_sent)}
        return StageState(tensors, meta)

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        """Move a state fresh from `prepare` (its first code picked) to the checkpoint's codes and
        generator; the KV of the codes after the first is recomputed at its next step."""
        assert isinstance(state, TalkerState)
        codes = checkpoint.tensors.get("codes")
        if codes is None or codes.dim() != 1 or codes.dtype != torch.int64:
            raise InvalidArgument("a talker checkpoint's codes must be a 1-D int64 tensor")
        picked = codes.numel()
        if not 1 <= picked <= state.total_steps:
            raise InvalidArgument(f"a talker checkpoint holds 1 to {state.total_steps} codes, not {picked}")
        if int(codes[0]) != state.last_token:
            raise InvalidArgument("the talker checkpoint is of another request (its first code differs)")
        sent = meta_int(checkpoint, "codes_sent", 0, picked)
        chunks = meta_int(checkpoint, "chunks_sent", 0, picked)
        restore_generator(state.sampling.generator, checkpoint)
        start = state.prompt_length
        state.sequence[0, start : start + picked] = codes.to(state.sequence.device)
        state.step_index, state.last_token = picked, int(codes[-1])
        state.codes_sent, state.chunks_sent = sent, chunks
        state.replay = picked - 1

    def _catch_up(self, state: TalkerState) -> None:
        """The KV of the restored codes' decode steps, in one forward over the inputs those steps
        read (each code fed back plus its step's thinker row), on top of the prefill's."""
        count = state.replay
        rows = torch.cat([self._next_row(state) for _ in range(count)]).unsqueeze(0)  # [1, n, H]
        start = state.prompt_length
        codes = state.sequence[:, start : start + count].to(self.device)
        embeds = self.model.get_input_embeddings()(codes) + rows
        cache = DynamicCache(config=self.model.config)
        keys, values = self.slots.read(state.slot)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            cache.update(k, v, layer)
        length = state.slot.length
        positions = torch.arange(length, length + count, device=self.device).view(1, 1, -1).expand(3, 1, -1)
        self.model(
            inputs_embeds=embeds, position_ids=positions, **{cache_keyword(self.model): cache}, use_cache=True
        )
        self.fill_slot(state, cache)
        state.replay = 0
        self.join(state, None)  # (graphed) the row goes on from the restored code and generator

    def take_partial(self, state: StepState) -> StageState | None:
        """Codes made since the last chunk, CODES_PER_CHUNK at a time (the rest at the end)."""
        assert isinstance(state, TalkerState)
        codes = state.generated
        if codes.numel() and int(codes[-1]) in self.eos:
            codes = codes[:-1]
        done = self.is_done(state)
        ready = codes.numel() - state.codes_sent
        if ready <= 0 or (ready < CODES_PER_CHUNK and not done):
            return None
        count = ready if done else ready - ready % CODES_PER_CHUNK
        chunk = codes[state.codes_sent : state.codes_sent + count].clone()
        state.codes_sent += count
        meta = {"chunk": str(state.chunks_sent)}
        state.chunks_sent += 1
        return StageState(tensors={"codes": chunk}, meta=meta)

    def finish(self, state: StepState) -> StageState:
        """{"codes_total": [1]}: how many codes were sent; meta "tokens"."""
        assert isinstance(state, TalkerState)
        try:
            return StageState(
                tensors={"codes_total": torch.tensor([state.codes_sent])},
                meta={"tokens": str(state.step_index)},
            )
        finally:
            self.release(state)


def _first_chunk(inputs: StageState, width: int) -> dict[str, torch.Tensor]:
    """The thinker's chunk 0, checked: INVALID_ARGUMENT for a missing or misshapen tensor."""
    tensors = inputs.tensors
    missing = [name for name in ("prompt", "specials", "reply") if name not in tensors]
    if missing:
        raise InvalidArgument(
            f"the talker needs the thinker's first chunk (prompt, specials, reply); {missing[0]} "
            "is missing (a reply of one token has nothing to speak)"
        )
    for name, rows in (("prompt", None), ("specials", 3), ("reply", None)):
        tensor = tensors[name]
        if tensor.dim() != 2 or tensor.shape[1] != width or (rows and tensor.shape[0] != rows):
            raise InvalidArgument(f"the thinker's {name} must be [n, {width}]")
    if tensors["reply"].shape[0] < 1:
        raise InvalidArgument("the thinker's first chunk has no reply row")
    return dict(tensors)
