"""The page's camera mode in Chromium, with its fake capture device
(``--use-fake-device-for-media-stream``: a moving test pattern;
``--use-fake-ui-for-media-stream``: the permission is granted without a
prompt): the camera shows beside the output, its frames go to the server as
the session's input, output chunks come back and play, and the page says how
long a camera frame took to reach the screen. A camera the browser will not
open ends the Start with the status line saying so."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.browser.conftest import CHROMIUM, FLAGS, needs_browser
from tests.e2e.conftest import start_server, stop_server

pytestmark = needs_browser

FAKE_CAMERA = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]


@pytest.fixture(scope="module")
def camera_browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS + FAKE_CAMERA)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def stub_server():
    """The stub model (32x32 at 16 fps by default, video input declared), fast steps."""
    server = start_server(pipeline={"step_time_s": 0.005})
    yield server
    stop_server(server)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.http}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_camera_mode_sends_the_camera_and_plays_the_restyled_output(camera_browser, stub_server):
    page = camera_browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(stub_server.http + "/")
    page.fill("#prompt", "a watercolour street")
    page.check("#camera")
    page.fill("#strength", "0.3")  # a range input takes its value as text
    assert page.is_visible("#camera-stat")
    page.click("#start")

    page.wait_for_function("document.getElementById('camera-view').videoWidth > 0", timeout=30_000)
    assert page.is_visible("#camera-screen")
    page.wait_for_function("Number(document.getElementById('chunks').textContent) >= 3", timeout=60_000)
    page.wait_for_function("document.getElementById('video').currentTime > 0.3", timeout=60_000)
    page.wait_for_function("/^\\d+ ms$/.test(document.getElementById('c2s').textContent)", timeout=30_000)
    assert re.fullmatch(r"\d+ dropped by the server · \d+ not sent", page.text_content("#c2s-detail"))
    log = page.text_content("#log")
    assert "restyling the camera at strength 0.3" in log, log

    assert metric(stub_server, "rtvideo_input_frames_received_total") >= 9  # at least chunk 0's input
    page.click("#stop")
    page.wait_for_function("document.getElementById('status').dataset.state === 'stopped'", timeout=30_000)
    # the camera is let go when the session ends
    page.wait_for_function("document.getElementById('camera-view').srcObject === null", timeout=10_000)
    assert errors == []
    page.close()


def test_a_camera_the_browser_refuses_ends_the_start_saying_so(camera_browser, stub_server):
    page = camera_browser.new_page()
    page.add_init_script(
        "navigator.mediaDevices.getUserMedia = () =>"
        " Promise.reject(new DOMException('Permission denied', 'NotAllowedError'));"
    )
    page.goto(stub_server.http + "/")
    page.check("#camera")
    page.click("#start")
    page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=30_000)
    assert page.text_content("#status-title") == "No camera"
    assert "NotAllowedError" in page.text_content("#status-detail")
    assert page.is_enabled("#start")  # Start may be pressed again (e.g. with camera in unticked)
    page.uncheck("#camera")
    page.click("#start")
    page.wait_for_function("Number(document.getElementById('chunks').textContent) >= 1", timeout=60_000)
    page.click("#stop")
    page.close()
