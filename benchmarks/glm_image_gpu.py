"""GLM-Image end to end at real size (random bf16 weights): the split cluster of real processes
against diffusers' GlmImagePipeline in one process at its best setting, text to image and edit,
same weights, prompts, seeds, steps and guidance (issue 34).

    omnistage fixture --family glm-image /tmp/glm-image-full --random-weights full
    python benchmarks/glm_image_gpu.py --model /tmp/glm-image-full [--sizes 1024 512]
        [--tasks t2i edit] [--runs 3] [--concurrent 8] [--split] [--only cluster|diffusers]
    python benchmarks/glm_image_gpu.py --summarize run1.jsonl run2.jsonl ...

The cluster and diffusers never hold the GPU at once: one after the other in this run.
1. The cluster (coordinator and three stage processes on loopback, `--device`): per size and
   task a warm-up request, then `--runs` timed requests alone (each its own prompt and, for
   edit, its own condition image, so no cache answers for it): p50 latency and the AR / DiT /
   VAE shares of the stages' compute (the result's compute_ms: prior and glyph on the
   ar-encoder, condition KV and denoise on the DiT, VAE encode and decode); then, at each of
   `--concurrent-sizes`, `--concurrent` text-to-image requests at once: images/s.
2. With `--split` (2 GPUs): the same with the AR on cuda:0 and the DiT and the VAE on cuda:1.
3. diffusers (glm_image_diffusers.py), the AR's `generate` with a static cache (transformers
   compiles its decode step; `--ar-cache dynamic` for its default cache; a static cache that
   fails is reported and the default used), the transformer compiled each way of
   `--diffusers-modes` (diffusers_best.py), a failing mode reported and skipped. The AR is the
   same in every mode, so it samples each request's prior once, with the first mode loaded;
   each mode then runs the DiT and the VAE from those priors. A request's time = its AR time +
   its DiT and VAE time; the fastest mode per size and task is the competitor, one request at a
   time (images/s = 1000 / its p50).

Default steps: the model directory's own (omnistage.json), else the pipeline's 50; guidance
1.5 (GLM-Image's default: two DiT forwards a step). The AR's EOS is turned off on both sides
(a copy of the configs whose EOS id no head can sample): random weights would otherwise end a
prior early at random, and every side runs all its tokens.

One JSON line per measurement, then a summary with issue 34's targets (1024 text to image:
alone <= 0.9x diffusers' best and under 20 s; 8 at once >= 2x diffusers' images/s). Runs that
do not fit one call (`--only`, `--sizes`, `--tasks`, `--diffusers-modes`) print lines that
`--summarize` reads back together.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bursts
import diffusers_best
import torch
from glm_image_common import TASKS, Record, failure, p50, picture, prompt, warm_up_number
from glm_image_diffusers import run_diffusers

from omni_common.client import Client, GenerationResult
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.base import GenerationRequest
from omni_common.models.glm_image.family import DEFAULT_GUIDANCE
from omni_common.models.model_defaults import DEFAULTS_FILE

# Where each step of GLM-Image's plan (family.py) counts: the stage service that runs it.
SHARE_OF = {
    "prior": "ar",
    "glyph": "ar",
    "condition-kv": "dit",
    "denoise": "dit",
    "vae-encode": "vae",
    "decode": "vae",
}


def eos_off_copy(model: Path, into: Path) -> Path:
    """`model` as links to its files, but for an AR config whose EOS is the last text token,
    which the AR's head (the vision vocabulary, smaller) never samples: every prior runs all
    its tokens on both sides."""
    copy = into / "model"
    shutil.copytree(model.resolve(), copy, copy_function=os.symlink)
    config_path = copy / "vision_language_encoder" / "config.json"
    config = json.loads(config_path.read_text())
    text = config["text_config"]
    if text["vision_vocab_size"] >= text["vocab_size"]:
        raise SystemExit("the AR's head covers its whole vocabulary: no EOS id it never samples")
    text["eos_token_id"] = text["vocab_size"] - 1
    config_path.unlink()
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return copy


def default_steps(model: Path) -> int:
    """The model directory's own default steps (omnistage.json), else the pipeline's."""
    path = model / DEFAULTS_FILE
    fields = json.loads(path.read_text()).get("defaults", {}) if path.is_file() else {}
    return int(fields.get("num_inference_steps", GenerationRequest.num_inference_steps))


def shares(compute_ms: dict[str, float]) -> dict[str, float]:
    """The AR / DiT / VAE milliseconds of one request (a step of another name: "other")."""
    out = {"ar": 0.0, "dit": 0.0, "vae": 0.0}
    for step, ms in compute_ms.items():
        share = SHARE_OF.get(step, "other")
        out[share] = out.get(share, 0.0) + ms
    return {k: round(v, 1) for k, v in out.items()}


# ---- the cluster ---------------------------------------------------------------------------


def cluster_plan(args: argparse.Namespace, model: Path, cache: Path, split: bool) -> list[Any]:
    env = {
        "OMNISTAGE_DEVICE": args.device,
        "OMNISTAGE_MAX_BATCH": str(max(args.concurrent, 1)),
        "OMNISTAGE_COMPILE_CACHE": str(cache),
    }
    plan = loopback_plan(model, dtype=args.dtype, extra_env=env)
    if split:  # the AR stays on the first GPU; the DiT and the VAE (its latents' reader) the second
        second = "cuda:1" if args.device.startswith("cuda") else args.device
        for proc in plan:
            if proc.name in ("dit-denoise", "vae-decode"):
                proc.environment["OMNISTAGE_DEVICE"] = second
    return plan


def request_options(args: argparse.Namespace, task: str, size: int, number: int) -> dict[str, Any]:
    """generate_result's keywords for request `number` (its seed is its number)."""
    options: dict[str, Any] = {
        "width": size,
        "height": size,
        "steps": args.steps,
        "guidance": args.guidance,
        "seed": number,
        "timeout": args.request_timeout,
    }
    if task == "edit":
        options["images"] = [picture(number, size)]
    return options


