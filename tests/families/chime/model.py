"""chime's model, its fixture and its reference: UTF-8 bytes -> prompt embeddings -> latent
frames by flow matching (Euler, from seeded noise) -> 16 kHz samples, 32 per frame.

The stages and the reference call the same functions on the same weights, in float32 whatever
the stage's dtype, so a served waveform equals `reference_generate`'s bit for bit (with the
same thread count)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

SAMPLE_RATE = 16_000
HOP = 32  # samples per latent frame
WIDTH = 8  # embedding and latent width
MAX_BYTES = 256  # the prompt bytes the encoder reads
WEIGHTS = "chime.safetensors"


class ChimeModel(nn.Module):
    """The three pieces, one per stage: their attribute names are the family's module paths."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Sequential(nn.Embedding(256, WIDTH), nn.Linear(WIDTH, WIDTH))
        self.denoiser = nn.Linear(2 * WIDTH + 1, WIDTH)  # [latent, condition, t] -> velocity
        self.vocoder = nn.Linear(WIDTH, HOP)

    @classmethod
    def load(cls, model_dir: Path, device: torch.device) -> ChimeModel:
        model = cls()
        model.load_state_dict(load_file(Path(model_dir) / WEIGHTS))
        return model.to(device).eval()


def build_tiny_fixture(out: Path, seed: int = 0) -> Path:
    """A model directory: model_index.json naming ChimePipeline (how the registry finds the
    family) and seeded random weights."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    save_file(ChimeModel().state_dict(), out / WEIGHTS)
    (out / "model_index.json").write_text(json.dumps({"_class_name": "ChimePipeline"}))
    return out


def make_fixture(out: Path, *, random_weights: str | None, seed: int = 0) -> Path:
    """`omnistage fixture --family chime` (FamilyEntry.fixture): a tiny model only."""
    if random_weights:
        raise ValueError("chime has no random-weights build")
    return build_tiny_fixture(out, seed=seed)


@torch.inference_mode()
def encode(text_encoder: nn.Module, prompt: str, device: torch.device) -> torch.Tensor:
    """The prompt's embeddings [L, WIDTH] (an empty prompt reads one zero byte)."""
    data = prompt.encode()[:MAX_BYTES] or b"\0"
    ids = torch.tensor(list(data), dtype=torch.long, device=device)
    return text_encoder(ids)


def timesteps(steps: int) -> torch.Tensor:
    return torch.linspace(1.0, 0.0, steps + 1)


def noise(frames: int, seed: int) -> torch.Tensor:
    """The starting latents [frames, WIDTH], drawn on the CPU from the request's own generator."""
    return torch.randn(frames, WIDTH, generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def euler_step(
    denoiser: nn.Module, latents: torch.Tensor, condition: torch.Tensor, t: float, t_next: float
) -> torch.Tensor:
    """One Euler step of the flow from t to t_next, conditioned on the mean prompt embedding."""
    frames = latents.shape[0]
    time = torch.full((frames, 1), t, device=latents.device)
    velocity = denoiser(torch.cat([latents, condition.expand(frames, -1), time], dim=1))
    return latents + (t_next - t) * velocity


@torch.inference_mode()
def vocode(vocoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """The waveform [frames * HOP] in [-1, 1]."""
    return torch.tanh(vocoder(latents)).reshape(-1)


def reference_generate(model_dir: Path, prompt: str, seed: int, steps: int, frames: int) -> torch.Tensor:
    """The whole model in one process: what the served reply must equal."""
    model = ChimeModel.load(model_dir, torch.device("cpu"))
    condition = encode(model.text_encoder, prompt, torch.device("cpu")).mean(0, keepdim=True)
    latents = noise(frames, seed)
    ts = timesteps(steps).tolist()
    for t, t_next in itertools.pairwise(ts):
        latents = euler_step(model.denoiser, latents, condition, t, t_next)
    return vocode(model.vocoder, latents)
