"""Train `qwen-image-digits`: the Qwen-Image architecture at toy size, trained on scikit-learn's
digits, so that the default model draws the digit it is asked for.

    python training/train_digits.py                      # writes models/qwen-image-digits/
    python training/train_digits.py --out /tmp/d --vae-steps 50 --dit-steps 200   # a quick try

Same classes as Qwen-Image: Qwen2.5-VL's language model (frozen at its seeded random init) is
the text encoder, `QwenImageTransformer2DModel` the DiT, `AutoencoderKLQwenImage` the VAE and
`FlowMatchEulerDiscreteScheduler` the sampler. Two stages, both deterministic on CPU:

1. the VAE as an autoencoder on 32x32 digits (reconstruction MSE plus a small KL); the
   latents' per-channel mean/std go into its config (`latents_mean`/`latents_std`), so the
   pipeline's un-normalisation (`z * std + mean` before `vae.decode`) is right;
2. the DiT with the rectified-flow loss (predict `noise - x0`) on normalised, packed latents,
   conditioned on prompt embeddings made by `QwenImagePipeline.encode_prompt` itself, at
   sigmas shifted the way the pipeline shifts them for a 32x32 image.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import QwenImagePipeline
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from sklearn.datasets import load_digits
from sklearn.svm import SVC

from omni_common.models.qwenimage.fixture import SCHEDULER_CONFIG, build_text_encoder, build_tokenizer

SEED = 0
THREADS = 2
IMAGE_SIZE = 32  # the 8x8 digits, upscaled bilinearly; a multiple of 16 as the pipeline needs
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = (
    "a handwritten digit {word}",
    "the digit {number}",
    "a handwritten {word}",
    "number {word}",
    "the number {number}",
    "{word}",
    "a drawing of the digit {word}",
    "handwritten number {number}",
)
TEXT_HEAD_DIM = 16  # text hidden size 2 x 16 = the DiT's joint_attention_dim
Z_DIM = 4
VAE_STEPS = 400
VAE_BATCH = 64
VAE_LR = 1e-3
KL_WEIGHT = 1e-3
DIT_STEPS = 3200
DIT_BATCH = 128
DIT_LR = 1e-3
DIT_WARMUP = 200
EMA_DECAY = 0.999
# What the model card and the quality test use: 20 steps, no CFG, 5 images per digit.
EVAL_STEPS = 20
EVAL_PER_DIGIT = 5


def prompt(digit: int, phrasing: int) -> str:
    """The `phrasing`-th way of asking for `digit`."""
    return PHRASINGS[phrasing].format(word=WORDS[digit], number=digit)


def digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as black-on-white RGB in [-1, 1], [N, 3, 1, 32, 32], and their labels."""
    data = load_digits()
    ink = torch.tensor(data.images / 16.0, dtype=torch.float32)[:, None]
    ink = F.interpolate(ink, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    pixels = (1.0 - 2.0 * ink).clamp(-1.0, 1.0).repeat(1, 3, 1, 1)
    return pixels[:, :, None], torch.tensor(data.target, dtype=torch.long)


def to_digits_features(image: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    """A generated [32, 32, 3] uint8 image as the data set's 8x8 features (ink, 0..16): gray,
    inverted, 4x4 block means, as load_digits counts ink per 4x4 block."""
    ink = 1.0 - image.astype(np.float64).mean(axis=2) / 255.0
    size = image.shape[0] // 8
    return 16.0 * ink.reshape(8, size, 8, size).mean(axis=(1, 3)).reshape(64)


def digits_classifier() -> SVC:
    """An SVM on the 8x8 digits (about 99% accurate on held-out digits)."""
    data = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(data.data, data.target)


def build_pipeline() -> QwenImagePipeline:
    """The untrained model: seeded random weights of the chosen sizes."""
    tokenizer = build_tokenizer([prompt(d, k) for d in range(10) for k in range(len(PHRASINGS))])
    torch.manual_seed(SEED)
    text_encoder = build_text_encoder(tokenizer, 2 * TEXT_HEAD_DIM, TEXT_HEAD_DIM)
    torch.manual_seed(SEED)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],  # two spatial downsamplings: 32x32 -> 8x8 latents
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
    )
    torch.manual_seed(SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * Z_DIM,
        out_channels=Z_DIM,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=2 * TEXT_HEAD_DIM,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def train_vae(vae: AutoencoderKLQwenImage, images: torch.Tensor, steps: int) -> None:
    """Autoencoder training: reconstruction MSE of a posterior sample plus a small KL."""
    generator = torch.Generator().manual_seed(SEED + 1)
    optimizer = torch.optim.Adam(vae.parameters(), lr=VAE_LR)
    vae.train()
    for step in range(steps):
        batch = images[torch.randint(len(images), (VAE_BATCH,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = F.mse_loss(recon, batch) + KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"vae step {step:5d}  loss {loss.item():.5f}  kl {kl.item():.3f}", flush=True)
    vae.eval()


@torch.no_grad()
def normalised_latents(vae: AutoencoderKLQwenImage, images: torch.Tensor) -> torch.Tensor:
    """Posterior means of all images, normalised per channel; writes the stats into the config."""
    z = torch.cat([vae.encode(chunk).latent_dist.mode() for chunk in images.split(256)])[:, :, 0]
    mean = z.mean(dim=(0, 2, 3))
    std = z.std(dim=(0, 2, 3))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    # Exactly the pipeline's inverse: it decodes `z / (1 / std) + mean`.
    mean_t = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1)
    std_t = torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1)
    return (z - mean_t) / std_t


@torch.no_grad()
def prompt_embeddings(pipe: QwenImagePipeline) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings of every (digit, phrasing) prompt as the pipeline makes them, one prompt at a
    time (so no padding enters the encoder), then right-padded with a mask: [10*P, L, D], [10*P, L]."""
    embeds = []
    for digit in range(10):
        for phrasing in range(len(PHRASINGS)):
            embed, _ = pipe.encode_prompt(prompt(digit, phrasing), device=torch.device("cpu"))
            embeds.append(embed[0])
    length = max(e.shape[0] for e in embeds)
    padded = torch.zeros(len(embeds), length, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), length)
    for i, embed in enumerate(embeds):
        padded[i, : embed.shape[0]] = embed
        mask[i, : embed.shape[0]] = 1.0
    return padded, mask


def shifted_sigmas(u: torch.Tensor, image_seq_len: int) -> torch.Tensor:
    """The scheduler's exponential dynamic shift, with the pipeline's mu for this resolution."""
    config = SCHEDULER_CONFIG
    mu = calculate_shift(
        image_seq_len,
        config["base_image_seq_len"],
        config["max_image_seq_len"],
        config["base_shift"],
        config["max_shift"],
    )
    return math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0))


def train_dit(
    transformer: QwenImageTransformer2DModel,
    latents: torch.Tensor,
    labels: torch.Tensor,
    embeds: torch.Tensor,
    mask: torch.Tensor,
    steps: int,
) -> None:
    """Rectified flow: x_t = (1 - s) x0 + s noise, the model predicts noise - x0 at timestep s
    (the pipeline passes t / 1000 = s). Keeps an EMA of the weights and loads it at the end."""
    generator = torch.Generator().manual_seed(SEED + 2)
    packed = QwenImagePipeline._pack_latents(latents, len(latents), Z_DIM, latents.shape[2], latents.shape[3])
    img_shapes = [[(1, latents.shape[2] // 2, latents.shape[3] // 2)]] * DIT_BATCH
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=DIT_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / DIT_WARMUP)
            * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * step / max(steps, 1))))
        ),
    )
    ema = copy.deepcopy(transformer).requires_grad_(False)
    transformer.train()
    for step in range(steps):
        index = torch.randint(len(packed), (DIT_BATCH,), generator=generator)
        phrasing = torch.randint(len(PHRASINGS), (DIT_BATCH,), generator=generator)
        which = labels[index] * len(PHRASINGS) + phrasing
        x0 = packed[index]
        noise = torch.randn(x0.shape, generator=generator)
        u = torch.sigmoid(torch.randn(DIT_BATCH, generator=generator)).clamp(1e-4, 1 - 1e-4)
        sigma = shifted_sigmas(u, packed.shape[1])
        s = sigma.view(-1, 1, 1)
        pred = transformer(
            hidden_states=(1.0 - s) * x0 + s * noise,
            encoder_hidden_states=embeds[which],
            encoder_hidden_states_mask=mask[which],
            timestep=sigma,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        decay = min(EMA_DECAY, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema.parameters(), transformer.parameters(), strict=True):
                e.lerp_(p, 1.0 - decay)
        if step % 250 == 0 or step == steps - 1:
            print(f"dit step {step:5d}  loss {loss.item():.4f}", flush=True)
    transformer.load_state_dict(ema.state_dict())
    transformer.eval()


def evaluate(pipe: QwenImagePipeline) -> tuple[float, list[float], list[np.ndarray]]:  # type: ignore[type-arg]
    """The quality test's measurement in-process: 5 images per digit (phrasing k, seed k), 20
    steps, no CFG; an SVM on the 8x8 digits reads them. Returns accuracy, per digit, images."""
    classifier = digits_classifier()
    pipe.set_progress_bar_config(disable=True)
    per_digit, images = [], []
    for digit in range(10):
        hits = 0
        for k in range(EVAL_PER_DIGIT):
            image = pipe(
                prompt(digit, k),
                width=IMAGE_SIZE,
                height=IMAGE_SIZE,
                num_inference_steps=EVAL_STEPS,
                true_cfg_scale=1.0,
                generator=torch.Generator().manual_seed(k),
                output_type="pil",
            ).images[0]
            pixels = np.asarray(image)
            images.append(pixels)
            hits += int(classifier.predict(to_digits_features(pixels)[None])[0] == digit)
        per_digit.append(hits / EVAL_PER_DIGIT)
    return float(np.mean(per_digit)), per_digit, images


def save_grid(images: list[np.ndarray], path: Path) -> None:  # type: ignore[type-arg]
    from PIL import Image

    rows = [np.concatenate(images[d * EVAL_PER_DIGIT : (d + 1) * EVAL_PER_DIGIT], axis=1) for d in range(10)]
    Image.fromarray(np.concatenate(rows, axis=0)).resize((EVAL_PER_DIGIT * 96, 10 * 96), 0).save(path)


def weights_digest(out_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(out_dir.rglob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


MODEL_CARD = """# qwen-image-digits

The Qwen-Image architecture at toy size (diffusers `QwenImagePipeline` layout), trained on
scikit-learn's bundled digits so that the demo draws the digit it is asked for: black ink on
white, {size}x{size}. Prompts like "a handwritten digit seven", "the digit 7", "a handwritten
seven", "number seven", "the number 7", "seven", "a drawing of the digit seven",
"handwritten number 7". Other prompts give some digit.

Reproduce (deterministic; {threads} CPU threads): `python training/train_digits.py`

- **Data**: `sklearn.datasets.load_digits`, 1,797 images of 8x8 (ink 0..16), upscaled
  bilinearly to {size}x{size}, black on white, RGB in [-1, 1].
- **Text encoder**: Qwen2.5-VL (text hidden 32, 2 layers), frozen at its random init (seed
  {seed}); tokenizer: the fixture's local byte-level BPE on the chat template and these prompts.
- **VAE**: `AutoencoderKLQwenImage` (base_dim 8, z_dim {z}, 4x downsampling), {vae_steps} Adam
  steps of batch {vae_batch}, reconstruction MSE + {kl} x KL; `latents_mean`/`latents_std` are
  the latents' per-channel statistics.
- **DiT**: `QwenImageTransformer2DModel` (4 layers, 2 heads x 32, patch 2 -> 16 image tokens),
  {dit_steps} AdamW steps of batch {dit_batch} (lr {lr}, warm-up + cosine), rectified-flow
  loss on packed normalised latents, sigmas logit-normal then shifted as the pipeline shifts
  them; weights are the EMA ({ema}).
- **Seed** {seed}; training took {minutes:.1f} min on a 2-core CPU. Weights: fp32, {mbytes:.2f} MB.
- **Accuracy**: {accuracy:.0%} of {n} images (5 per digit, 20 steps, no CFG, seeds 0-4) are read
  as the asked digit by an SVM trained on the 8x8 digits (image -> gray -> 4x4 block means).
  Per digit 0-9: {per_digit}.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "models/qwen-image-digits"
    )
    parser.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    parser.add_argument("--dit-steps", type=int, default=DIT_STEPS)
    parser.add_argument(
        "--grid", type=Path, default=None, help="also save the evaluation images as a PNG grid"
    )
    args = parser.parse_args()

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    started = time.monotonic()
    images, labels = digit_images()
    pipe = build_pipeline()
    pipe.text_encoder.requires_grad_(False)
    train_vae(pipe.vae, images, args.vae_steps)
    latents = normalised_latents(pipe.vae, images)
    embeds, mask = prompt_embeddings(pipe)
    train_dit(pipe.transformer, latents, labels, embeds, mask, args.dit_steps)
    minutes = (time.monotonic() - started) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(args.out, safe_serialization=True)
    print(f"trained in {minutes:.1f} min; weights sha256 {weights_digest(args.out)}", flush=True)

    reloaded = QwenImagePipeline.from_pretrained(args.out, dtype=torch.float32)
    accuracy, per_digit, generated = evaluate(reloaded)
    if args.grid:
        save_grid(generated, args.grid)
    mbytes = sum(p.stat().st_size for p in args.out.rglob("*.safetensors")) / 1e6
    (args.out / "README.md").write_text(
        MODEL_CARD.format(
            size=IMAGE_SIZE,
            threads=THREADS,
            seed=SEED,
            z=Z_DIM,
            vae_steps=args.vae_steps,
            vae_batch=VAE_BATCH,
            kl=KL_WEIGHT,
            dit_steps=args.dit_steps,
            dit_batch=DIT_BATCH,
            lr=DIT_LR,
            ema=EMA_DECAY,
            minutes=minutes,
            mbytes=mbytes,
            accuracy=accuracy,
            n=10 * EVAL_PER_DIGIT,
            per_digit=", ".join(f"{a:.0%}" for a in per_digit),
        )
    )
    print(f"accuracy {accuracy:.0%}; per digit {per_digit}; {mbytes:.2f} MB", flush=True)


if __name__ == "__main__":
    main()