def run_cluster(args: argparse.Namespace, model: Path, logs: Path, split: bool, emit: Record) -> None:
    side = "cluster split" if split else "cluster"
    started = time.perf_counter()
    plan = cluster_plan(args, model, logs / "compile-cache", split)
    plan, metrics = bursts.with_metrics(plan, "ar-encoder")
    with (
        LocalCluster(plan, logs / side.replace(" ", "-"), 1800) as cluster,
        Client(cluster.coordinator) as client,
    ):
        emit({"side": side, "start_s": round(time.perf_counter() - started, 1)})
        # The AR's decode steps recorded at every batch bucket before any request is timed.
        emit({"side": side, "idle_work_wait_s": bursts.wait_idle_work(metrics)})
        for size in args.sizes:
            cases = [*args.tasks, *(["burst"] if size in args.concurrent_sizes and args.concurrent else [])]
            for case in cases:
                try:
                    if case == "burst":
                        time_burst(args, cluster.coordinator, side, size, emit)
                    else:
                        time_alone(args, client, side, case, size, emit)
                except Exception as err:  # reported; the other cases still run
                    emit({"side": side, "task": case, "size": size, "failed": failure(err)})


def time_alone(
    args: argparse.Namespace, client: Client, side: str, task: str, size: int, emit: Record
) -> None:
    """A warm-up request, then `--runs` timed ones, one at a time."""
    warm = time.perf_counter()
    number = warm_up_number(size)
    client.generate_result(prompt(number), **request_options(args, task, size, number))
    emit({"side": side, "task": task, "size": size, "warm_up_ms": round((time.perf_counter() - warm) * 1e3)})
    walls, results = [], []
    for run in range(args.runs):
        number = 1000 * size + run
        t0 = time.perf_counter()
        results.append(client.generate_result(prompt(number), **request_options(args, task, size, number)))
        walls.append((time.perf_counter() - t0) * 1e3)
        emit(
            {
                "side": side,
                "task": task,
                "size": size,
                "run": run,
                "wall_ms": round(walls[-1], 1),
                "compute_ms": {k: round(v, 1) for k, v in results[-1].compute_ms.items()},
            }
        )
    emit(
        {"side": side, "task": task, "size": size, "p50_ms": p50(walls), "shares_ms": median_shares(results)}
    )


def median_shares(results: list[GenerationResult]) -> dict[str, float]:
    """Per share, the median over requests of its milliseconds, and its fraction of their sum."""
    each = [shares(result.compute_ms) for result in results]
    medians = {k: p50([row.get(k, 0.0) for row in each]) for k in {k for row in each for k in row}}
    total = sum(medians.values()) or 1.0
    return {**medians, **{f"{k}_fraction": round(v / total, 3) for k, v in medians.items()}}


def time_burst(args: argparse.Namespace, coordinator: str, side: str, size: int, emit: Record) -> None:
    """`--concurrent` text-to-image requests at once: a first burst compiles what batches bring
    (AR buckets, DiT batch shapes), the second is timed."""
    for first, timed in ((20_000, False), (10_000, True)):
        requests = [
            (prompt(first + i), request_options(args, "t2i", size, first + i)) for i in range(args.concurrent)
        ]
        done = bursts.burst(coordinator, requests)
        if timed:
            emit(
                {
                    "side": side,
                    "task": "t2i",
                    "size": size,
                    "concurrent": args.concurrent,
                    "img_per_s": done.img_per_s,
                    "wall_ms": round(done.wall_s * 1e3, 1),
                    "first_done_ms": round(min(done.done_ms), 1),
                    "shares_ms": median_shares(done.results),
                }
            )


