"""The one config loader: the settings of each service, each declared once as a field of its
config dataclass (runtime/settings.py), from which its flag, its environment fallback
(OMNISTAGE_<NAME>, which is how docker-compose.yml configures the services), its default and
its help text derive."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from omni_common.runtime.parallel_mode import CFG_PARALLEL_TOKENS, POLICIES, SEQUENCE_PARALLEL_TOKENS
from omni_common.runtime.settings import ENV_PREFIX, add_flags, setting, values_from
from omni_common.stages import DECODE_MODES, MAX_BATCH, MAX_QUEUE, STAGE_TABLE, STAGES

# How long a draining service waits for its in-flight work. Deployments give a service
# more than this before they kill it (compose's stop_grace_period, Kubernetes'
# terminationGracePeriodSeconds; tests/unit/test_k8s_manifests.py checks both).
DRAIN_GRACE_S = 30.0

# How stages that share a device share its memory (one setting per deployment, read by the
# coordinator and every stage): none = all resident; swap = the coordinator sleeps and wakes
# whole stages around their calls; layerwise = the DiT streams its blocks through the device.
OFFLOAD_POLICIES = ("none", "swap", "layerwise")
DEFAULT_PORTS = {
    "coordinator": 50051,
    **{stage.name: stage.port for stage in STAGE_TABLE},
    "gateway": 8000,  # HTTP (the OpenAI-compatible gateway), not gRPC
}
SWITCHES = ("auto", "on", "off")

# The VAE's pixels per forward by device type (--max-batch-pixels -1). CPU, the tiny
# fixture's VAE on 2 cores: per image, a batch of 2 at 256x256 costs 722 ms, of 4 811 ms, of
# 8 946 ms (activations leave the caches); 8 at 128x128 and 32 at 64x64 are the best. A GPU
# has no such cliff and a decode of one 512x512 image is launch-bound (23 ms on an H100),
# so it batches up to 8 such images (2 at 1024x1024, ~4 GiB of activations each).
VAE_BATCH_PIXELS = {"cpu": 131072, "cuda": 8 * 512 * 512}


def parse_list(text: str) -> tuple[str, ...]:
    """ "a, b," -> ("a", "b"): a comma-separated flag's items."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_devices(text: str, gpus: int) -> tuple[str, ...]:
    """--devices / --gpus as a device list; () for one device."""
    if text and gpus > 1:
        raise SystemExit("give --devices or --gpus, not both")
    devices = parse_list(text)
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
    for item in parse_list(text):
        width, sep, height = item.partition("x")
        if not sep or not width.isdigit() or not height.isdigit():
            raise SystemExit(f"--capture-sizes takes WIDTHxHEIGHT items, not {item!r}")
        sizes.append((int(width), int(height)))
    return tuple(sizes)


@dataclass(frozen=True, kw_only=True)
class Listener:
    """Where a service listens, and whose child it is (every service, the HTTP gateway included)."""

    host: str = setting("127.0.0.1", "interface to bind")
    port: int = setting(
        0, "port to listen on (0 = any free port); the gateway's speaks HTTP", by_service=DEFAULT_PORTS
    )
    # Set by the launcher that starts the service as its child (LocalCluster: `cluster up`, the
    # tests, the benchmarks), so that a launcher killed outright leaves no service behind.
    parent_pid: int = setting(
        0, "stop (as on SIGTERM) once the process of this pid is no longer the parent (0 = never)"
    )

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, kw_only=True)
class ServiceConfig(Listener):
    """The settings the coordinator and every stage replica share."""

    shm_dir: str = setting("/dev/shm", "POSIX shared-memory directory")
    max_pixels: int = setting(4 * 1024 * 1024, "largest width*height served")
    offload: str = setting(
        "none",
        "device memory policy of the deployment: none, swap (whole stages take turns) or "
        "layerwise (the DiT streams its blocks)",
        choices=OFFLOAD_POLICIES,
    )
    # Off by default: the local cluster runs every service on one host, where one fixed port
    # would collide; deploy/k8s sets it (each pod has its own network namespace).
    metrics_port: int = setting(0, "serve Prometheus metrics over HTTP at :PORT/metrics (0 = off)")
    advertise_host: str = setting("", "host name peers use to reach this replica (default: --host)")


