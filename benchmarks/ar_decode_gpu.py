"""The AR decode at real size on one GPU (`ar_generation.py --device cuda` runs this): Qwen2.5-Omni's
thinker (random bf16 weights at the real config), stepped the way the stage steps it, per token at
concurrency 1, 8 and 32, against
- the weight-read floor: the bytes a step must read (the decoder's weights without the embedding
  table, the output head, the rows' KV) over the bandwidth measured here (a device copy);
- transformers' `generate` with `generation_config.cache_implementation = "static"` (generate
  compiles its own decode step), one request at a time and all prompts as one static batch;
- the attention alone at the thinker's shapes: one SDPA call per row (the eager decode's),
  one padded SDPA with a mask, one FlexAttention call with a block mask (the graphed decode's).
Greedy, EOS off, the same prompt ids on every side. With `--parts agreement`: how often a row's
greedy tokens inside a batch equal its lone run's (different prompts a row); `--parts talker`:
Qwen2.5-Omni's talker per code against its own floor (`talker_codes`). One JSON line per result.

    python benchmarks/ar_generation.py --device cuda [--concurrency 1 8 32] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerForConditionalGeneration

from omni_common.models import graphed_decode
from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.graphed_decode import decoder_of
from omni_common.models.qwen_omni.fixture import build_tokenizer
from omni_common.models.qwen_omni.processor import load_processor
from omni_common.models.qwen_omni.talker import Talker
from omni_common.models.qwen_omni.thinker import GRAPHED_MAX_TOKENS, Thinker
from omni_common.stages import MAX_QUEUE

PROMPT = " ".join(["Tell me a short story about a red kite over the sea."] * 5)


def emit(**row: object) -> None:
    print(json.dumps({"bench": "ar_decode_gpu", **row}), flush=True)


def cuda_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Mean milliseconds of `fn` over `repeat` calls, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / repeat


def bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy, counting bytes read and written."""
    source = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    ms = cuda_ms(lambda: target.copy_(source), 20)
    return 2 * source.numel() * source.element_size() / (ms / 1e3)


def build_thinker(device: torch.device) -> Any:
    config: Any = Qwen2_5OmniConfig().thinker_config
    # Not thinker-config fields, but the real config.json has them and get_rope_index reads them.
    config.vision_start_token_id, config.vision_end_token_id = 151652, 151653
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5OmniThinkerForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.generation_config.eos_token_id = None  # EOS off: every side runs all its tokens
    return model.eval()


def step_bytes(model: Any, *heads: torch.nn.Module) -> int:
    """What one decode step reads at least: the decoder's weights but the embedding table, and
    the output head (or `heads`: the modules a step runs besides the decoder)."""
    decoder = decoder_of(model)
    embed = decoder.embed_tokens.weight  # type: ignore[union-attr]
    own = sum(p.numel() * p.element_size() for p in decoder.parameters() if p is not embed)
    around = heads or (model.get_output_embeddings(),)
    return own + sum(p.numel() * p.element_size() for head in around for p in head.parameters())


def request(i: int, new_tokens: int) -> GenerationRequest:
    options = (("max_new_tokens", str(new_tokens)), ("audio", "1"), ("thinker_do_sample", "0"))
    return GenerationRequest(prompt=PROMPT, seed=i, options=options)


def ours(
    thinker: Any,
    concurrency: int,
    new_tokens: int,
    make: Callable[[int, int], GenerationRequest] | None = None,
    inputs: Callable[[int], StageState] | None = None,
) -> dict[str, float]:
    """Milliseconds a decode step takes with `concurrency` rows (the steady state, after the
    bucket's graph is recorded), and a prefill's. `make(i, new_tokens)`: request i;
    `inputs(i)`: its stage inputs (none by default)."""
    make = make or request
    inputs = inputs or (lambda i: StageState({}))
    started = time.perf_counter()
    states = [thinker.prepare(make(i, new_tokens), inputs(i)) for i in range(concurrency)]
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - started) * 1e3 / concurrency
    captures = thinker.graphed.captures if thinker.graphed else 0
    for _ in range(4):  # records the bucket's graph (once per process)
        thinker.step(states)
    torch.cuda.synchronize()
    record_s = time.perf_counter() - started
    steps = new_tokens - 8
    started = time.perf_counter()
    for _ in range(steps):
        thinker.step(states)
        for state in states:
            if isinstance(thinker, Thinker | Talker):
                thinker.take_partial(state)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) * 1e3 / steps
    for state in states:
        thinker.release(state)
    thinker.pending = None
    new_captures = (thinker.graphed.captures if thinker.graphed else 0) - captures
    return {
        "step_ms": step_ms,
        "prefill_ms": prefill_ms,
        "first_steps_s": record_s,
        "graphs_recorded": new_captures,
    }


