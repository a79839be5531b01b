"""The one config loader: every service setting is a command-line flag with an environment
fallback (OMNISTAGE_<NAME>), which is how docker-compose.yml configures the services."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("ar-encoder", "dit-denoise", "vae-decode")
# How stages that share a device share its memory (one setting per deployment, read by the
# coordinator and every stage): none = all resident; swap = the coordinator sleeps and wakes
# whole stages around their calls; layerwise = the DiT streams its blocks through the device.
OFFLOAD_POLICIES = ("none", "swap", "layerwise")
DEFAULT_PORTS = {
    "coordinator": 50051,
    "ar-encoder": 50061,
    "dit-denoise": 50062,
    "vae-decode": 50063,
    "gateway": 8000,  # HTTP (the OpenAI-compatible gateway), not gRPC
}


def env(name: str, default: str) -> str:
    return os.environ.get(f"OMNISTAGE_{name}", default)


# The VAE's pixels per forward by device type (--max-batch-pixels -1). CPU, the tiny
# fixture's VAE on 2 cores: per image, a batch of 2 at 256x256 costs 722 ms, of 4 811 ms, of
# 8 946 ms (activations leave the caches); 8 at 128x128 and 32 at 64x64 are the best. A GPU
# has no such cliff and a decode of one 512x512 image is launch-bound (23 ms on an H100),
# so it batches up to 8 such images (2 at 1024x1024, ~4 GiB of activations each).
VAE_BATCH_PIXELS = {"cpu": 131072, "cuda": 8 * 512 * 512}


@dataclass(frozen=True)
class StageConfig:
    """Settings of one stage replica."""

    stage: str
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "auto"
    dtype: str = "float32"
    threads: int = 0
    model_name: str = ""
    shm_dir: str = "/dev/shm"
    lease_ttl_s: float = 600.0
    inline_bytes: int = 64 * 1024
    max_pixels: int = 4 * 1024 * 1024
    advertise_host: str = ""
    max_batch: int = 8
    max_queue: int = 64
    batch_window_ms: float = 0.0
    max_tokens: int = 65536
    max_batch_pixels: int = -1  # -1: by device (VAE_BATCH_PIXELS)
    coordinator: str = ""
    # The model roles this replica serves (a subset of its family's roles on its stage); () = all.
    roles: tuple[str, ...] = ()
    backend: str = "torch"
    cache_bytes: int = 256 * 1024 * 1024
    cache_bypass: bool = False
    vllm_memory_fraction: float = 0.1
    offload: str = "none"
    metrics_port: int = 0
    # dit-denoise execution (DenoiserOptions); auto = on for a CUDA device.
    cuda_graphs: str = "auto"
    capture_sizes: tuple[tuple[int, int], ...] = ()
    attention_backend: str = ""
    compile: str = "auto"
    # torch.compile's on-disk caches (compile_cache.py); empty = PyTorch's default under /tmp.
    compile_cache: str = ""
    # dit-denoise LoRA adapters (DenoiserOptions): memory bound, directory, batching.
    lora_bytes: int = 1 << 30
    lora_dir: str = ""
    lora_batching: str = "mixed"
    # Where StageControl.StartProfile writes traces; empty = <tmp>/omnistage-profiles-<uid>.
    profile_dir: str = ""
    # A profile stops itself after this long, or once the replica grew this much resident
    # memory since it started (runtime/profiler.py).
    profile_max_s: float = 60.0
    profile_max_mb: int = 1024
    # The directory AddLora's and LoadWeights' paths must lie in (symlinks resolved first);
    # empty: any file this process can read (the cluster token is then the only guard).
    control_root: str = ""
    # dit-denoise: the devices one replica spreads each step over, one worker process each
    # (cuda:0,cuda:1 or cpu,cpu); () = one device, in this process (`device`).
    devices: tuple[str, ...] = ()
    # dit-denoise: "fp8" runs the DiT's block products in FP8 (DenoiserOptions.quantization).
    quantization: str = "none"
    # dit-denoise over several devices: where each request runs (runtime/parallel_mode.py).
    parallel_mode: str = "auto"
    cfg_parallel_tokens: int = 8192
    sequence_parallel_tokens: int = 16384

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of the coordinator: where each stage's replicas listen."""

    replicas: dict[str, list[str]] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS["coordinator"]
    shm_dir: str = "/dev/shm"
    stage_timeout_s: float = 600.0
    # With no healthy replica for a step: how long a request waits for one (0 = fail at once).
    replica_wait_s: float = 30.0
    max_pixels: int = 4 * 1024 * 1024
    max_in_flight: int = 256
    offload: str = "none"
    # swap: weight bytes that may be awake at once on one device; 0 = 90% of its memory.
    device_memory_budget: int = 0
    metrics_port: int = 0
    advertise_host: str = ""
    # Content-addressed outputs of cacheable plan steps (GLM-Image's condition KV), held in
    # their producers' memory: at most this many bytes, each for at most this long (less than
    # the stages' lease TTL, which would end them).
    step_cache_bytes: int = 2 << 30
    step_cache_ttl_s: float = 300.0

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


