"""The trained default model draws the digit it is asked for, through a cluster of real
processes, and those pixels are diffusers' QwenImagePipeline's, bit for bit.

models/qwen-image-digits/ is made by training/train_digits.py. 5 images per digit (phrasing k,
seed k), 32x32, 20 steps, no CFG; an SVM trained here on scikit-learn's 8x8 digits reads each
image after the inverse of how the training images were built (gray, inverted, 4x4 block means
as ink counts 0..16).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from sklearn.datasets import load_digits
from sklearn.svm import SVC

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan

pytestmark = pytest.mark.slow

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "qwen-image-digits"
SIZE = 32
STEPS = 20
PER_DIGIT = 5
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = (  # the first five of the training phrasings
    "a handwritten digit {word}",
    "the digit {number}",
    "a handwritten {word}",
    "number {word}",
    "the number {number}",
)
MIN_ACCURACY = 0.8


def digit_prompt(digit: int, phrasing: int) -> str:
    return PHRASINGS[phrasing].format(word=WORDS[digit], number=digit)


def digit_features(image: np.ndarray) -> np.ndarray:
    """[32, 32, 3] uint8, black ink on white -> the data set's 64 features (ink per 4x4 block)."""
    ink = 1.0 - image.astype(np.float64).mean(axis=2) / 255.0
    block = image.shape[0] // 8
    return 16.0 * ink.reshape(8, block, 8, block).mean(axis=(1, 3)).reshape(64)


@pytest.fixture(scope="module")
def digits_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Coordinator address of a float32 cluster of real processes serving the digits model."""
    assert (MODEL_DIR / "model_index.json").is_file(), "run training/train_digits.py first"
    plan = loopback_plan(MODEL_DIR, "float32")
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp("logs-digits")) as cluster:
        yield cluster.coordinator


@pytest.fixture(scope="module")
def generated(digits_cluster: str) -> dict[tuple[int, int], np.ndarray]:
    """(digit, k) -> the cluster's image for phrasing k, seed k."""
    images = {}
    with Client(digits_cluster) as client:
        for digit in range(10):
            for k in range(PER_DIGIT):
                image = client.generate(
                    digit_prompt(digit, k), width=SIZE, height=SIZE, steps=STEPS, guidance=1.0, seed=k
                )
                images[digit, k] = np.asarray(image)
    return images


@pytest.fixture(scope="module")
def diffusers_pipeline() -> QwenImagePipeline:
    """The monolithic pipeline in this process, on the same weights."""
    pipe = QwenImagePipeline.from_pretrained(MODEL_DIR, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_cluster_draws_the_asked_digit(generated: dict[tuple[int, int], np.ndarray]) -> None:
    data = load_digits()
    classifier = SVC(gamma=0.001, C=10.0).fit(data.data, data.target)
    keys = sorted(generated)
    predicted = classifier.predict(np.stack([digit_features(generated[key]) for key in keys]))
    hits = {digit: 0 for digit in range(10)}
    for (digit, _), guess in zip(keys, predicted, strict=True):
        hits[digit] += int(guess == digit)
    accuracy = sum(hits.values()) / len(keys)
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.0%}; hits per digit (of {PER_DIGIT}): {hits}"


@pytest.mark.parametrize(("digit", "k"), [(0, 0), (3, 1), (7, 2), (8, 3), (9, 4)])
def test_cluster_digits_equal_diffusers_bitwise(
    generated: dict[tuple[int, int], np.ndarray],
    diffusers_pipeline: QwenImagePipeline,
    digit: int,
    k: int,
) -> None:
    expected = diffusers_pipeline(
        digit_prompt(digit, k),
        width=SIZE,
        height=SIZE,
        num_inference_steps=STEPS,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(k),
        output_type="pil",
    ).images[0]
    image = generated[digit, k]
    assert image.shape == (SIZE, SIZE, 3)
    assert np.array_equal(image, np.asarray(expected)), (
        f"max pixel difference {np.abs(image.astype(int) - np.asarray(expected).astype(int)).max()}"
    )
