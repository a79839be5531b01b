"""What the HTTP gateway costs: latency it adds over calling the coordinator directly, and the
requests per second it sustains at a concurrency of 32, next to the coordinator's own, on one
cluster of real processes on loopback (the digits model, 32x32), in one run.

    python benchmarks/gateway.py [--steps 20] [--runs 30] [--concurrency 32] [--requests 256]
    python benchmarks/gateway.py --speech [--model DIR | --coordinator HOST:PORT] [--runs 30]

Latency: one request at a time, the two sides alternating request by request; each returns
the PNG file bytes to the caller (gRPC: the Result's bytes; HTTP: POST
/v1/images/generations, JSON parsed, base64 decoded). Throughput: `--requests` requests
through `--concurrency` workers (HTTP/1.1 keep-alive connections; one gRPC channel), each
side alone, the sides alternating for `--rounds` rounds (median). Prints one JSON line per
side and test, then one with the ratios.

Speech (`--speech`): a model that speaks (a Qwen2.5-Omni directory, or a running coordinator
that serves one), one reply at a time, the sides alternating, and which goes first too: the
SDK's Generate stream against POST /v1/audio/speech (`response_format` pcm, streamed), each
timed to its first audio bytes and to its end. Prints each side's percentiles, then the
gateway's added first audio (p50, paired by request), the part of the gateway's first audio
outside its own clock (HTTP and the gateway's work, free of the replies' spread) and the
whole-reply ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from omni_common.chat import chat_request
from omni_common.client import AsyncClient, Client, generate_request
from omni_common.cluster import LocalCluster, free_port, loopback_plan
from omni_common.compose import LOOPBACK, LocalProcess
from services.gateway.protocol import LAST_STEP_ONLY

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "qwen-image-digits"
PROMPT = "a handwritten digit seven"
OMNI_MODEL = REPO / "models" / "qwen-omni-tiny"  # `omnistage fixture --family qwen2.5-omni`
SPEECH_PROMPT = "Tell me a short story."


def gateway_process(coordinator: str) -> LocalProcess:
    port = free_port()
    argv = [sys.executable, "-m", "omnistage_cli", "serve", "gateway"]
    env = {"OMNISTAGE_PORT": str(port), "OMNISTAGE_COORDINATOR": coordinator}
    return LocalProcess("gateway", argv, env, f"http://{LOOPBACK}:{port}/health")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(seed: int, steps: int) -> dict[str, object]:
    return {
        "prompt": PROMPT,
        "size": "32x32",
        "num_inference_steps": steps,
        "guidance_scale": 1.0,
        "seed": seed,
    }


def request(seed: int, steps: int):  # type: ignore[no-untyped-def]
    # As the gateway asks for a request that is not streamed: no event per step.
    return generate_request(
        PROMPT,
        width=32,
        height=32,
        steps=steps,
        guidance=1.0,
        seed=seed,
        image_format="png",
        progress_every=LAST_STEP_ONLY,
    )


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50_ms": round(statistics.median(ordered), 3), "p95_ms": round(p95, 3)}


def latency(url: str, coordinator: str, steps: int, runs: int, warmup: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"coordinator": [], "gateway": []}
    with Client(coordinator) as client, httpx.Client(timeout=120) as http:

        def direct(seed: int) -> bytes:
            result = b""
            for event in client.stream(request(seed, steps)):
                if event.HasField("result"):
                    result = event.result.image
            return result

        def through_gateway(seed: int) -> bytes:
            response = http.post(f"{url}/v1/images/generations", json=body(seed, steps))
            response.raise_for_status()
            return base64.b64decode(response.json()["data"][0]["b64_json"])

        for i in range(warmup + runs):
            for side, call in (("coordinator", direct), ("gateway", through_gateway)):
                started = time.perf_counter()
                image = call(i)
                elapsed = (time.perf_counter() - started) * 1e3
                assert image.startswith(b"\x89PNG")
                if i >= warmup:
                    times[side].append(elapsed)
    return times


async def throughput_direct(coordinator: str, steps: int, concurrency: int, total: int) -> float:
    async with AsyncClient(coordinator) as client:
        todo = iter(range(total))

        async def worker() -> None:
            for seed in todo:
                async for _ in client.stream(request(seed, steps), 120):
                    pass

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - started)


async def throughput_gateway(url: str, steps: int, concurrency: int, total: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        todo = iter(range(total))

        async def worker() -> None:
            for seed in todo:
                response = await http.post(f"{url}/v1/images/generations", json=body(seed, steps))
                response.raise_for_status()
                base64.b64decode(response.json()["data"][0]["b64_json"])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - started)


def speech_times(url: str, coordinator: str, runs: int, warmup: int, options: dict[str, int]):  # type: ignore[no-untyped-def]
    """Per side, each reply's (ms to its first audio, ms to its end); and per gateway reply, the
    ms of its first audio outside the gateway's own clock (its x-first-audio-ms header: from
    the request's arrival to the coordinator's first audio), what HTTP and the gateway add
    whatever the reply's own spread."""
    times: dict[str, list[tuple[float, float]]] = {"coordinator": [], "gateway": []}
    outside: list[float] = []
    with Client(coordinator) as client, httpx.Client(timeout=300) as http:

        def direct(seed: int) -> tuple[float, float]:
            started, first = time.perf_counter(), 0.0
            request = chat_request(SPEECH_PROMPT, seed=seed, audio_format="pcm16", options=options)
            for event in client.stream(request):
                if event.HasField("audio") and not first:
                    first = time.perf_counter()
            return (first - started) * 1e3, (time.perf_counter() - started) * 1e3

        def through_gateway(seed: int) -> tuple[float, float]:
            started, first = time.perf_counter(), 0.0
            body = {"input": SPEECH_PROMPT, "response_format": "pcm", "seed": seed, "options": options}
            with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
                response.raise_for_status()
                for chunk in response.iter_raw():
                    if chunk and not first:
                        first = time.perf_counter()
            inside = response.headers.get("x-first-audio-ms")  # absent: no audio before the result
            if seed >= warmup and inside is not None:
                outside.append((first - started) * 1e3 - float(inside))
            return (first - started) * 1e3, (time.perf_counter() - started) * 1e3

        sides = (("coordinator", direct), ("gateway", through_gateway))
        for i in range(warmup + runs):
            # Which side goes first alternates: a reply runs faster or slower after another
            # (its cluster's idle work), and a fixed order would charge that to one side.
            for side, call in sides if i % 2 else sides[::-1]:
                pair = call(i)
                if i >= warmup:
                    times[side].append(pair)
    return times, outside