def add_common_args(parser: argparse.ArgumentParser, service: str) -> None:
    parser.add_argument("--host", default=env("HOST", "127.0.0.1"), help="interface to bind")
    parser.add_argument(
        "--port", type=int, default=int(env("PORT", str(DEFAULT_PORTS[service]))), help="0 = any free port"
    )
    parser.add_argument("--shm-dir", default=env("SHM_DIR", "/dev/shm"), help="POSIX shared-memory directory")
    parser.add_argument(
        "--max-pixels",
        type=int,
        default=int(env("MAX_PIXELS", str(4 * 1024 * 1024))),
        help="largest width*height served",
    )
    parser.add_argument(
        "--offload",
        default=env("OFFLOAD", "none"),
        choices=OFFLOAD_POLICIES,
        help="device memory policy of the deployment: none, swap (whole stages take turns) or "
        "layerwise (the DiT streams its blocks)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("METRICS_PORT", "0")),
        # Off by default: the local cluster runs every service on one host, where one fixed
        # port would collide; deploy/k8s sets it (each pod has its own network namespace).
        help="serve Prometheus metrics over HTTP at :PORT/metrics (0 = off)",
    )
    parser.add_argument(
        "--advertise-host",
        default=env("ADVERTISE_HOST", ""),
        help="host name peers use to reach this replica (default: --host)",
    )