def greedy_tokens(thinker: Thinker, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts stepped together as one batch."""
    states = [thinker.prepare(varied(prompt, new_tokens), StageState({})) for prompt in prompts]
    for _ in range(new_tokens):
        thinker.step(states)
        for state in states:
            thinker.take_partial(state)
    tokens = [state.generated.tolist() for state in states]
    for state in states:
        thinker.release(state)
    thinker.pending = None
    return tokens


def varied(prompt: str, new_tokens: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, options=request(0, new_tokens).options)


def agreement(thinker: Thinker, rows: int, new_tokens: int) -> dict[str, float]:
    """How often a row's greedy tokens inside a batch of `rows` different prompts equal its
    tokens alone (a batch's kernels may round differently from a lone row's): the share of rows
    equal over every token, and the median index of a row's first different token (its length
    when none differs)."""
    prompts = [f"{PROMPT} ({i})" for i in range(rows)]
    alone = [greedy_tokens(thinker, [prompt], new_tokens)[0] for prompt in prompts]
    together = greedy_tokens(thinker, prompts, new_tokens)
    firsts = []
    for lone, batched in zip(alone, together, strict=True):
        length = min(len(lone), len(batched))
        firsts.append(next((i for i in range(length) if lone[i] != batched[i]), length))
    equal = sum(lone == batched for lone, batched in zip(alone, together, strict=True))
    return {"rows_equal_share": equal / rows, "first_difference_p50": statistics.median(firsts)}


class StepClock:
    """A generate streamer that stamps each step's tokens (generate syncs every step anyway)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.no_grad()
def generate_step_ms(model: Any, ids: torch.Tensor, new_tokens: int) -> float:
    """Median ms between `generate`'s decode steps (after its first few) for the batch `ids`."""
    clock = StepClock()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
    )
    gaps = [(b - a) * 1e3 for a, b in zip(clock.stamps[8:], clock.stamps[9:], strict=False)]
    return statistics.median(gaps)


def attention_ms(rows: int, device: torch.device) -> dict[str, float]:
    """One decode attention call at the thinker's shapes (28 query heads, 4 KV heads of 128)
    over `rows` rows of 64..320 cached tokens in a 4,096-token buffer, x 28 layers."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    heads, kv_heads, dim, capacity, layers = 28, 4, 128, 4096, 28
    lengths = torch.randint(64, 320, (rows,), generator=torch.Generator().manual_seed(rows)).to(device)
    query = torch.randn(rows, heads, 1, dim, device=device, dtype=torch.bfloat16)
    keys = torch.randn(rows, kv_heads, capacity, dim, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    host = lengths.tolist()

    def per_row() -> None:
        for i, n in enumerate(host):
            torch.nn.functional.scaled_dot_product_attention(
                query[i : i + 1], keys[i : i + 1, :, :n], values[i : i + 1, :, :n], enable_gqa=True
            )

    longest = max(host)
    mask = torch.arange(longest, device=device).view(1, 1, 1, -1) < lengths.view(-1, 1, 1, 1)

    def padded() -> None:
        torch.nn.functional.scaled_dot_product_attention(
            query, keys[:, :, :longest], values[:, :, :longest], attn_mask=mask, enable_gqa=True
        )

    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    blocks = ((lengths + 127) // 128).to(torch.int32).view(rows, 1, 1)
    indices = (
        torch.arange(capacity // 128, device=device, dtype=torch.int32).expand(rows, 1, 1, -1).contiguous()
    )
    block_mask = BlockMask.from_kv_blocks(
        blocks,
        indices,
        BLOCK_SIZE=128,
        mask_mod=lambda b, h, q, kv: kv < lengths[b],
        seq_lengths=(1, capacity),
    )

    def flexed() -> None:
        flex(query, keys, values, block_mask=block_mask, enable_gqa=True)

    # Timed as CUDA graphs of `layers` calls: GPU time, not the host's launches.
    return {
        name: round(graphed_ms(fn, layers), 3)
        for name, fn in (("per_row_sdpa", per_row), ("padded_sdpa", padded), ("flex_block_mask", flexed))
    }


def graphed_ms(fn: Callable[[], Any], calls: int) -> float:
    """Milliseconds of one replay of a CUDA graph of `calls` calls of `fn`."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_ms(graph.replay, 20)


