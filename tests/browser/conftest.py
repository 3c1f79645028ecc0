"""The browser tier: Debian's Chromium, headless, driven by Playwright with
``executable_path`` (no browser is downloaded). Every test module here marks
itself ``needs_browser``, so without Chromium or Playwright it skips, saying why."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HAVE_PLAYWRIGHT = importlib.util.find_spec("playwright") is not None
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or not HAVE_PLAYWRIGHT,
    reason="needs Debian's chromium package" if CHROMIUM is None else "Playwright for Python is not installed",
)
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield launched
        launched.close()