def add_stage_args(parser: argparse.ArgumentParser, stage: str) -> None:
    add_common_args(parser, stage)
    parser.add_argument("--model", default=env("MODEL", ""), help="local diffusers model directory")
    parser.add_argument("--model-name", default=env("MODEL_NAME", ""), help="served name (default: dir name)")
    parser.add_argument("--device", default=env("DEVICE", "auto"), help="auto, cpu or cuda:N")
    parser.add_argument(
        "--devices",
        default=env("DEVICES", ""),
        help="dit-denoise: comma-separated devices one replica spreads each step over, one worker "
        "process each (cuda:0,cuda:1; cpu,cpu with gloo); sequence parallel, and CFG parallel with "
        "a negative prompt. Empty: one device (--device)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=int(env("GPUS", "0")),
        help="dit-denoise: shorthand for --devices cuda:0,...,cuda:N-1 (0 or 1: one device)",
    )
    parser.add_argument(
        "--parallel-mode",
        default=env("PARALLEL_MODE", "auto"),
        choices=("auto", "sequence-parallel", "data-parallel"),
        help="dit-denoise over several devices: auto picks per request (a lone large request split "
        "over the devices, CFG parallel or sequence parallel; otherwise each request on one device, "
        "several at once); sequence-parallel splits every request; data-parallel never does",
    )
    parser.add_argument(
        "--cfg-parallel-tokens",
        type=int,
        default=int(env("CFG_PARALLEL_TOKENS", "8192")),
        help="dit-denoise, --parallel-mode auto: a lone request with true CFG runs its two branches "
        "on the two halves of the devices from this many image tokens a step (CFG counted twice; "
        "Qwen-Image: 8192 = 1024x1024 with CFG)",
    )
    parser.add_argument(
        "--sequence-parallel-tokens",
        type=int,
        default=int(env("SEQUENCE_PARALLEL_TOKENS", "16384")),
        help="dit-denoise, --parallel-mode auto: a lone request is split over the devices (Ulysses) "
        "from this many image tokens a step (Qwen-Image: 16384 = 2048x2048)",
    )
    parser.add_argument(
        "--dtype",
        default=env("DTYPE", "float32"),
        choices=("float32", "bfloat16", "float16"),
        help="the weights' dtype (OMNISTAGE_DTYPE; default float32)",
    )
    parser.add_argument(
        "--threads", type=int, default=int(env("THREADS", "0")), help="torch threads (0 = all)"
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=float(env("LEASE_TTL_S", "600")),
        help="seconds an output lease lives unless released (OMNISTAGE_LEASE_TTL_S)",
    )
    parser.add_argument(
        "--inline-bytes",
        type=int,
        default=int(env("INLINE_BYTES", str(64 * 1024))),
        help="tensors up to this size travel inside the message, larger ones by handle",
    )
    parser.add_argument(
        "--max-batch", type=int, default=int(env("MAX_BATCH", "8")), help="requests per forward"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=int(env("MAX_QUEUE", "64")),
        help="requests waiting or running; more are refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=float(env("BATCH_WINDOW_MS", "0")),
        help="wait this long for more requests before a forward (encoder, VAE) or before the first "
        "step of new requests (dit-denoise); 0 = none: throughput for latency",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=int(env("MAX_TOKENS", "65536")),
        help="dit-denoise: image tokens per forward, CFG counted twice",
    )
    parser.add_argument(
        "--max-batch-pixels",
        type=int,
        default=int(env("MAX_BATCH_PIXELS", "-1")),
        help="vae-decode: image pixels per forward (0 = no limit, -1 = by device: "
        f"{VAE_BATCH_PIXELS['cpu']} on a CPU, {VAE_BATCH_PIXELS['cuda']} on a GPU); larger batches "
        "stop paying once their activations leave the CPU's caches",
    )
    parser.add_argument(
        "--coordinator",
        default=env("COORDINATOR", ""),
        help="coordinator address to register with and heartbeat to (empty: static config only)",
    )
    parser.add_argument(
        "--roles",
        default=env("ROLES", ""),
        help="comma-separated model roles to serve (e.g. prior); empty = every role the model's "
        "family has on this stage. Replicas of one role scale separately from the others",
    )
    parser.add_argument(
        "--backend",
        default=env("BACKEND", "torch"),
        choices=("torch", "vllm"),
        help="ar-encoder: torch (in-process transformers) or vllm (vLLM's engine; needs omnistage[vllm])",
    )
    parser.add_argument(
        "--cache-bytes",
        type=int,
        default=int(env("CACHE_BYTES", str(256 * 1024 * 1024))),
        help="ar-encoder: size in bytes of the roles' caches (0 = off): Qwen-Image's prompt embeddings, "
        "Qwen2.5-Omni's thinker's prompt-prefix KV (a conversation's earlier turns)",
    )
    parser.add_argument(
        "--cache-bypass",
        action="store_true",
        default=env("CACHE_BYPASS", "0") in ("1", "true", "yes"),
        help="ar-encoder: neither read nor fill those caches (for measurements)",
    )
    parser.add_argument(
        "--vllm-memory-fraction",
        type=float,
        default=float(env("VLLM_MEMORY_FRACTION", "0.1")),
        help="ar-encoder with --backend vllm: share of device memory (CPU: of RAM) for vLLM",
    )
    parser.add_argument(
        "--cuda-graphs",
        default=env("CUDA_GRAPHS", "auto"),
        choices=("auto", "on", "off"),
        help="dit-denoise: replay each forward as a CUDA graph; ar-encoder: each lone prompt's "
        "(auto: on a CUDA device without layerwise offload)",
    )
    parser.add_argument(
        "--capture-sizes",
        default=env("CAPTURE_SIZES", ""),
        help="WxH sizes (comma-separated, e.g. 512x512,1024x1024) the stage prepares at start: "
        "dit-denoise compiles them and times their CUDA graphs for every batch up to --max-batch; "
        "vae-decode compiles its decode of one image where that beats eager",
    )
    parser.add_argument(
        "--attention-backend",
        default=env("ATTENTION_BACKEND", ""),
        help="dit-denoise: a diffusers attention backend (_native_cudnn, _native_flash, "
        "_native_efficient, ...); empty keeps diffusers' default",
    )
    parser.add_argument(
        "--compile",
        default=env("COMPILE", "auto"),
        choices=("auto", "on", "off"),
        help="torch.compile the model's repeated blocks: dit-denoise the transformer's (auto: on "
        "a CUDA device without layerwise offload), ar-encoder the text encoder's (on only: auto "
        "replays lone prompts as CUDA graphs instead), vae-decode the decode at --capture-sizes "
        "(auto: on a CUDA device)",
    )
    parser.add_argument(
        "--compile-cache",
        default=env("COMPILE_CACHE", ""),
        help="a directory for torch.compile's caches, kept across restarts (a volume): a restarted "
        "replica loads its compiled kernels instead of compiling them; empty: PyTorch's default "
        "under /tmp",
    )

    parser.add_argument(
        "--lora-bytes",
        type=int,
        default=int(env("LORA_BYTES", str(1 << 30))),
        help="dit-denoise: device memory for LoRA adapters; beyond it the least recently used "
        "unpinned adapter is evicted",
    )
    parser.add_argument(
        "--lora-dir",
        default=env("LORA_DIR", ""),
        help="dit-denoise: a directory of adapters (NAME.safetensors or NAME/) that requests may "
        "name without an AddLora first; empty: only added adapters",
    )
    parser.add_argument(
        "--lora-batching",
        default=env("LORA_BATCHING", "mixed"),
        choices=("mixed", "grouped"),
        help="dit-denoise: requests with different LoRA adapters share one forward, each row its "
        "own adapters (mixed), or take one forward per adapter set (grouped)",
    )

    parser.add_argument(
        "--control-root",
        default=env("CONTROL_ROOT", ""),
        help="the directory that AddLora's and LoadWeights' paths must lie in (no symlink leads "
        "out of it; outside reads as missing); empty: any file this process can read",
    )
    parser.add_argument(
        "--quantization",
        default=env("QUANTIZATION", "none"),
        choices=("none", "fp8"),
        help="dit-denoise: fp8 runs the DiT blocks' attention and feed-forward products in FP8 "
        "(float8_e4m3fn, per-token and per-channel scales; a GPU of compute capability 8.9+ or the "
        "CPU): faster, not exact. Families that offer it: Qwen-Image",
    )
    parser.add_argument(
        "--profile-dir",
        default=env("PROFILE_DIR", ""),
        help="where `omnistage profile` traces of this replica go, owner-only (default: "
        "omnistage-profiles-<uid> in the system's temporary directory)",
    )
    parser.add_argument(
        "--profile-max-s",
        type=float,
        default=float(env("PROFILE_MAX_S", "60")),
        help="a profile that nobody stops stops itself after this many seconds",
    )
    parser.add_argument(
        "--profile-max-mb",
        type=int,
        default=int(env("PROFILE_MAX_MB", "1024")),
        help="a profile stops itself once the replica's resident memory grew this many MiB",
    )


