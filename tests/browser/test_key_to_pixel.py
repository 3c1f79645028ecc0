"""A new prompt is seen soon after Send, and the page says how soon, in Chromium
against a real server.

The page's playback buffer (``LeadPolicy`` in ``rtvideo/server/static/index.html``) asks
the server to run half a second ahead of the picture, grows that lead after a
stall and reports its playhead ahead by what it grew by; key to pixel is Send
to the first frame of the chunk the prompt applied at, on screen. The policy's
Python mirror (``rtvideo/bench/playback.py``, which ``rtvideo bench realtime`` uses)
takes the same decisions on the same events. Every message the page sends is
recorded in the page (``window.sent``); the tests wait on conditions in the
page, never on time. A screenshot per state goes to ``test-artifacts/``."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rtvideo.bench import playback
from rtvideo.bench.playback import LeadPolicy
from tests.browser.conftest import ARTIFACTS, needs_browser
from tests.browser.test_page_states import SLOW, wait_state
from tests.e2e.conftest import start_server, stop_server

pytestmark = needs_browser

PAGE = Path(__file__).resolve().parents[2] / "rtvideo" / "server" / "static" / "index.html"
RECORD_SENT = """
window.sent = [];
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) {
  if (typeof data === "string") window.sent.push(JSON.parse(data));
  return send.call(this, data);
};
"""


def snapshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"page-{name}.png"), full_page=True)  # the stats below the video too


def recording_page(browser, server):
    page = browser.new_page()
    page.add_init_script(RECORD_SENT)
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(f"page error: {error}"))
    page.goto(server.http + "/")
    return page


def test_the_page_and_the_bench_take_the_same_buffer_decisions(browser):
    """The same 400 events (a stall, some playback, a report), seeded, through the
    page's LeadPolicy in Chromium and rtvideo/bench/playback.py's: the same lead and the
    same reported playhead after every one, to the bit."""
    rng = random.Random(7)
    events = []
    for _ in range(400):
        kind = rng.choices(["underrun", "played", "reported"], weights=[1, 6, 3])[0]
        events.append([kind, 0.0 if kind == "underrun" else round(rng.uniform(0.0, 6.0), 3)])
    page = browser.new_page()
    page.set_content(PAGE.read_text())
    in_page = page.evaluate(
        """(events) => {
          const policy = new LeadPolicy();
          return events.map(([kind, value]) => {
            let reported = null;
            if (kind === "reported") reported = policy.reported(value);
            else if (kind === "underrun") policy.underrun();
            else policy.played(value);
            return [policy.leadS, policy.underruns, reported];
          });
        }""",
        events,
    )
    policy, mirrored = LeadPolicy(), []
    for kind, value in events:
        reported = None
        if kind == "reported":
            reported = policy.reported(value)
        elif kind == "underrun":
            policy.underrun()
        else:
            policy.played(value)
        mirrored.append([policy.lead_s, policy.underruns, reported])
    assert in_page == mirrored
    leads = {lead for lead, _, _ in mirrored}
    assert min(leads) == playback.START_S and max(leads) == playback.MAX_S and len(leads) > 4  # grew and shrank


def test_a_new_prompt_shows_about_a_chunk_after_send_and_the_page_says_how_long(browser, demo_server):
    """On the default model: the session asks for a lead of half a second and reports
    its playhead as it is; a prompt sent shows at the chunk it applied at, and the
    key-to-pixel figure is the time from Send until the picture reached that chunk's
    first frame (no more than a frame or two off; later only if playback stalled)."""
    page = recording_page(browser, demo_server)
    page.wait_for_function("document.querySelectorAll('#known-prompts option').length > 0")
    page.click("#start")
    wait_state(page, "playing")
    [start] = page.evaluate("window.sent.filter((m) => m.type === 'session.start')")
    assert start["max_lead_seconds"] == playback.START_S
    page.wait_for_function("window.sent.some((m) => m.type === 'session.playback')")
    page.wait_for_function("video.currentTime > 1.0", timeout=30_000)

    before, reports = page.evaluate(
        """() => {
          document.getElementById("update").value = "a blue square moving left";
          const at = [video.currentTime, current.lead.underruns, current.lead.leadS];
          document.getElementById("send").click();
          return [at, window.sent.filter((m) => m.type === "session.playback").map((m) => m.position_seconds)];
        }"""
    )
    position, stalls, lead = before
    assert reports and reports[-1] <= position + (lead - playback.START_S) + 1e-9  # a tick ago, plus what it grew by
    page.wait_for_function("document.getElementById('k2p').textContent.endsWith(' ms')", timeout=30_000)
    k2p = int(page.text_content("#k2p").removesuffix(" ms"))
    chunk, seconds = re.fullmatch(r"chunk (\d+), (\d+\.\d\d) s", page.text_content("#landed")).groups()
    ahead_ms = (float(seconds) - position) * 1000  # media between the picture at Send and the applied chunk
    assert 0 < ahead_ms and k2p >= ahead_ms - 60, (k2p, ahead_ms)
    if page.evaluate("current.lead.underruns") == stalls:  # played through: the picture got there in real time
        assert k2p <= ahead_ms + 120, (k2p, ahead_ms)
    assert page.text_content("#k2p-median") == f"median {k2p} ms of 1"
    assert re.fullmatch(r"aiming \d\.\d\d s · \d+ stalls?", page.text_content("#aim"))
    assert f'on screen "a blue square moving left" {k2p} ms after Send' in page.text_content("#log")
    page.wait_for_function(f"video.currentTime > {float(seconds) + 0.1}")
    snapshot(page, "key-to-pixel")
    page.click("#stop")
    wait_state(page, "stopped")
    assert page.problems == []


def test_stalls_grow_the_lead_the_playhead_is_reported_ahead_by_as_much_and_the_session_goes_on(browser):
    """A model slower than real time (1.6 s a chunk of 0.75 s): playback runs dry
    after every chunk, the page counts each underrun, grows its lead by a step and
    reports its playhead that much ahead of the picture, so the server runs
    further ahead. Past two stalls (the lead grown by as much as it started at)
    chunks still come: reported behind instead, the server held the session for
    good once the picture caught up."""
    server = start_server(pipeline=SLOW)
    try:
        page = recording_page(browser, server)
        page.click("#start")
        wait_state(page, "playing")
        wait_state(page, "buffering")  # ran dry
        page.wait_for_function(f"current.lead.leadS >= {playback.START_S + playback.STEP_S}")
        assert "playback ran dry: the lead grows to 0.75 s" in page.text_content("#log")
        page.wait_for_function("document.getElementById('aim').textContent.startsWith('aiming 0.75 s · 1 stall')")
        snapshot(page, "lead-grown")
        page.wait_for_function("current.lead.underruns >= 2", timeout=30_000)
        chunks = int(page.text_content("#chunks"))
        page.wait_for_function(f"current.chunks.length >= {chunks + 2}", timeout=30_000)  # not held
        page.wait_for_function(
            "window.sent.some((m) => m.type === 'session.playback' && m.position_seconds - video.currentTime > 0.2)"
        )
        lead, position, reported = page.evaluate(
            """() => [current.lead.leadS, video.currentTime,
                      window.sent.filter((m) => m.type === "session.playback").pop().position_seconds]"""
        )
        assert reported <= position + (lead - playback.START_S) + 1e-9, (lead, position, reported)
        page.click("#stop")
        wait_state(page, "stopped")
        assert page.problems == []
    finally:
        stop_server(server)


def test_start_behind_an_api_key_plays_what_the_prompt_box_shows(browser):
    """The default model behind an API key: until the key is typed the prompt box
    shows no prompt the model does not know (it says why it is empty); the key
    typed and Start pressed at once, the model's prompts arrive as Start is pressed
    and Start waits for them, so the session plays the prompt the box shows."""
    key = "k2p-key"
    server = start_server("--api-key", key, model="demo")
    try:
        page = recording_page(browser, server)
        page.wait_for_load_state("networkidle")
        assert page.input_value("#prompt") == ""
        assert "API key" in page.get_attribute("#prompt", "placeholder")
        snapshot(page, "needs-key")
        page.fill("#key", key)  # no change event yet: it comes as Start takes the focus
        page.click("#start")
        wait_state(page, "playing")
        shown = page.input_value("#prompt")
        known = json.loads(
            page.evaluate("JSON.stringify([...document.querySelectorAll('#known-prompts option')].map((o) => o.value))")
        )
        assert shown == known[0] == "a red circle moving right"
        [start] = page.evaluate("window.sent.filter((m) => m.type === 'session.start')")
        assert start["prompt"] == shown
        assert page.text_content("#onscreen").startswith(f"“{shown}”")
        snapshot(page, "keyed-start")
        page.click("#stop")
        wait_state(page, "stopped")
        assert page.problems == []
    finally:
        stop_server(server)
