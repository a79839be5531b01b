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
that serves one), one reply at a time, the sides taking turns, and which goes first rotating:
the SDK's Generate stream against POST /v1/audio/speech (`response_format` pcm, streamed) read
by two HTTP clients (httpx, the openai client's library, and the standard library's
http.client), each timed to its first audio bytes and to its end. Prints each side's
percentiles, then per HTTP client the gateway's added first audio (p50, paired by request),
the part of the gateway's first audio outside its own clock (HTTP and the gateway's work, free
of the replies' spread) and the whole-reply ratio (paired by request, and of the p50s).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
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


HTTP_CLIENTS = ("httpx", "http.client")  # the openai client's HTTP library; the standard library's


def speech_times(url: str, coordinator: str, runs: int, warmup: int, options: dict[str, int]):  # type: ignore[no-untyped-def]
    """Per side, each reply's (ms to its first audio, ms to its end); and per HTTP client, the
    ms of each gateway reply's first audio outside the gateway's own clock (its
    x-first-audio-ms header: from the request's arrival to the coordinator's first audio),
    what HTTP and the gateway add whatever the reply's own spread. The gateway is read by two
    HTTP clients: httpx (what the openai client uses, ~1 ms of its own a request) and the
    standard library's http.client (little beyond the socket), so the gateway's own cost shows
    apart from the client's."""
    times: dict[str, list[tuple[float, float]]] = {"coordinator": [], **{name: [] for name in HTTP_CLIENTS}}
    outside: dict[str, list[float]] = {name: [] for name in HTTP_CLIENTS}
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lean = http.client.HTTPConnection(host, int(port), timeout=300)
    with Client(coordinator) as client, httpx.Client(timeout=300) as http_client:

        def direct(seed: int) -> tuple[float, float]:
            started, first = time.perf_counter(), 0.0
            request = chat_request(SPEECH_PROMPT, seed=seed, audio_format="pcm16", options=options)
            for event in client.stream(request):
                if event.HasField("audio") and not first:
                    first = time.perf_counter()
            return (first - started) * 1e3, (time.perf_counter() - started) * 1e3

        def body(seed: int) -> bytes:
            fields = {"input": SPEECH_PROMPT, "response_format": "pcm", "seed": seed, "options": options}
            return json.dumps(fields).encode()

        def timed(
            name: str, seed: int, started: float, first: float, inside: str | None
        ) -> tuple[float, float]:
            if seed >= warmup and inside is not None:  # absent: no audio before the result
                outside[name].append((first - started) * 1e3 - float(inside))
            return (first - started) * 1e3, (time.perf_counter() - started) * 1e3

        def through_httpx(seed: int) -> tuple[float, float]:
            started, first = time.perf_counter(), 0.0
            headers = {"content-type": "application/json"}
            with http_client.stream(
                "POST", f"{url}/v1/audio/speech", content=body(seed), headers=headers
            ) as reply:
                reply.raise_for_status()
                for chunk in reply.iter_raw():
                    if chunk and not first:
                        first = time.perf_counter()
            return timed("httpx", seed, started, first, reply.headers.get("x-first-audio-ms"))

        def through_http_client(seed: int) -> tuple[float, float]:
            # A connection made before the clock starts (the gateway closes idle keep-alive
            # ones while the other sides' replies run, and http.client does not reconnect).
            lean.close()
            lean.connect()
            started = time.perf_counter()
            lean.request("POST", "/v1/audio/speech", body(seed), {"content-type": "application/json"})
            reply = lean.getresponse()
            if reply.status != 200:
                raise SystemExit(f"the gateway answered {reply.status}: {reply.read()[:300]!r}")
            reply.read1(1 << 16)  # the first audio bytes (the body's first chunk)
            first = time.perf_counter()
            reply.read()
            return timed("http.client", seed, started, first, reply.getheader("x-first-audio-ms"))

        sides = (("coordinator", direct), ("httpx", through_httpx), ("http.client", through_http_client))
        for i in range(warmup + runs):
            # Which side goes first rotates: a reply runs faster or slower after another (its
            # cluster's idle work), and a fixed order would charge that to one side.
            for side, call in sides[i % 3 :] + sides[: i % 3]:
                pair = call(i)
                if i >= warmup:
                    times[side].append(pair)
    lean.close()
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
    direct = times["coordinator"]
    for name in HTTP_CLIENTS:  # each reply against the SDK's reply to the same request (seed)
        gateway = times[name]
        summary = {
            **common,
            "http_client": name,
            "added_first_audio_p50_ms_paired": round(
                statistics.median(g[0] - d[0] for g, d in zip(gateway, direct, strict=True)), 3
            ),
            "gateway_outside_first_audio_p50_ms": round(statistics.median(outside[name]), 3),
            "whole_reply_ratio_p50_paired": round(
                statistics.median(g[1] / d[1] for g, d in zip(gateway, direct, strict=True)), 4
            ),
            "whole_reply_ratio_of_p50s": round(
                statistics.median(g for _, g in gateway) / statistics.median(d for _, d in direct), 4
            ),
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
