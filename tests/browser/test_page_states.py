"""The page says what it is doing, in Chromium against a real server: each state
of the status line (connecting, waiting for the first chunk, playing,
buffering, stopping, stopped, gone, draining) shows with its words, a new
Start clears the last session's numbers, the clock over the video matches
where a prompt landed, and nothing the page asks for is missing (favicon).

States are read from the page itself: a MutationObserver on ``#status``
records every ``data-state`` it shows, and the tests wait on conditions in
the page, never on time. The stub model runs slower than real time here
(4 steps of 0.4 s: 1.6 s a chunk of 0.75 s of media), so the first chunk
takes a while and playback starves between chunks, as under load."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from tests.browser.conftest import ARTIFACTS, needs_browser
from tests.e2e.conftest import start_server, stop_server
from tests.engine.test_lifecycle import wait_gone

pytestmark = needs_browser

SLOW = {"width": 64, "height": 64, "fps": 16.0, "first_chunk_frames": 9, "frames_per_chunk": 12, "step_time_s": 0.4}
FAST = {**SLOW, "step_time_s": 0.01}
RECORD_STATES = """() => {
  const status = document.getElementById("status");
  window.shownStates = [status.dataset.state];
  new MutationObserver((records) => {
    records.forEach((record, i) => {
      const next = i + 1 < records.length ? records[i + 1].oldValue : status.dataset.state;
      if (next !== window.shownStates[window.shownStates.length - 1]) window.shownStates.push(next);
    });
  }).observe(status, { attributes: true, attributeFilter: ["data-state"], attributeOldValue: true });
}"""


def open_page(browser, server):
    """A fresh page on the server's client, recording the states it shows and any
    page error or failed request."""
    page = browser.new_page()
    page.problems = []
    page.on("pageerror", lambda error: page.problems.append(f"page error: {error}"))
    page.on("response", lambda r: r.status >= 400 and page.problems.append(f"{r.status} {r.url}"))
    page.goto(server.http + "/")
    page.evaluate(RECORD_STATES)
    return page


def wait_state(page, state: str, timeout: float = 30_000) -> dict:
    page.wait_for_function(f"document.getElementById('status').dataset.state === {state!r}", timeout=timeout)
    return status(page)


def status(page) -> dict:
    return page.evaluate(
        """() => ({
          state: document.getElementById("status").dataset.state,
          title: document.getElementById("status-title").textContent,
          detail: document.getElementById("status-detail").textContent,
          veil: document.getElementById("veil").hidden ? null : document.getElementById("veil").textContent,
          paused: document.getElementById("video").paused,
          start: !document.getElementById("start").disabled,
          stop: !document.getElementById("stop").disabled,
        })"""
    )


def shown(page) -> list[str]:
    return page.evaluate("window.shownStates")


def in_order(states: list[str], expected: list[str]) -> bool:
    """``expected`` appears in ``states`` in this order (other states may come between)."""
    remaining = iter(states)
    return all(state in remaining for state in expected)


def snapshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"page-{name}.png"))


def test_a_session_shows_each_state_the_clock_and_a_clear_stop(browser):
    server = start_server(pipeline=SLOW)
    try:
        icon = httpx.get(f"{server.http}/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
        assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO file
        page = open_page(browser, server)
        assert page.evaluate("document.querySelector('link[rel=icon]').getAttribute('href')") == "/favicon.ico"
        assert status(page)["state"] == "idle" and status(page)["title"] == "Ready"

        page.fill("#prompt", "a lighthouse in a storm")
        page.click("#start")
        waiting = wait_state(page, "waiting")
        assert waiting["veil"] == "Waiting for the first chunk…" and "making the first chunk" in waiting["detail"]
        assert re.search(r"64x64 at 16 fps\): \d+\.\d s so far", waiting["detail"]), waiting
        snapshot(page, "waiting")
        playing = wait_state(page, "playing")
        assert playing["veil"] is None and playing["title"] == "Playing"
        buffering = wait_state(page, "buffering")  # the next chunk is not there yet: playback starved
        assert buffering["veil"] == "Buffering…" and "caught up with generation" in buffering["detail"]
        snapshot(page, "buffering")
        wait_state(page, "playing")
        assert shown(page)[:3] == ["idle", "connecting", "waiting"]
        assert in_order(shown(page), ["waiting", "playing", "buffering", "playing"]), shown(page)

        # Where a new prompt landed can be found on the picture: the clock says media time, frame and chunk.
        page.fill("#update", "a calm sunny sea")
        page.click("#send")
        page.wait_for_function("document.getElementById('landed').textContent.startsWith('chunk')")
        chunk, seconds = re.fullmatch(r"chunk (\d+), (\d+\.\d\d) s", page.text_content("#landed")).groups()
        page.wait_for_function("document.getElementById('onscreen').textContent.includes('a calm sunny sea')")
        page.click("#stop")
        stopped = wait_state(page, "stopped")
        clock, time_now = page.evaluate("[document.getElementById('clock').textContent, video.currentTime]")
        shown_s, frame, shown_chunk = re.fullmatch(r"(\d+\.\d\d) s · frame (\d+) · chunk (\d+)", clock).groups()
        made = int(re.search(r"(\d+) frames", stopped["detail"]).group(1))
        # playback may have run a little past the last frame's start (stopped while buffering): that frame is shown
        assert shown_s == f"{time_now:.2f}", (clock, time_now)
        assert int(frame) == min(int(time_now * 16 + 1e-6), made - 1), (clock, time_now, made)
        assert float(shown_s) >= float(seconds) and int(shown_chunk) >= int(chunk), (clock, seconds, chunk)
        assert page.text_content("#onscreen") == f"“a calm sunny sea” since {seconds} s"

        # Stopped looks stopped: words, a veil, a still picture, Start offered again.
        assert stopped["title"] == "Stopped" and stopped["veil"] == "■ Stopped" and stopped["paused"]
        assert re.fullmatch(r"Stopped after \d+ chunks, \d+ frames \(\d+\.\d\d s\)\. Start begins a new session\.",
                            stopped["detail"]), stopped  # fmt: skip
        assert stopped["start"] and not stopped["stop"]
        assert in_order(shown(page), ["playing", "stopping", "stopped"]), shown(page)
        page.wait_for_selector("#download:not([hidden])")
        assert status(page)["state"] == "stopped" and page.evaluate("video.currentTime") == time_now
        snapshot(page, "stopped")

        # A new Start clears the last session's numbers at once.
        stats = "['ttff', 'fps', 'lead', 'chunks', 'landed', 'log'].map((i) => document.getElementById(i).textContent)"
        before = page.evaluate(f"() => {stats}")
        assert before[0].endswith(" ms") and before[3] != "0" and before[4] != "–" and before[5], before
        after = page.evaluate(f"() => {{ document.getElementById('start').click(); return {stats}; }}")
        assert after == ["–", "–", "–", "0", "–", ""], after
        assert page.is_hidden("#download")
        wait_state(page, "waiting")
        assert page.text_content("#clock") == "0.00 s"
        page.click("#stop")
        wait_state(page, "stopped")
        assert page.problems == []
    finally:
        stop_server(server)


def test_a_server_that_goes_away_is_said_in_words(browser):
    server = start_server(pipeline=FAST)
    worker = server.health()["workers"][0]["pid"]
    try:
        page = open_page(browser, server)
        page.click("#start")
        wait_state(page, "playing")
        page.evaluate("RESUME.forS = 2")  # how long the page tries to resume a dropped session (10 s as shipped)
        server.process.kill()  # no close frame: the socket just drops (1006)
        wait_state(page, "reconnecting")
        lost = wait_state(page, "gone")
        assert lost["title"] == "Connection lost" and lost["veil"] == "Connection lost" and lost["paused"]
        assert re.fullmatch(
            r"The connection to the server was lost after \d+ chunks and the session could not be resumed within "
            r"2 s: the server stopped or the network dropped \(WebSocket close 1006\)\. Start tries again\.",
            lost["detail"],
        ), lost
        assert lost["start"] and not lost["stop"]
        snapshot(page, "gone")

        page.click("#start")  # nobody listens any more
        page.wait_for_function("document.getElementById('status-title').textContent === 'Server unreachable'")
        unreachable = status(page)
        assert unreachable["state"] == "gone" and unreachable["start"]
        host = server.http.removeprefix("http://")
        assert unreachable["detail"] == (
            f"Could not reach the server at {host}: it is not running, or the network is down. Start tries again."
        )
        assert in_order(shown(page), ["playing", "reconnecting", "gone", "connecting", "gone"]), shown(page)
    finally:
        stop_server(server)
    wait_gone(worker, within=10.0)


def test_a_draining_server_is_shown_while_the_session_runs_and_to_a_new_start(browser):
    server = start_server("--shutdown-grace-s", "60", pipeline=FAST)
    try:
        watching = open_page(browser, server)
        watching.click("#start")
        wait_state(watching, "playing")
        server.process.send_signal(signal.SIGTERM)
        draining = wait_state(watching, "draining")  # /health says so; the session goes on
        assert draining["title"] == "Server shutting down" and "takes no new sessions" in draining["detail"]
        assert not draining["paused"] and draining["stop"]
        snapshot(watching, "draining")

        late = open_page(browser, server)
        late.click("#start")
        refused = wait_state(late, "draining")
        assert refused["title"] == "Server shutting down" and refused["start"]
        assert refused["detail"] == "The server is shutting down and takes no new sessions. Try again once it is back."
        late.close()

        watching.click("#stop")  # the last session ends: the server exits
        wait_state(watching, "stopped")
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)


def test_a_session_the_server_ends_at_shutdown_says_so(browser):
    server = start_server("--shutdown-grace-s", "0.5", pipeline=FAST)
    try:
        page = open_page(browser, server)
        page.click("#start")
        wait_state(page, "playing")
        server.process.send_signal(signal.SIGTERM)
        page.wait_for_function("document.getElementById('status-title').textContent === 'Server shut down'")
        ended = status(page)
        assert ended["state"] == "draining" and ended["start"] and not ended["stop"]
        assert re.fullmatch(
            r"The server is shutting down and ended this session after \d+ chunks, \d+ frames "
            r"\(\d+\.\d\d s\)\. It takes no new sessions until it is back\.",
            ended["detail"],
        ), ended
        assert server.process.wait(timeout=30) == 0
    finally:
        stop_server(server)


@pytest.mark.parametrize("flags", [["--api-key", "k"]], ids=["no-key"])
def test_a_refused_start_says_why(browser, flags):
    server = start_server(*flags, pipeline=FAST)
    try:
        page = open_page(browser, server)
        page.click("#start")
        refused = wait_state(page, "error")
        assert refused["title"] == "API key needed" and "enter it in the API key field" in refused["detail"]
        assert refused["start"] and not refused["stop"]
    finally:
        stop_server(server)