def speech_main(args: argparse.Namespace) -> None:
    options = {"max_new_tokens": args.max_new_tokens, "talker_max_new_tokens": args.talker_max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        plan = [] if args.coordinator else loopback_plan(Path(args.model))
        coordinator = args.coordinator or plan[0].health_address
        plan.append(gateway_process(coordinator))
        with LocalCluster(plan, log_dir=Path(tmp) / "logs") as cluster:
            times, outside = speech_times(cluster.gateway, coordinator, args.runs, args.warmup, options)
    common = {"bench": "gateway-speech", "runs": args.runs, "cpus": os.cpu_count(), **options}
    for side, pairs in times.items():
        first = percentiles([f for f, _ in pairs])
        whole = percentiles([t for _, t in pairs])
        print(json.dumps({**common, "side": side, "first_audio": first, "whole_reply": whole}))
    gateway, direct = times["gateway"], times["coordinator"]
    whole_ratio = statistics.median(g for _, g in gateway) / statistics.median(d for _, d in direct)
    summary = {
        **common,
        "added_first_audio_p50_ms_paired": round(
            statistics.median(g[0] - d[0] for g, d in zip(gateway, direct, strict=True)), 3
        ),
        "gateway_outside_first_audio_p50_ms": round(statistics.median(outside), 3),
        "whole_reply_ratio_p50": round(whole_ratio, 4),
    }
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--speech", action="store_true", help="time speech (first audio, whole reply)")
    parser.add_argument(
        "--model", default=str(OMNI_MODEL), help="with --speech: the speaking model's directory"
    )
    parser.add_argument(
        "--coordinator", default="", help="with --speech: a running coordinator to use instead"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--talker-max-new-tokens", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per side (median)")
    args = parser.parse_args()
    if args.speech:
        speech_main(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        plan = loopback_plan(MODEL)
        plan.append(gateway_process(plan[0].health_address))
        with LocalCluster(plan, log_dir=Path(tmp) / "logs") as cluster:
            url = cluster.gateway
            common = {"bench": "gateway", "size": "32x32", "steps": args.steps, "cpus": os.cpu_count()}
            times = latency(url, cluster.coordinator, args.steps, args.runs, args.warmup)
            stats = {side: percentiles(samples) for side, samples in times.items()}
            for side, row in stats.items():
                print(json.dumps({**common, "test": "latency", "side": side, "runs": args.runs, **row}))
            added = [g - c for g, c in zip(times["gateway"], times["coordinator"], strict=True)]
            sides = {
                "coordinator": lambda total: throughput_direct(
                    cluster.coordinator, args.steps, args.concurrency, total
                ),
                "gateway": lambda total: throughput_gateway(url, args.steps, args.concurrency, total),
            }
            for run in sides.values():
                asyncio.run(run(args.concurrency))  # warm-up: one round of the batch shapes
            samples: dict[str, list[float]] = {side: [] for side in sides}
            gateway_pid = cluster.processes["gateway"].pid
            gateway_cpu_s = 0.0
            for _ in range(args.rounds):  # the sides alternate, so drift hits both alike
                for side, run in sides.items():
                    cpu_before = cpu_seconds(gateway_pid)
                    samples[side].append(asyncio.run(run(args.requests)))
                    if side == "gateway":
                        gateway_cpu_s += cpu_seconds(gateway_pid) - cpu_before
            rates = {side: statistics.median(values) for side, values in samples.items()}
            for side, values in samples.items():
                print(
                    json.dumps(
                        {
                            **common,
                            "test": "throughput",
                            "side": side,
                            "concurrency": args.concurrency,
                            "requests": args.requests,
                            "requests_per_s": round(rates[side], 2),
                            "rounds": [round(v, 2) for v in values],
                        }
                    )
                )
            print(
                json.dumps(
                    {
                        **common,
                        "added_p50_ms": round(stats["gateway"]["p50_ms"] - stats["coordinator"]["p50_ms"], 3),
                        "added_p50_ms_paired": round(statistics.median(added), 3),
                        "latency_ratio_p50": round(
                            stats["gateway"]["p50_ms"] / stats["coordinator"]["p50_ms"], 4
                        ),
                        "throughput_ratio": round(rates["gateway"] / rates["coordinator"], 4),
                        # The gateway process's own CPU time per request (user + system).
                        "gateway_cpu_ms_per_request": round(
                            gateway_cpu_s * 1e3 / (args.rounds * args.requests), 3
                        ),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
