"""The try-it page in a real headless browser (Chromium driven by Playwright): type a prompt,
click Generate, watch the progress bar and previews fill from the SSE stream, and get the
image the SDK gives for the same seed, with the per-step timings."""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from omni_common.client import Client

from .conftest import InProcessCluster, InProcessGateway

pytestmark = pytest.mark.slow  # starts a browser

# Debian's package (scripts/setup.sh installs it); Playwright's own browser download is not used.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def gateway(cluster: InProcessCluster) -> Iterator[InProcessGateway]:
    running = InProcessGateway(cluster.loop, cluster.coordinator)
    yield running
    running.stop()


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (scripts/setup.sh installs Debian's)"
)
def test_type_a_prompt_click_and_the_image_appears(cluster, gateway) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{gateway.url}/")
            page.wait_for_function("document.querySelector('#model').options.length > 0", timeout=30_000)
            assert page.input_value("#model") == "qwen-image-tiny"
            page.fill("#prompt", "a lighthouse at dusk")
            page.fill("#size", "32x32")
            page.fill("#steps", "5")
            page.fill("#seed", "5")
            page.click("#generate")
            page.wait_for_function(
                "document.querySelector('#result').src.startsWith('data:image/png')", timeout=60_000
            )
            result = page.get_attribute("#result", "src")
            preview = page.get_attribute("#preview", "src")
            progress = page.eval_on_selector("#progress", "p => [p.value, p.max]")
            steps = page.eval_on_selector_all(
                "#timings tbody tr td:first-child", "cells => cells.map(c => c.textContent)"
            )
            natural = page.eval_on_selector("#result", "img => [img.naturalWidth, img.naturalHeight]")
            status = page.inner_text("#status")
            error = page.inner_text("#error")
        finally:
            browser.close()
    assert error == ""
    assert natural == [32, 32] and "done" in status
    assert progress == [5, 5]
    assert preview is not None and preview.startswith("data:image/png;base64,")
    assert sorted(steps) == ["decode", "denoise", "encode"]
    assert result is not None
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.split(",", 1)[1]))).convert("RGB"))
    with Client(cluster.coordinator) as sdk:
        expected = sdk.generate("a lighthouse at dusk", width=32, height=32, steps=5, seed=5, guidance=1.0)
    np.testing.assert_array_equal(shown, np.asarray(expected.convert("RGB")))