def stage_config(stage: str, args: argparse.Namespace) -> StageConfig:
    if not args.model:
        raise SystemExit(f"{stage}: --model (or OMNISTAGE_MODEL) must name a local model directory")
    devices = parse_devices(args.devices, args.gpus)
    if devices and stage != "dit-denoise":
        raise SystemExit(f"{stage}: --devices and --gpus are for dit-denoise; {stage} runs on --device")
    return StageConfig(
        stage=stage,
        model_dir=Path(args.model),
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        model_name=args.model_name,
        shm_dir=args.shm_dir,
        lease_ttl_s=args.lease_ttl,
        inline_bytes=args.inline_bytes,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        batch_window_ms=args.batch_window_ms,
        max_tokens=args.max_tokens,
        max_batch_pixels=args.max_batch_pixels,
        coordinator=args.coordinator,
        roles=tuple(role.strip() for role in args.roles.split(",") if role.strip()),
        backend=args.backend,
        cache_bytes=args.cache_bytes,
        cache_bypass=args.cache_bypass,
        vllm_memory_fraction=args.vllm_memory_fraction,
        max_pixels=args.max_pixels,
        advertise_host=args.advertise_host,
        offload=args.offload,
        metrics_port=args.metrics_port,
        cuda_graphs=args.cuda_graphs,
        capture_sizes=parse_sizes(args.capture_sizes),
        attention_backend=args.attention_backend,
        compile=args.compile,
        compile_cache=args.compile_cache,
        lora_bytes=args.lora_bytes,
        lora_dir=args.lora_dir,
        lora_batching=args.lora_batching,
        profile_dir=args.profile_dir,
        profile_max_s=args.profile_max_s,
        profile_max_mb=args.profile_max_mb,
        control_root=args.control_root,
        devices=devices,
        quantization=args.quantization,
        parallel_mode=args.parallel_mode,
        cfg_parallel_tokens=args.cfg_parallel_tokens,
        sequence_parallel_tokens=args.sequence_parallel_tokens,
    )


