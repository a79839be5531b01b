"""A conversation's next turn with and without its prefix KV reused (Qwen2.5-Omni's thinker):
the time to the first text token of turn 2 after a history of `--history` tokens, measured in
the thinker runner itself (`Thinker.prepare`: processor, prefill, first pick), on one device.

    python benchmarks/omni_prefix_reuse.py [--model DIR] [--history 2000] [--device cuda] [--rounds 5]

"reused": turn 1 ran first on this runner, so turn 2 finds its prompt's KV in the prefix cache
and prefills only the new turn; "recomputed": the same turn 2 with the cache emptied first (what
a replica without the prefix pays); "moved": turn 2 on a second Thinker, in a process of its own
on the same device (another replica), with turn 1's KV moved there as the replicas move it
(services/coordinator/prefix_move.py): exported from the first Thinker (`export_prefix`), handed
over by the transport (`export_state` for the receiver: CUDA IPC on one GPU, shm on the CPU),
imported and installed by the receiver (`prepare` with the moved tensors), which prefills the
rest; timed from the export to the receiver's first token. One JSON line per result, then the
ratios. Without --model, the tiny random fixture (its numbers say little about real size: its
prefill is overhead-bound).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import multiprocessing
import os
import pstats
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from omni_common.models.base import ChatTurn, GenerationRequest, StageState
from omni_common.models.qwen_omni.fixture import build_tiny_fixture
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.transport import Consumer, TensorTransport, gpu_uuid, ipc_namespace
from omnistage.v1 import tensor_pb2

SENTENCE = "Once upon a time, the cat sat on a mat and the dog sang a song. "


def history_turns(tokens: int, tokenizer: object) -> tuple[ChatTurn, ...]:
    """A system prompt and user/assistant turns of about `tokens` tokens in all."""
    turns = [ChatTurn("system", (("text", "You are a helpful assistant."),))]
    per = len(tokenizer(SENTENCE)["input_ids"])  # type: ignore[operator]
    sentences = max(1, tokens // per)
    for i in range(0, sentences, 8):
        text = SENTENCE * min(8, sentences - i)
        turns.append(ChatTurn("user" if len(turns) % 2 else "assistant", (("text", text),)))
    if turns[-1].role == "user":
        turns.append(ChatTurn("assistant", (("text", "I see."),)))
    return tuple(turns)


def request(turns: tuple[ChatTurn, ...]) -> GenerationRequest:
    options = (("audio", "0"), ("max_new_tokens", "1"))
    return GenerationRequest(prompt="", messages=turns, options=options)


def first_token_ms(thinker: Thinker, req: GenerationRequest, device: torch.device) -> float:
    start = time.perf_counter()
    state = thinker.prepare(req, StageState({}, {}))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = (time.perf_counter() - start) * 1e3
    thinker.finish(state)
    return elapsed


def warmed(thinker: Thinker) -> Thinker:
    """`thinker` after the idle work a stage does before its first request: on CUDA its decode
    buckets and its extends recorded (until then a prefill runs eagerly)."""
    while thinker.idle_work():
        pass
    return thinker


def receiver(model_dir: Path, device_name: str, dtype_name: str, pipe: Any) -> None:
    """The second replica's Thinker: for each (request, moved handles) it gets, clears its
    prefix cache, imports the handles, prepares the turn with them (install + the rest of the
    prefill + the first pick) and answers whether it hit; None ends it."""
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    thinker = warmed(Thinker.load(model_dir, device, dtype, max_slots=2))
    transport = TensorTransport()
    pipe.send((transport.host_id, ipc_namespace(), gpu_uuid(device)))
    while (job := pipe.recv()) is not None:
        req, wire = job
        thinker.prefixes.clear()
        hits = thinker.prefix_stats().hits
        tensors, meta = asyncio.run(transport.import_state(tensor_pb2.StageState.FromString(wire)))
        state = thinker.prepare(req, StageState(tensors, meta))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        thinker.finish(state)
        pipe.send(thinker.prefix_stats().hits == hits + 1)
    transport.close()


def moved_ms(
    thinker: Thinker, transport: TensorTransport, consumer: Consumer, pipe: Any, req: GenerationRequest
) -> tuple[float, int, str]:
    """Turn 2 on the receiver with the prefix moved: the time from the export to its first
    token, the bytes moved and the kind of handle that moved them."""
    start = time.perf_counter()
    moved = thinker.export_prefix(req, StageState({}, {}))
    wire = transport.export_state(moved.tensors, moved.meta, consumer=consumer)
    pipe.send((req, wire.SerializeToString()))
    hit = pipe.recv()
    elapsed = (time.perf_counter() - start) * 1e3
    transport.release(transport.lease_ids(wire))
    if not hit:
        raise SystemExit("the receiver did not reuse the moved prefix")
    kinds = {ref.WhichOneof("location") for ref in wire.tensors}
    return elapsed, sum(ref.nbytes for ref in wire.tensors), "+".join(sorted(kinds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then print where one reused turn's time goes (torch.profiler, its syncs, cProfile)",
    )
    args = parser.parse_args()
    model_dir = args.model or build_tiny_fixture(Path(tempfile.mkdtemp()) / "qwen-omni-tiny")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    thinker = warmed(Thinker.load(model_dir, device, dtype, max_slots=2))
    history = history_turns(args.history, thinker.tokenizer)
    turn1 = request((*history, ChatTurn("user", (("text", "Tell me a short story."),))))
    turn2 = request(
        (*turn1.messages, ChatTurn("assistant", (("text", "No."),)), ChatTurn("user", (("text", "Why?"),)))
    )
    first_token_ms(thinker, turn1, device)  # warm-up, and the prefix turn 2 reuses
    first_token_ms(thinker, turn2, device)  # warm-up
    pipe, child_pipe = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=receiver, args=(model_dir, args.device, args.dtype, child_pipe)
    )
    child.start()
    transport = TensorTransport()
    consumer = Consumer(*pipe.recv())
    results: dict[str, list[float]] = {"reused": [], "recomputed": [], "moved": []}
    moved_bytes, handles = 0, ""
    try:
        moved_ms(thinker, transport, consumer, pipe, turn2)  # the receiver's warm-up
        for _ in range(args.rounds):
            first_token_ms(thinker, turn1, device)
            results["reused"].append(first_token_ms(thinker, turn2, device))
            elapsed, moved_bytes, handles = moved_ms(thinker, transport, consumer, pipe, turn2)
            results["moved"].append(elapsed)
            thinker.prefixes.clear()
            results["recomputed"].append(first_token_ms(thinker, turn2, device))
    finally:
        pipe.send(None)
        child.join(60)
        transport.close()
    prompt = thinker.processor.tokenizer.apply_chat_template(  # type: ignore[union-attr]
        [{"role": t.role, "content": t.parts[0][1]} for t in turn2.messages],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, median in medians.items():
        line = {"case": name, "turn2_prompt_tokens": len(prompt), "first_token_ms_p50": round(median, 2)}
        if name == "moved":
            line |= {"moved_bytes": moved_bytes, "handles": handles}
        print(json.dumps({**line, "device": str(device), "dtype": args.dtype, "rounds": args.rounds}))
    ratios = {
        "ratio_recomputed_over_reused": round(medians["recomputed"] / medians["reused"], 2),
        "ratio_recomputed_over_moved": round(medians["recomputed"] / medians["moved"], 2),
    }
    print(json.dumps(ratios))
    if args.profile:
        profile_reused(thinker, turn1, turn2, device)


def profile_reused(
    thinker: Thinker, turn1: GenerationRequest, turn2: GenerationRequest, device: torch.device
) -> None:
    """The operations of one reused turn 2 by host time, then by device time (what a profile
    of `Thinker.prepare` shows: processor, prefix install, extend, first pick)."""
    first_token_ms(thinker, turn1, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with (
        torch.profiler.profile(activities=activities) as prof,
        torch.profiler.record_function("turn 2, prefix reused"),
    ):
        first_token_ms(thinker, turn2, device)
    table = prof.key_averages()
    print(table.table(sort_by="cpu_time_total", row_limit=25))
    if device.type == "cuda":
        print(table.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=100))
        print_synchronizations(thinker, turn1, turn2, device)
    first_token_ms(thinker, turn1, device)
    python = cProfile.Profile()
    python.runcall(first_token_ms, thinker, turn2, device)
    pstats.Stats(python).sort_stats("cumulative").print_stats(30)


def print_synchronizations(
    thinker: Thinker, turn1: GenerationRequest, turn2: GenerationRequest, device: torch.device
) -> None:
    """Where one reused turn 2 waits for the device (torch's sync debug mode: each copy or read
    that synchronizes), by the project's innermost frame that called it."""
    first_token_ms(thinker, turn1, device)
    torch.cuda.synchronize(device)
    where: collections.Counter[str] = collections.Counter()

    def note(message: Warning | str, *_: Any, **__: Any) -> None:
        if "synchroniz" in str(message):
            where[_project_frame()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state = thinker.prepare(turn2, StageState({}, {}))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    thinker.finish(state)
    print(json.dumps({"synchronizations": sum(where.values()), "by_frame": dict(where.most_common())}))


def _project_frame() -> str:
    """The innermost frame of the project (omni_common) on the stack."""
    frames = [f for f in traceback.extract_stack() if "omni_common" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"


if __name__ == "__main__":
    main()