@torch.no_grad()
def profile_step(
    runner: Any, rows: int, make: Callable[[int, int], GenerationRequest] = request, inputs: Any = None
) -> None:
    """The kernels of `rows` rows' compiled step run unrecorded (what a graph replays), by GPU
    time, with the requests' own sampling: where a step's time goes beyond the weight read."""
    from torch.profiler import ProfilerActivity, profile

    graphed = runner.graphed
    assert graphed is not None
    inputs = inputs or (lambda i: StageState({}))
    states = [runner.prepare(make(i, 64), inputs(i)) for i in range(rows)]
    sampling = states[0].sampling
    generators = [torch.Generator(graphed.device) for _ in range(rows)]

    def step() -> None:
        graphed._step(rows, sampling.processors, sampling.do_sample, generators)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70))
    for state in states:
        runner.release(state)
    runner.pending = None


def glm_prior(args: argparse.Namespace, device: torch.device, rate: float) -> None:
    """GLM-Image's AR at real size (a random-weights directory as `omnistage fixture --family
    glm-image --random-weights full` writes it, loaded as the stage loads it): 512x512 priors
    (sampled, top-k 50 as the model's generation config), EOS off."""
    from omni_common.models.glm_image.prior import GlmImagePrior
    from omni_common.models.glm_image.random_model import write_random_model

    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "glm-image", full_size=True)
    prior = GlmImagePrior.load(
        model_dir, device, torch.bfloat16, max_slots=args.slots, max_tokens=2048, decode="graphs"
    )
    prior.model.generation_config.eos_token_id = None
    floor_ms = step_bytes(prior.model) / rate * 1e3
    emit(part="glm floor", step_bytes=step_bytes(prior.model), floor_ms=round(floor_ms, 3))

    def make(i: int, new_tokens: int) -> GenerationRequest:
        return GenerationRequest(prompt=PROMPT[: 40 + i], width=512, height=512, seed=i)

    for concurrency in args.concurrency:
        found = ours(prior, concurrency, 200, make)
        emit(
            part="omnistage graphed glm-image AR",
            concurrency=concurrency,
            **{k: round(v, 3) for k, v in found.items()},
            ms_per_token=round(found["step_ms"] / concurrency, 3),
            over_floor=round(found["step_ms"] / floor_ms, 2),
        )
    for rows in args.concurrency if "profile" in args.parts else ():
        emit(part="glm-image AR step's kernels", rows=rows)
        profile_step(prior, rows, make)