def parse_devices(text: str, gpus: int) -> tuple[str, ...]:
    """--devices / --gpus as a device list; () for one device."""
    if text and gpus > 1:
        raise SystemExit("give --devices or --gpus, not both")
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if gpus > 1:
        devices = tuple(f"cuda:{i}" for i in range(gpus))
    for device in devices:
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cuda" and not index):
            raise SystemExit(f"--devices takes cpu or cuda:N items, not {device!r}")
    if len({d for d in devices if d != "cpu"}) != len([d for d in devices if d != "cpu"]):
        raise SystemExit(f"--devices names a GPU twice: {','.join(devices)}")
    if len({d.partition(":")[0] for d in devices}) > 1:
        raise SystemExit("--devices mixes the CPU and GPUs; one kind per replica")
    if len(devices) == 1:
        raise SystemExit(f"--devices names one device; use --device {devices[0]} for that")
    return devices


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """ "512x512,1024x768" -> ((512, 512), (1024, 768)) as (width, height)."""
    sizes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        width, sep, height = item.partition("x")
        if not sep or not width.isdigit() or not height.isdigit():
            raise SystemExit(f"--capture-sizes takes WIDTHxHEIGHT items, not {item!r}")
        sizes.append((int(width), int(height)))
    return tuple(sizes)


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, "coordinator")
    for stage in STAGES:
        key = stage.replace("-", "_").upper()
        parser.add_argument(
            f"--{stage}",
            default=env(key, ""),
            help=f"comma-separated static {stage} replica addresses (replicas may also register)",
        )
    parser.add_argument(
        "--stage-timeout",
        type=float,
        default=float(env("STAGE_TIMEOUT_S", "600")),
        help="seconds one stage call may take (OMNISTAGE_STAGE_TIMEOUT_S)",
    )
    parser.add_argument(
        "--replica-wait",
        type=float,
        default=float(env("REPLICA_WAIT_S", "30")),
        help="seconds a request waits for a healthy replica of a stage that has none (a restart, "
        "scaling up) before it fails with UNAVAILABLE; within the request's deadline; 0: fail at once",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=int(env("MAX_IN_FLIGHT", "256")),
        help="requests in flight; more are refused with RESOURCE_EXHAUSTED",
    )
    parser.add_argument(
        "--step-cache-bytes",
        type=int,
        default=int(env("STEP_CACHE_BYTES", str(2 << 30))),
        help="bytes of cacheable step outputs (GLM-Image's condition KV) kept for reuse by requests "
        "with the same inputs, in their producers' memory (0 = off)",
    )
    parser.add_argument(
        "--step-cache-ttl",
        type=float,
        default=float(env("STEP_CACHE_TTL_S", "300")),
        help="seconds a cached step output is reused at most; keep it below the stages' --lease-ttl",
    )
    parser.add_argument(
        "--device-memory-budget",
        type=int,
        default=int(env("DEVICE_MEMORY_BUDGET", "0")),
        help="--offload swap: weight bytes awake at once per device (0 = 90%% of its memory)",
    )


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    replicas = {
        stage: [a.strip() for a in getattr(args, stage.replace("-", "_")).split(",") if a.strip()]
        for stage in STAGES
    }
    return CoordinatorConfig(
        replicas=replicas,
        host=args.host,
        port=args.port,
        shm_dir=args.shm_dir,
        stage_timeout_s=args.stage_timeout,
        replica_wait_s=args.replica_wait,
        max_pixels=args.max_pixels,
        max_in_flight=args.max_in_flight,
        offload=args.offload,
        device_memory_budget=args.device_memory_budget,
        metrics_port=args.metrics_port,
        advertise_host=args.advertise_host,
        step_cache_bytes=args.step_cache_bytes,
        step_cache_ttl_s=args.step_cache_ttl,
    )


@dataclass(frozen=True)
class GatewayConfig:
    """Settings of the HTTP gateway (services/gateway): where it listens, the coordinator it
    translates to, and how long one request may take there."""

    coordinator: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS["gateway"]
    # The deadline of every Generate call (the coordinator passes it on to each stage): past
    # it the client gets 504.
    request_timeout_s: float = 600.0
    # The most images one POST /v1/images/generations may ask for (`n`).
    max_images: int = 10

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=env("HOST", "127.0.0.1"), help="interface to bind")
    parser.add_argument(
        "--port",
        type=int,
        default=int(env("PORT", str(DEFAULT_PORTS["gateway"]))),
        help="HTTP port (0 = any)",
    )
    parser.add_argument(
        "--coordinator", default=env("COORDINATOR", "127.0.0.1:50051"), help="the coordinator's gRPC address"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=float(env("REQUEST_TIMEOUT_S", "600")),
        help="seconds one generation may take before the client gets 504",
    )
    parser.add_argument(
        "--max-images",
        type=int,
        default=int(env("MAX_IMAGES", "10")),
        help="the most images one request may ask for (n)",
    )


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    if args.request_timeout <= 0:
        raise SystemExit("--request-timeout must be positive")
    if args.max_images < 1:
        raise SystemExit("--max-images must be at least 1")
    return GatewayConfig(
        coordinator=args.coordinator,
        host=args.host,
        port=args.port,
        request_timeout_s=args.request_timeout,
        max_images=args.max_images,
    )
