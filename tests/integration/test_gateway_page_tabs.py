"""The try-it page's edit and speak tabs in a real headless browser (Chromium driven by
Playwright), over a real gRPC coordinator that replies from a script (scripted_coordinator.py):
upload an image and see the edit beside it, with the SDK's pixels; speak, and see the text
appear and the <audio> player's duration grow while the reply is still streaming. No broken
image shows before a run.

With OMNISTAGE_PAGE_SCREENSHOTS=DIR set, each tab's screenshot is saved there (docs/images
holds the ones the docs show)."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omni_common.client import Client

from .scripted_coordinator import EDITOR
from .test_gateway_page import CHROMIUM, CHROMIUM_ARGS
from .test_gateway_speech import Scripted, png

pytestmark = [
    pytest.mark.slow,  # starts a browser
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium on this machine (scripts/setup.sh installs Debian's)"
    ),
]


@pytest.fixture(scope="module")
def scripted() -> Iterator[Scripted]:
    running = Scripted()
    yield running
    running.stop()


@pytest.fixture
def page(scripted: Scripted):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 900})
            page.goto(f"{scripted.gateway.url}/")
            page.wait_for_function(
                "document.querySelector('#speak-model').options.length > 0", timeout=30_000
            )
            yield page
        finally:
            browser.close()


def screenshot(page, name: str) -> None:
    folder = os.environ.get("OMNISTAGE_PAGE_SCREENSHOTS")
    if folder:
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def test_no_broken_image_before_a_run(page) -> None:
    hidden = page.eval_on_selector_all(
        "img",
        "images => images.map(i => !i.getAttribute('src') && getComputedStyle(i).visibility === 'hidden')",
    )
    assert hidden and all(hidden)


def test_upload_an_image_and_the_edit_appears_beside_it(scripted, page, tmp_path: Path) -> None:
    source = tmp_path / "photo.png"
    source.write_bytes(png())
    page.click("#tab-edit")
    assert page.is_visible("#edit-form") and not page.is_visible("#form")
    assert page.input_value("#edit-model") == EDITOR  # only the model that edits is offered
    page.set_input_files("#edit-file", str(source))
    page.fill("#edit-prompt", "make it red")
    page.fill("#edit-seed", "9")
    page.click("#edit")
    page.wait_for_function(
        "document.querySelector('#edit-result').src.startsWith('data:image/png')", timeout=60_000
    )
    shown_input = page.get_attribute("#edit-input", "src")
    result = page.get_attribute("#edit-result", "src")
    error = page.inner_text("#edit-error")
    screenshot(page, "page-edit.png")
    assert error == "" and shown_input is not None and shown_input.startswith("blob:")
    assert result is not None
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.split(",", 1)[1]))).convert("RGB"))
    with Client(scripted.address) as sdk:
        expected = sdk.generate("make it red", images=[source.read_bytes()], seed=9, image_format="png")
    np.testing.assert_array_equal(shown, np.asarray(expected.convert("RGB")))


def test_speak_and_the_players_duration_grows_while_the_reply_streams(scripted, page) -> None:
    coordinator = scripted.coordinator
    gate = asyncio.Event()
    scripted.loop.call_soon_threadsafe(lambda: setattr(coordinator, "gate", gate))
    try:
        page.click("#tab-speak")
        page.fill("#speak-prompt", "tell me about the sea and the sky")
        page.click("#speak")
        # The reply is held after its first audio chunk: still streaming.
        page.wait_for_function("document.querySelector('#speak-audio').duration > 0", timeout=60_000)
        during = page.eval_on_selector("#speak-audio", "a => a.duration")
        text_during = page.inner_text("#speak-text")
        assert page.inner_text("#speak-status") == "speaking…"
        screenshot(page, "page-speak.png")
    finally:
        scripted.loop.call_soon_threadsafe(lambda: setattr(coordinator, "gate", None))
        scripted.loop.call_soon_threadsafe(gate.set)
    page.wait_for_function("document.querySelector('#speak-status').textContent === 'done'", timeout=60_000)
    page.wait_for_function(f"document.querySelector('#speak-audio').duration > {during}", timeout=30_000)
    text_after = page.inner_text("#speak-text")
    assert page.inner_text("#speak-error") == ""
    assert text_during and text_after.startswith(text_during) and len(text_after) > len(text_during)
    with Client(scripted.address) as sdk:
        reply = sdk.speak("tell me about the sea and the sky")
    assert text_after == reply.text.strip() or text_after == reply.text
    final = page.eval_on_selector("#speak-audio", "a => a.duration")
    assert abs(final - reply.seconds) < 1e-3