# ---- the summary ---------------------------------------------------------------------------


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios per size and task against diffusers' fastest mode, and issue 34's targets."""
    ours = {(r["task"], r["size"]): r for r in rows if r.get("side") == "cluster" and "p50_ms" in r}
    split = {(r["task"], r["size"]): r for r in rows if r.get("side") == "cluster split" and "p50_ms" in r}
    at_once = {r["size"]: r for r in rows if r.get("side") == "cluster" and "concurrent" in r}
    theirs: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        if r.get("side") == "diffusers" and "p50_ms" in r:
            theirs.setdefault((r["task"], r["size"]), {})[r["mode"]] = r["p50_ms"]
    out: dict[str, Any] = {"summary": "glm-image cluster / diffusers' best"}
    out["device"] = sorted({r["device"] for r in rows if "device" in r})
    for task, size in sorted(set(ours) | set(theirs) | set(split)):
        entry: dict[str, Any] = {}
        if (task, size) in ours:
            entry["cluster_p50_ms"] = ours[task, size]["p50_ms"]
            entry["shares_ms"] = ours[task, size]["shares_ms"]
        if (task, size) in theirs:
            mode, ms = diffusers_best.best(theirs[task, size])
            entry["diffusers_best"] = {"mode": mode, "p50_ms": ms, "by_mode": theirs[task, size]}
            if "cluster_p50_ms" in entry:
                entry["latency_ratio"] = round(entry["cluster_p50_ms"] / ms, 3)
        if (task, size) in split:
            entry["split_p50_ms"] = split[task, size]["p50_ms"]
            if "cluster_p50_ms" in entry:
                entry["split_over_one_gpu"] = round(entry["split_p50_ms"] / entry["cluster_p50_ms"], 3)
        out[f"{task}_{size}"] = entry
    for size, row in sorted(at_once.items()):
        entry = {"cluster_img_per_s": row["img_per_s"], "concurrent": row["concurrent"]}
        if ("t2i", size) in theirs:
            _, ms = diffusers_best.best(theirs["t2i", size])
            entry["diffusers_one_at_a_time_img_per_s"] = round(1000 / ms, 4)
            entry["throughput_ratio"] = round(row["img_per_s"] * ms / 1000, 3)
        out[f"t2i_{size}_at_once"] = entry
    out["targets"] = targets(out)
    return out


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 34's targets at 1024x1024 text to image, each with this run's value and verdict."""
    alone, at_once = out.get("t2i_1024", {}), out.get("t2i_1024_at_once", {})
    checks = (
        ("latency_ratio <= 0.9", alone.get("latency_ratio"), operator.le, 0.9),
        ("cluster_p50_ms < 20000", alone.get("cluster_p50_ms"), operator.lt, 20_000),
        ("throughput_ratio >= 2", at_once.get("throughput_ratio"), operator.ge, 2.0),
    )
    return {
        name: "not measured" if value is None else {"value": value, "met": bool(test(value, bound))}
        for name, value, test, bound in checks
    }


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """The measurement lines of earlier runs (their summaries and other lines are skipped)."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and "summary" not in row:
                    rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, help="a GLM-Image directory (omnistage fixture --family glm-image)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--steps", type=int, help="default: the model's own (omnistage.json), else 50")
    parser.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=8, help="text-to-image requests at once; 0: none")
    parser.add_argument(
        "--concurrent-sizes", type=int, nargs="*", help="sizes of the bursts (default: the first)"
    )
    parser.add_argument("--device", default="cuda:0", help="cpu only to try the script on a tiny model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--ar-cache", choices=("static", "dynamic"), default="static", help="diffusers' AR cache"
    )
    diffusers_best.add_args(parser)
    parser.add_argument(
        "--split", action="store_true", help="also the AR on cuda:0, the DiT and VAE on cuda:1"
    )
    parser.add_argument("--only", choices=("cluster", "split", "diffusers"), help="time that part alone")
    parser.add_argument("--logs", type=Path, help="keep the services' logs here")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=900.0,
        help="seconds a cluster request may take (a hang fails)",
    )
    parser.add_argument("--summarize", type=Path, nargs="+", help="print the summary of earlier runs' lines")
    args = parser.parse_args()
    emit = Record()
    if args.summarize:
        emit(summary(read_rows(args.summarize)))
        return
    if args.model is None:
        raise SystemExit("--model: a GLM-Image directory (omnistage fixture --family glm-image DIR ...)")
    parts = [args.only] if args.only else ["cluster", *(["split"] if args.split else []), "diffusers"]
    if args.device.startswith("cuda") and torch.cuda.device_count() < (2 if "split" in parts else 1):
        raise SystemExit(f"{'--split needs 2' if 'split' in parts else 'this needs a'} CUDA device(s)")
    args.steps = args.steps or default_steps(args.model)
    args.concurrent_sizes = args.sizes[:1] if args.concurrent_sizes is None else args.concurrent_sizes
    emit({"device": device_name(args.device), "steps": args.steps, "guidance": args.guidance, "parts": parts})
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model = eos_off_copy(args.model, Path(tmp))
        logs = args.logs or Path(tmp)
        for part in parts:
            try:
                if part == "diffusers":
                    run_diffusers(args, model, emit)
                else:
                    run_cluster(args, model, logs, part == "split", emit)
            except Exception as err:  # reported; the other parts still run
                failed = True
                emit({"side": part, "failed": failure(err)})
    emit(summary(emit.rows))
    sys.exit(1 if failed else 0)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


if __name__ == "__main__":
    main()
