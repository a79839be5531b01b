"""The Qwen2.5-Omni model family (transformers' Qwen2_5OmniForConditionalGeneration): a chat
model that writes its reply and speaks it, as a chain of streaming stages.

`generate(return_audio=True)` runs thinker -> talker -> token2wav one after the other; here
each is a role on its own stage and each streams into the next:
- **thinker** (ar-encoder): writes the reply token by token, continuously batched; sends, as it
  goes, every token's last hidden state + embedding (what the talker reads) and its text;
- **talker** (ar-encoder): samples codec tokens, one per step, each step reading the next
  thinker row; it starts when the thinker's first rows exist and sends codes as it goes;
- **token2wav** (dit-denoise): the audio DiT turns codes into a mel spectrogram by flow
  matching (RK4, 10 steps, guidance 0.5) in windows of codes as they arrive;
- **vocoder** (vae-decode): BigVGAN turns mel frames into 24 kHz samples, which reach the
  client as AudioChunk events while the reply is still being written.

Light on purpose: the coordinator imports it; the runners' modules load with a stage.
"""

from __future__ import annotations

from pathlib import Path

from omni_common.errors import InvalidArgument
from omni_common.input_media import input_audio_name, input_image_name, input_video_name
from omni_common.models.base import (
    GenerationRequest,
    ModelCard,
    Plan,
    PlanStep,
    RoleSpec,
    StageContext,
    StageModel,
)
from omni_common.models.conversation_keys import prefix_keys
from omni_common.models.module_layout import ModuleDeclaration, SequenceParallelPlan
from omni_common.models.qwen_omni.options import OPTIONS, option_int
from omni_common.models.validation import check_options

# What the thinker hears: Whisper's feature extractor at 16 kHz (nothing is resampled), at most
# its window (the real processor's chunk_length, 300 s; a checkpoint's own may be shorter, which
# the thinker checks), a few clips, images and videos a request (each video's frames within the
# server's limits, omni_common/limits.py).
INPUT_SAMPLE_RATE = 16_000
MAX_AUDIO_SECONDS = 300
MAX_AUDIOS = 8
MAX_IMAGES = 8
MAX_VIDEOS = 4

ROLES = (
    RoleSpec(
        "thinker", "ar-encoder", "steps", "Qwen2.5-Omni thinker: writes the reply, streams hidden states"
    ),
    RoleSpec("talker", "ar-encoder", "steps", "Qwen2.5-Omni talker: codec tokens from the thinker's stream"),
    RoleSpec(
        "token2wav", "dit-denoise", "steps", "token2wav DiT: mel frames from codes (flow matching, RK4)"
    ),
    RoleSpec("vocoder", "vae-decode", "steps", "token2wav BigVGAN: 24 kHz samples from mel frames"),
)

# Paths relative to the stage models; sleep/wake move them.
MODULES = ModuleDeclaration(roles={"encoder": ("thinker", "talker"), "dit": ("dit",), "vae": ("bigvgan",)})


class QwenOmniFamily:
    """Qwen2.5-Omni's generate(return_audio=True) split into streaming thinker, talker,
    token2wav DiT and vocoder roles."""

    name = "qwen2.5-omni"
    card = ModelCard(
        inputs=("text", "audio", "image", "video"),
        max_images=MAX_IMAGES,
        outputs=("text", "audio"),
        options=OPTIONS,
        # The token2wav DiT's solver steps and guidance (Qwen2_5OmniToken2WavModel's defaults).
        defaults={"num_inference_steps": 10, "true_cfg_scale": 0.5},
        dit_cuda_graphs=True,  # token2wav's forwards (token2wav.py)
        quantizations=("bf16",),  # token2wav's DiT in bfloat16 (it runs in float32 otherwise)
    )
    roles: tuple[RoleSpec, ...] = ROLES
    modules: ModuleDeclaration | None = MODULES
    parallel: SequenceParallelPlan | None = None  # one device per replica

    def validate(self, request: GenerationRequest) -> None:
        check_options(dict(request.options), self.card.options, self.name)
        if request.negative_prompt:
            raise InvalidArgument(f"{self.name} takes no negative prompt")
        self._check_audios(request)
        if len(request.videos) > MAX_VIDEOS:
            raise InvalidArgument(f"{self.name} takes at most {MAX_VIDEOS} videos; got {len(request.videos)}")
        if request.messages and request.messages[-1].role == "assistant":
            raise InvalidArgument("the conversation must not end with an assistant message: the reply is")
        if request.num_inference_steps < 2:
            raise InvalidArgument("num_inference_steps (token2wav's solver steps) must be at least 2")

    def _check_audios(self, request: GenerationRequest) -> None:
        if len(request.audios) > MAX_AUDIOS:
            raise InvalidArgument(
                f"{self.name} takes at most {MAX_AUDIOS} audio clips; got {len(request.audios)}"
            )
        for i, clip in enumerate(request.audios):
            if clip.sample_rate != INPUT_SAMPLE_RATE:
                raise InvalidArgument(
                    f"input audio {i} is {clip.sample_rate} Hz; {self.name} hears {INPUT_SAMPLE_RATE} Hz "
                    "mono (resample it first)"
                )
            if clip.seconds > MAX_AUDIO_SECONDS:
                raise InvalidArgument(
                    f"input audio {i} lasts {clip.seconds:.1f} s; "
                    f"{self.name} takes at most {MAX_AUDIO_SECONDS} s"
                )

    def plan(self, request: GenerationRequest) -> Plan:
        """thinker, then (speaking) talker -> token2wav -> vocoder, each fed the previous one's
        stream as it comes."""
        media = (
            *(input_audio_name(i) for i in range(len(request.audios))),
            *(input_image_name(i) for i in range(len(request.images))),
            *(input_video_name(i) for i in range(len(request.videos))),
        )
        thinker = PlanStep(
            "thinker",
            "ar-encoder",
            "thinker",
            consumes=media,
            produces=("thinker_states",),
            progress="tokens",
            prefixes=prefix_keys(request),
        )
        if not option_int(request, "audio"):
            return Plan((thinker,))
        return Plan(
            (
                thinker,
                PlanStep(
                    "talker",
                    "ar-encoder",
                    "talker",
                    consumes=("thinker_states",),
                    streamed=("thinker_states",),
                    produces=("codes",),
                    progress="tokens",
                    resumable=True,
                ),
                PlanStep(
                    "token2wav",
                    "dit-denoise",
                    "token2wav",
                    consumes=("codes",),
                    streamed=("codes",),
                    produces=("mel",),
                    resumable=True,
                ),
                PlanStep(
                    "vocoder",
                    "vae-decode",
                    "vocoder",
                    consumes=("mel",),
                    streamed=("mel",),
                    produces=("audio",),
                ),
            )
        )

    def load(self, stage: str, model_dir: Path, context: StageContext) -> StageModel:
        from omni_common.models.qwen_omni.stages import load_stage

        return load_stage(stage, Path(model_dir), context)
