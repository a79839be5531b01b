"""The one set of limits on what a caller may ask for, shared by every path that takes it:
a request's fields (omni_common/models/validation.py) and the admin calls that set the same things
(StageControl.AddLora's scale, for one). A limit written twice drifts: AddLora once accepted
a scale of 1e38 that requests were refused, and a request then using that adapter failed
with NaN."""

from __future__ import annotations

MAX_PROMPT_CHARS = 10_000
MAX_SIDE = 4096
MAX_PIXELS = 4 * 1024 * 1024
MAX_STEPS = 1000
MAX_CFG = 100.0
MAX_SEQUENCE_LENGTH = 4096  # the families cap it lower (Qwen-Image: 1024)
MAX_OPTIONS = 32
MAX_OPTION_CHARS = 64
# LoRA adapters: how many one request names, and the magnitude of a scale (a request's, or
# an adapter's default set by AddLora).
MAX_LORAS = 8
MAX_LORA_SCALE = 100.0
# Input video (InputVideo): frames a clip, the rate they were taken at, and the pixels of all
# its frames together (each frame is also held to the server's image pixel limit).
MAX_VIDEO_FRAMES = 256
MIN_VIDEO_FPS, MAX_VIDEO_FPS = 0.1, 60.0
MAX_VIDEO_PIXELS = 64 * 1024 * 1024
