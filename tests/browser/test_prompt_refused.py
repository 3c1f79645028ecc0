"""The page on a server with a prompt policy (headless Chromium): a prompt the
policy refuses mid-session is said where prompts land ("not taken:
prompt_refused") with the server's reason in the log, and the session plays on
and takes the next prompt; a start with a refused prompt ends in words,
naming the reason."""

from __future__ import annotations

import json

import pytest

from tests.browser.conftest import needs_browser
from tests.browser.test_page_states import FAST, open_page, status, wait_state
from tests.e2e.conftest import start_server, stop_server

pytestmark = needs_browser
REASON = "storms are not served here"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"deny": [r"\bstorms?\b"], "reason": REASON}))
    running = start_server("--prompt-policy", str(policy), pipeline=FAST)
    yield running
    stop_server(running)


def test_a_refused_prompt_is_said_where_prompts_land_and_the_session_plays_on(browser, server):
    page = open_page(browser, server)
    page.fill("#prompt", "a lighthouse")
    page.click("#start")
    wait_state(page, "playing")
    page.fill("#update", "a storm at sea")
    page.click("#send")
    page.wait_for_function("document.getElementById('landed').textContent === 'not taken: prompt_refused'")
    assert f"error prompt_refused: interaction.event.prompt: refused by this server's prompt policy: {REASON}" in (
        page.text_content("#log")
    )
    assert status(page)["state"] in ("playing", "buffering")  # the session goes on
    page.fill("#update", "a calm sea")
    page.click("#send")
    page.wait_for_function("document.getElementById('landed').textContent.startsWith('chunk')")
    page.click("#stop")
    wait_state(page, "stopped")
    assert page.problems == []


def test_a_start_with_a_refused_prompt_ends_in_words(browser, server):
    page = open_page(browser, server)
    page.fill("#prompt", "storms")
    page.click("#start")
    ended = wait_state(page, "error")
    assert ended["title"] == "Refused" and ended["start"] and not ended["stop"], ended
    assert ended["detail"] == f"prompt: refused by this server's prompt policy: {REASON} (prompt_refused).", ended