def talker_codes(args: argparse.Namespace, device: torch.device, rate: float) -> None:
    """Qwen2.5-Omni's talker at real size (896 wide, 24 layers: the directory `omnistage fixture
    --family qwen2.5-omni --random-weights full` writes, loaded as the stage loads it), sampled
    with its defaults, every row's thinker rows fed up front (a step never waits for them), EOS
    off: ms a code at each concurrency against its floor; with "profile" its step's kernels."""
    from omni_common.models.qwen_omni.random_model import write_random_model

    model_dir = write_random_model(Path(tempfile.mkdtemp()) / "omni", full_size=True)
    talker = Talker.load(model_dir, device, torch.bfloat16, max_slots=args.slots, decode="graphs")
    talker.eos = frozenset()  # every row speaks all its codes
    model = talker.model
    # What a step reads: the decoder, the codec head, and the thinker-to-talker projection.
    floor_bytes = step_bytes(model, model.codec_head, model.thinker_to_talker_proj)
    floor_ms = floor_bytes / rate * 1e3
    emit(part="talker floor", step_bytes=floor_bytes, floor_ms=round(floor_ms, 3))
    width = model.config.embedding_size
    generator = torch.Generator().manual_seed(0)

    def make(i: int, new_tokens: int) -> GenerationRequest:
        return GenerationRequest(prompt="", seed=i, options=(("talker_max_new_tokens", str(new_tokens)),))

    def inputs(i: int) -> StageState:
        rows = {"prompt": 64, "specials": 3, "reply": args.new_tokens + 8}
        return StageState({name: torch.randn(n, width, generator=generator) for name, n in rows.items()})

    for concurrency in args.concurrency:
        found = ours(talker, concurrency, args.new_tokens, make, inputs)
        emit(
            part="omnistage graphed talker",
            concurrency=concurrency,
            **{k: round(v, 3) for k, v in found.items()},
            ms_per_code=round(found["step_ms"] / concurrency, 3),
            over_floor=round(found["step_ms"] / floor_ms, 2),
        )
    if "profile" in args.parts:
        profile_step(talker, args.concurrency[0], make, inputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--generate", type=int, nargs="*", default=[1, 8], help="static batches to time")
    parser.add_argument(
        "--attention", nargs="*", default=["flex"], help="graphed decode's attention: flex padded"
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], help="parts to skip: attention thinker eager generate"
    )
    parser.add_argument("--parts", nargs="*", default=[], help="extra parts: profile glm talker agreement")
    # The KV slots and the thinker's tokens a slot: the stage's defaults (its --max-queue and
    # GRAPHED_MAX_TOKENS). A step of fewer rows than slots wrote its KV through a copy of those
    # rows' buffers until 527f30e: runs before it used --slots 32 (the most concurrency) and
    # --thinker-tokens 1024.
    parser.add_argument("--slots", type=int, default=MAX_QUEUE, help="KV slots of each AR model")
    parser.add_argument(
        "--thinker-tokens", type=int, default=GRAPHED_MAX_TOKENS, help="the thinker's tokens a slot"
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode of our decode step (e.g. max-autotune-no-cudagraphs; default: none)",
    )
    args = parser.parse_args(argv)
    graphed_decode.COMPILE_MODE = args.compile_mode
    device = torch.device(args.device)
    emit(machine=torch.cuda.get_device_name(device), torch=torch.__version__, compile_mode=args.compile_mode)
    if "attention" not in args.skip:
        for rows in args.concurrency:
            emit(part="attention", rows=rows, ms_per_step_28_layers=attention_ms(rows, device))
    if "glm" in args.parts:
        glm_prior(args, device, bandwidth())
    if "talker" in args.parts:
        talker_codes(args, device, bandwidth())
    if "thinker" in args.skip:
        return
    model = build_thinker(device)
    floor_bytes, rate = step_bytes(model), bandwidth()
    emit(
        part="floor",
        step_bytes=floor_bytes,
        bandwidth_gb_s=round(rate / 1e9, 1),
        floor_ms=round(floor_bytes / rate * 1e3, 3),
    )
    # The thinker reads prompts through the processor: the fixture's tokenizer, saved, with the
    # published feature-extractor and image settings.
    processor_dir = Path(tempfile.mkdtemp())
    build_tokenizer().save_pretrained(processor_dir)
    processor = load_processor(processor_dir)
    ids = torch.tensor([[i % 300 + 20 for i in range(64)]], device=device)

    def thinker_of(max_slots: int, decode: str, max_tokens: int) -> Thinker:
        return Thinker(
            model,
            processor,
            {"Chelsie": {"bos_token": 10}},
            (11, 12),
            device,
            torch.bfloat16,
            max_slots=max_slots,
            max_tokens=max_tokens,
            decode=decode,
        )

    for attention in args.attention:
        thinker = thinker_of(args.slots, "graphs", args.thinker_tokens)
        assert thinker.graphed is not None
        thinker.graphed.attention = attention  # before any step is recorded
        for concurrency in args.concurrency:
            found = ours(thinker, concurrency, args.new_tokens)
            emit(
                part="omnistage graphed",
                attention=attention,
                concurrency=concurrency,
                **{k: round(v, 3) for k, v in found.items()},
                ms_per_token=round(found["step_ms"] / concurrency, 3),
                over_floor=round(found["step_ms"] / (floor_bytes / rate * 1e3), 2),
            )
        if "profile" in args.parts:
            profile_step(thinker, args.concurrency[0])
        for rows in (c for c in args.concurrency if "agreement" in args.parts and c > 1):
            found = agreement(thinker, rows, args.new_tokens)
            emit(part="greedy rows in a batch against alone", attention=attention, rows=rows, **found)
        del thinker
    if "eager" not in args.skip:
        model.set_attn_implementation("sdpa")  # the graphed runner switched it
        thinker = thinker_of(8, "eager", 1024)
        found = ours(thinker, 1, 40)
        emit(part="omnistage eager", concurrency=1, **{k: round(v, 3) for k, v in found.items()})
        del thinker
    if "generate" not in args.skip:
        model.set_attn_implementation("sdpa")
        model.generation_config.cache_implementation = "static"
        for batch in args.generate:
            rows = ids.expand(batch, -1).contiguous()
            generate_step_ms(model, rows, 16)  # compiles
            ms = generate_step_ms(model, rows, args.new_tokens)
            emit(
                part="transformers generate static cache compiled",
                batch=batch,
                step_ms=round(ms, 3),
                ms_per_token=round(ms / batch, 3),
            )


if __name__ == "__main__":
    main()