@dataclass(frozen=True, kw_only=True)
class StageConfig(ServiceConfig):
    """Settings of one stage replica."""

    stage: str  # the `omnistage serve` subcommand, not a flag
    # Read as text: stage_config checks that it is given before it becomes a Path.
    model_dir: Path = setting(help="local diffusers model directory", flag="--model", env="MODEL")
    model_name: str = setting("", "served name (default: dir name)")
    device: str = setting("auto", "auto, cpu or cuda:N")
    # dit-denoise: the devices one replica spreads each step over, one worker process each
    # (cuda:0,cuda:1 or cpu,cpu); vae-decode: the devices a large image's decode is split over,
    # in this process (the first is `device`). () = one device (`device`). Read with --gpus.
    devices: tuple[str, ...] = setting(
        (),
        "dit-denoise: comma-separated devices one replica spreads each step over, one worker "
        "process each (cuda:0,cuda:1; cpu,cpu with gloo); sequence parallel, and CFG parallel with "
        "a negative prompt. vae-decode: the devices an image of --split-decode-pixels or more is "
        "decoded over, a band each (the first is the replica's device). Empty: one device (--device)",
    )
    dtype: str = setting("float32", "the weights' dtype", choices=("float32", "bfloat16", "float16"))
    float32_matmul_precision: str = setting(
        "auto",
        "float32 matrix products (torch.set_float32_matmul_precision): highest (IEEE float32) or "
        "high (on a GPU, TensorFloat-32: the factors rounded to a 10-bit mantissa, float32 sums); "
        "auto: high on a CUDA device, highest elsewhere. Reaches the models that run in float32 "
        "whatever --dtype says: Qwen2.5-Omni's token2wav (an H100: an RK4 interval 2.1x faster "
        "alone, 2.9x for 8 utterances, the mel within 2.4e-4 relative L2)",
        choices=("auto", "highest", "high"),
    )
    threads: int = setting(0, "torch threads (0 = all)")
    lease_ttl_s: float = setting(600.0, "seconds an output lease lives unless released", flag="--lease-ttl")
    inline_bytes: int = setting(
        64 * 1024, "tensors up to this size travel inside the message, larger ones by handle"
    )
    max_batch: int = setting(MAX_BATCH, "requests per forward")
    max_queue: int = setting(
        MAX_QUEUE, "requests waiting or running; more are refused with RESOURCE_EXHAUSTED"
    )
    batch_window_ms: float = setting(
        0.0,
        "wait this long for more requests before a forward (encoder, VAE) or before the first "
        "step of new requests (dit-denoise); 0 = none: throughput for latency",
    )
    max_tokens: int = setting(65536, "dit-denoise: image tokens per forward, CFG counted twice")
    split_decode_pixels: int = setting(
        2048 * 2048,
        "vae-decode over --devices: images of this many pixels or more decode in horizontal bands, "
        "one a device at once (diffusers' tiled decode, one tile a band); smaller ones whole on "
        "the first device",
    )
    max_batch_pixels: int = setting(
        -1,
        "vae-decode: image pixels per forward (0 = no limit, -1 = by device: "
        f"{VAE_BATCH_PIXELS['cpu']} on a CPU, {VAE_BATCH_PIXELS['cuda']} on a GPU); larger batches "
        "stop paying once their activations leave the CPU's caches",
    )
    coordinator: str = setting(
        "", "coordinator address to register with and heartbeat to (empty: static config only)"
    )
    # The model roles this replica serves (a subset of its family's roles on its stage); () = all.
    roles: tuple[str, ...] = setting(
        (),
        "comma-separated model roles to serve (e.g. prior); empty = every role the model's "
        "family has on this stage. Replicas of one role scale separately from the others",
        parse=parse_list,
    )
    backend: str = setting(
        "torch",
        "ar-encoder: torch (in-process transformers) or vllm (vLLM's engine; needs omnistage[vllm])",
        choices=("torch", "vllm"),
    )
    cache_bytes: int = setting(
        256 * 1024 * 1024,
        "ar-encoder: size in bytes of the roles' caches (0 = off): Qwen-Image's prompt embeddings, "
        "Qwen2.5-Omni's thinker's prompt-prefix KV (a conversation's earlier turns)",
    )
    cache_bypass: bool = setting(False, "ar-encoder: neither read nor fill those caches (for measurements)")
    drain_linger_s: float = setting(
        0.0,
        "ar-encoder: on SIGTERM, a replica that keeps conversations' prefix KV takes no new work "
        f"but stays up this many seconds more (at most the {DRAIN_GRACE_S:.0f} s drain), answering the "
        "coordinator's prefix exports, so a conversation's next turn moves its KV to another replica "
        "instead of computing it again; 0 = stop once idle",
    )
    prefill_chunk_tokens: int = setting(
        512,
        "ar-encoder: a prompt with more tokens than this to compute is prefilled this many a step, "
        "between the running replies' decode steps, which then wait for one chunk, not the whole "
        "prompt (a chunk that would split an audio clip, image or video runs to its end); a shorter "
        "one that joins running replies is prefilled by the next step, one prompt a step; 0 = every "
        "prompt in one forward when admitted. Roles that chunk: Qwen2.5-Omni's thinker",
    )
    ar_decode: str = setting(
        "auto",
        "ar-encoder: how the generators decode (Qwen2.5-Omni's thinker and talker, GLM-Image's "
        "prior): graphs records each batch bucket's step as a CUDA graph and replays it (off CUDA "
        "the same step runs unrecorded), eager runs transformers' forward a step; auto: graphs on "
        "a CUDA device, eager elsewhere",
        choices=DECODE_MODES,
    )
    vllm_memory_fraction: float = setting(
        0.1, "ar-encoder with --backend vllm: share of device memory (CPU: of RAM) for vLLM"
    )
    # dit-denoise execution (DenoiserOptions); auto = on for a CUDA device.
    cuda_graphs: str = setting(
        "auto",
        "dit-denoise: replay each forward as a CUDA graph; ar-encoder: each lone prompt's; "
        "vae-decode: each vocoder window's (auto: on a CUDA device without layerwise offload)",
        choices=SWITCHES,
    )
    capture_sizes: tuple[tuple[int, int], ...] = setting(
        (),
        "WxH sizes (comma-separated, e.g. 512x512,1024x1024) the stage prepares at start: "
        "dit-denoise compiles them and times their CUDA graphs for every batch up to --max-batch; "
        "vae-decode compiles its decode of one image where that beats eager",
        parse=parse_sizes,
    )
    attention_backend: str = setting(
        "",
        "dit-denoise: a diffusers attention backend (_native_cudnn, _native_flash, "
        "_native_efficient, ...); empty keeps diffusers' default",
    )
    compile: str = setting(
        "auto",
        "torch.compile the model's repeated blocks: dit-denoise the transformer's (auto: on "
        "a CUDA device without layerwise offload), ar-encoder the text encoder's (on only: auto "
        "replays lone prompts as CUDA graphs instead), vae-decode the decode at --capture-sizes "
        "(auto: on a CUDA device)",
        choices=SWITCHES,
    )
    # torch.compile's on-disk caches (compile_cache.py); empty = PyTorch's default under /tmp.
    compile_cache: str = setting(
        "",
        "a directory for torch.compile's caches, kept across restarts (a volume): a restarted "
        "replica loads its compiled kernels instead of compiling them; empty: PyTorch's default "
        "under /tmp",
    )
    # dit-denoise LoRA adapters (DenoiserOptions): memory bound, directory, batching.
    lora_bytes: int = setting(
        1 << 30,
        "dit-denoise: device memory for LoRA adapters; beyond it the least recently used "
        "unpinned adapter is evicted",
    )
    lora_dir: str = setting(
        "",
        "dit-denoise: a directory of adapters (NAME.safetensors or NAME/) that requests may "
        "name without an AddLora first; empty: only added adapters",
    )
    lora_batching: str = setting(
        "mixed",
        "dit-denoise: requests with different LoRA adapters share one forward, each row its "
        "own adapters (mixed), or take one forward per adapter set (grouped)",
        choices=("mixed", "grouped"),
    )
    # The directory AddLora's and LoadWeights' paths must lie in (symlinks resolved first);
    # empty: any file this process can read (the cluster token is then the only guard).
    control_root: str = setting(
        "",
        "the directory that AddLora's and LoadWeights' paths must lie in (no symlink leads "
        "out of it; outside reads as missing); empty: any file this process can read",
    )
    # dit-denoise: the DiT below its model's precision (DenoiserOptions.quantization).
    quantization: str = setting(
        "none",
        "dit-denoise: fp8 runs the DiT blocks' attention and feed-forward products in FP8 "
        "(float8_e4m3fn, per-token and per-channel scales; a GPU of compute capability 8.9+ or the "
        "CPU), offered by Qwen-Image; bf16 runs a DiT that runs in float32 in bfloat16 (its solver "
        "stays float32), offered by Qwen2.5-Omni's token2wav (an H100, compiled: an RK4 interval "
        "1.44x faster alone, 1.82x for 8 utterances, the mel within 6e-3 relative L2 of TF32's). "
        "Faster, not exact",
        choices=("none", "fp8", "bf16"),
    )
    # Where StageControl.StartProfile writes traces; empty = <tmp>/omnistage-profiles-<uid>.
    profile_dir: str = setting(
        "",
        "where `omnistage profile` traces of this replica go, owner-only (default: "
        "omnistage-profiles-<uid> in the system's temporary directory)",
    )
    # A profile stops itself after this long, or once its saved segments or the replica's
    # growth in resident memory since it started reach this size (runtime/profiler.py).
    profile_max_s: float = setting(60.0, "a profile that nobody stops stops itself after this many seconds")
    profile_max_mb: int = setting(
        1024,
        "a profile stops itself once its trace segments, or the replica's growth in resident "
        "memory, reach this many MiB",
    )
    # dit-denoise over several devices: where each request runs (runtime/parallel_mode.py).
    parallel_mode: str = setting(
        "auto",
        "dit-denoise over several devices: auto picks per request (a lone large request split over "
        "the devices, CFG parallel or sequence parallel; otherwise each request on one device, "
        "several at once); sequence-parallel splits every request; data-parallel never does",
        choices=POLICIES,
    )
    cfg_parallel_tokens: int = setting(
        CFG_PARALLEL_TOKENS,
        "dit-denoise, --parallel-mode auto: a lone request with true CFG runs its two branches on "
        "the two halves of the devices from this many image tokens a step (CFG counted twice; "
        "Qwen-Image: 2048 = 512x512 with CFG)",
    )
    sequence_parallel_tokens: int = setting(
        SEQUENCE_PARALLEL_TOKENS,
        "dit-denoise, --parallel-mode auto: a lone request is split over the devices (Ulysses) from "
        "this many image tokens a step (Qwen-Image: 1024 = 512x512); a burst its call announces "
        "runs a request per device; each size at or above it in --capture-sizes adds its spread "
        "forwards to the start",
    )


