"""The bundled page in a real headless Chromium (Debian's package, driven by
Playwright with ``executable_path``; no browser is downloaded)."""

from __future__ import annotations

import io
import json

import av
import pytest

from rtvideo.workers.demo import WEIGHTS
from tests.browser.conftest import ARTIFACTS, needs_browser
from tests.e2e.conftest import start_server, stop_server

pytestmark = needs_browser


KEY = "browser-key"


@pytest.fixture(scope="module")
def keyed_demo_server():
    """The demo model behind an API key: the page must ask for it and send it."""
    server = start_server("--api-key", KEY, model="demo")
    yield server
    stop_server(server)


@pytest.fixture(params=[None, KEY], ids=["open", "with-auth"])
def served(request):
    """(server, key): the shared demo server (the default model of ``rtvideo
    serve``), open or behind a key."""
    if request.param is None:
        return request.getfixturevalue("demo_server"), None
    return request.getfixturevalue("keyed_demo_server"), KEY


def test_the_page_streams_applies_a_prompt_and_downloads_an_mp4(browser, served, tmp_path):
    server, api_key = served
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.http + "/")
    if api_key:
        page.fill("#key", api_key)
    page.fill("#prompt", "a lighthouse in a storm")
    page.click("#start")
    page.wait_for_function("document.getElementById('video').currentTime > 0.5", timeout=60_000)

    page.fill("#update", "a calm sunny sea")
    page.click("#send")
    page.wait_for_function("document.getElementById('landed').textContent.startsWith('chunk')", timeout=30_000)
    landed = page.text_content("#landed")
    assert landed.startswith("chunk ") and landed.endswith(" s")
    assert "applied" in page.text_content("#log")
    assert page.text_content("#ttff").endswith(" ms")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser-{'auth' if api_key else 'open'}.png"))

    page.click("#stop")
    page.wait_for_selector("#download:not([hidden])", timeout=30_000)
    with page.expect_download() as download_info:
        page.click("#download button")
    file = tmp_path / "session.mp4"
    download_info.value.save_as(file)
    with av.open(io.BytesIO(file.read_bytes())) as container:
        frames = list(container.decode(video=0))
    assert len(frames) >= 9 and (frames[0].width, frames[0].height) == (64, 64)
    assert errors == []


@pytest.fixture(scope="module")
def stub_server():
    server = start_server(model="stub")
    yield server
    stop_server(server)


def test_the_api_docs_render_with_no_request_leaving_the_machine(browser, stub_server):
    """Swagger UI from the server's own files: every request the page makes goes to
    the server, and the operations render."""
    server = stub_server
    page = browser.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(server.http + "/docs")
    page.wait_for_selector("[data-path='/v1/videos/sync']", timeout=30_000)
    assert requested and all(url.startswith(server.http) for url in requested), requested
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "api-docs.png"))


def test_the_prompt_boxes_suggest_what_a_demo_model_knows(browser, served):
    """The demo model lists its captions (its rtvideo.json): both prompt boxes
    offer them, and the untouched start prompt becomes the first. With an API key
    they come once the key is typed."""
    server, api_key = served
    known = json.loads((WEIGHTS / "rtvideo.json").read_text())["demo"]["prompts"]
    page = browser.new_page()
    page.goto(server.http + "/")
    if api_key:
        page.wait_for_load_state("networkidle")  # its first ask was refused (401): nothing to suggest yet
        assert page.eval_on_selector_all("#known-prompts option", "o => o.length") == 0
        page.fill("#key", api_key)
        page.dispatch_event("#key", "change")
    page.wait_for_function(f"document.querySelectorAll('#known-prompts option').length === {len(known)}")
    assert page.eval_on_selector_all("#known-prompts option", "os => os.map((o) => o.value)") == known
    for box in ("#prompt", "#update"):
        assert page.get_attribute(box, "list") == "known-prompts"
    assert page.input_value("#prompt") == known[0]


def test_the_start_prompt_stays_when_the_model_knows_no_prompts(browser, stub_server):
    server = stub_server
    page = browser.new_page()
    with page.expect_response(lambda response: response.url.endswith("/v1/models")) as models:
        page.goto(server.http + "/")
    assert models.value.json()["data"][0]["prompts"] == []
    assert page.eval_on_selector_all("#known-prompts option", "o => o.length") == 0
    assert page.input_value("#prompt") == "a paper boat drifting down a rainy street"
