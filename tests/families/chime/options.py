"""chime's request options: what the card declares and the denoiser reads. A module of its own
so that the family and the runners import it, not each other (and the family stays light)."""

from __future__ import annotations

from omni_common.models.base import GenerationRequest, OptionSpec

OPTIONS = (
    OptionSpec("frames", "int", "16", 1, 4096, "latent frames to generate (32 samples each)"),
    # Client.speak and chat send these two on every request.
    OptionSpec("audio", "int", "1", 1, 1, "1: speak (chime always does)"),
    OptionSpec("stream_audio", "int", "0", 0, 1, "taken, not heeded: chime's audio comes whole at the end"),
)


def frames_of(request: GenerationRequest) -> int:
    return int(request.option("frames", OPTIONS[0].default))