def add_stage_args(parser: argparse.ArgumentParser, stage: str) -> None:
    add_flags(parser, StageConfig, stage)
    # The one flag with no field of its own: a shorthand that stage_config reads into `devices`.
    parser.add_argument(
        "--gpus",
        type=int,
        default=int(os.environ.get(f"{ENV_PREFIX}GPUS", "0")),
        help="dit-denoise: shorthand for --devices cuda:0,...,cuda:N-1 (0 or 1: one device) "
        f"[{ENV_PREFIX}GPUS]",
    )


def stage_config(stage: str, args: argparse.Namespace) -> StageConfig:
    if not args.model_dir:
        raise SystemExit(f"{stage}: --model (or OMNISTAGE_MODEL) must name a local model directory")
    devices = parse_devices(args.devices, args.gpus)
    if devices and stage not in ("dit-denoise", "vae-decode"):
        raise SystemExit(
            f"{stage}: --devices and --gpus are for dit-denoise and vae-decode; {stage} runs on --device"
        )
    if devices and stage == "vae-decode":  # the replica runs on the first, the bands on all
        if args.device not in ("auto", devices[0]):
            raise SystemExit(
                f"vae-decode: --device {args.device} is not the first of --devices {','.join(devices)}"
            )
        args.device = devices[0]
    if args.prefill_chunk_tokens < 0:
        raise SystemExit(f"{stage}: --prefill-chunk-tokens must be 0 (off) or more")
    if not 0 <= args.drain_linger_s <= DRAIN_GRACE_S:
        raise SystemExit(f"{stage}: --drain-linger-s must be 0 (off) to {DRAIN_GRACE_S:.0f} (the drain)")
    return values_from(StageConfig, args, stage=stage, model_dir=Path(args.model_dir), devices=devices)


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig(ServiceConfig):
    """Settings of the coordinator: where each stage's replicas listen."""

    # Static replica addresses by stage, from one flag per stage (add_coordinator_args).
    replicas: dict[str, list[str]] = field(default_factory=dict)
    stage_timeout_s: float = setting(600.0, "seconds one stage call may take", flag="--stage-timeout")
    # With no healthy replica for a step: how long a request waits for one (0 = fail at once).
    replica_wait_s: float = setting(
        30.0,
        "seconds a request waits for a healthy replica of a stage that has none (a restart, "
        "scaling up) before it fails with UNAVAILABLE; within the request's deadline; 0: fail at once",
        flag="--replica-wait",
    )
    max_in_flight: int = setting(256, "requests in flight; more are refused with RESOURCE_EXHAUSTED")
    # swap: weight bytes that may be awake at once on one device; 0 = 90% of its memory.
    device_memory_budget: int = setting(
        0, "--offload swap: weight bytes awake at once per device (0 = 90%% of its memory)"
    )
    # Content-addressed outputs of cacheable plan steps (GLM-Image's condition KV), held in
    # their producers' memory: at most this many bytes, each for at most this long (less than
    # the stages' lease TTL, which would end them).
    step_cache_bytes: int = setting(
        2 << 30,
        "bytes of cacheable step outputs (GLM-Image's condition KV) kept for reuse by requests "
        "with the same inputs, in their producers' memory (0 = off)",
    )
    step_cache_ttl_s: float = setting(
        300.0,
        "seconds a cached step output is reused at most; keep it below the stages' --lease-ttl",
        flag="--step-cache-ttl",
    )
    # Conversation affinity (services/coordinator/affinity.py): how many conversations' replicas
    # are remembered, so that a chat's next turn runs where its earlier turns' KV is kept.
    prefix_routes: int = setting(
        4096,
        "conversations whose thinker replica is remembered, to send the next turn where the "
        "earlier turns' KV is kept (0 = off: the least-loaded replica)",
    )
    # services/coordinator/prefix_move.py: a turn that runs away from its prefix's replica gets
    # that KV moved by handle when the move takes less time than prefilling it at this rate.
    prefix_prefill_tokens_per_s: float = setting(
        10000.0,
        "the thinker's prefill rate, tokens/s, on the replicas' devices (benchmarks/"
        "omni_prefix_reuse.py measures it): a chat turn sent away from the replica keeping its "
        "earlier turns' KV gets that KV moved when moving it is faster than prefilling it at this "
        "rate, else recomputes it (0 = always recompute)",
    )


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CoordinatorConfig, "coordinator")
    for stage in STAGES:
        variable = ENV_PREFIX + stage.replace("-", "_").upper()
        parser.add_argument(
            f"--{stage}",
            default=os.environ.get(variable, ""),
            help=f"comma-separated static {stage} replica addresses (replicas may also register) "
            f"[{variable}]",
        )


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    replicas = {stage: list(parse_list(getattr(args, stage.replace("-", "_")))) for stage in STAGES}
    return values_from(CoordinatorConfig, args, replicas=replicas)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(Listener):
    """Settings of the HTTP gateway (services/gateway): where it listens, the coordinator it
    translates to, and how long one request may take there."""

    # Another setting than a stage's --coordinator (where a replica registers), in another command.
    coordinator: str = setting("127.0.0.1:50051", "the coordinator's gRPC address")
    # The deadline of every Generate call (the coordinator passes it on to each stage): past
    # it the client gets 504.
    request_timeout_s: float = setting(
        600.0, "seconds one generation may take before the client gets 504", flag="--request-timeout"
    )
    # The most images one POST /v1/images/generations may ask for (`n`).
    max_images: int = setting(10, "the most images one request may ask for (n)")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GatewayConfig, "gateway")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    if args.request_timeout_s <= 0:
        raise SystemExit("--request-timeout must be positive")
    if args.max_images < 1:
        raise SystemExit("--max-images must be at least 1")
    return values_from(GatewayConfig, args)
