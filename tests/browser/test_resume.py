"""A dropped socket does not end the page's session, in Chromium against a real
server: the page resumes it (``session.resume``), says so while it does, and
playback goes on with every chunk once, in order; a server that is gone for
good ends in "Connection lost" once the page has tried for ``RESUME.forS``.

The drop is real: the page talks to the server through a TCP relay of the
test's (``Relay``), which cuts every connection at once (no close frame: 1006
on both sides) and refuses new ones for a while, as a network that went away
and came back."""

from __future__ import annotations

import re
import socket
import threading
import time
from types import SimpleNamespace

from tests.browser.conftest import needs_browser
from tests.browser.test_page_states import FAST, in_order, open_page, shown, wait_state
from tests.e2e.conftest import start_server, stop_server

pytestmark = needs_browser


class Relay:
    """A TCP relay from a port of its own to ``target`` (host, port): each
    connection accepted is piped both ways by two threads. ``cut(down_s)``
    closes every connection at once and, for ``down_s`` seconds, closes each
    new one as soon as it is accepted."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.down_until = 0.0
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                self.accepted += 1
                if time.monotonic() < self.down_until:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self.open += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self, down_s: float) -> None:
        with self.lock:
            self.down_until = time.monotonic() + down_s
            for connection in self.open:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                connection.close()
            self.open.clear()

    def close(self) -> None:
        self.listener.close()
        self.cut(0.0)


def chunk_indexes(page) -> list[int]:
    return page.evaluate("current.chunks.map((c) => c.index)")


def test_a_dropped_socket_is_resumed_and_playback_goes_on_with_every_chunk_once(browser):
    server = start_server(pipeline=FAST)
    host, port = server.http.removeprefix("http://").split(":")
    relay = Relay((host, int(port)))
    try:
        page = open_page(browser, SimpleNamespace(http=relay.url))
        page.fill("#prompt", "a lighthouse in a storm")
        page.click("#start")
        wait_state(page, "playing")
        page.wait_for_function("current.chunks.length >= 3")
        before = len(chunk_indexes(page))
        relay.cut(down_s=1.5)  # the network goes, and stays away through the first tries
        resuming = wait_state(page, "reconnecting")
        assert resuming["title"] == "Reconnecting…" and resuming["veil"] is None, resuming
        said = resuming["detail"]
        assert re.match(r"The connection dropped after \d+ chunks: resuming the session \(try \d+, ", said), said
        assert resuming["stop"] and not resuming["start"]
        wait_state(page, "playing", timeout=30_000)
        page.wait_for_function(f"current.chunks.length >= {before + 4}")
        indexes = chunk_indexes(page)
        assert indexes == list(range(len(indexes))), indexes  # none lost, none twice, in order
        log = page.text_content("#log")
        assert "connection lost (WebSocket close 1006): resuming the session" in log, log
        assert re.search(r"resumed the session after \d+\.\d s \(try [2-9]\d*\), from chunk \d+", log), log
        assert relay.accepted >= 3  # the first socket, a refused try or more, the one that resumed
        assert page.evaluate("video.error") is None
        assert in_order(shown(page), ["playing", "reconnecting", "playing"]), shown(page)

        page.click("#stop")
        stopped = wait_state(page, "stopped")
        assert re.fullmatch(r"Stopped after \d+ chunks, \d+ frames \(\d+\.\d\d s\)\. Start begins a new session\.",
                            stopped["detail"]), stopped  # fmt: skip
        # The download is one MP4: one init segment, however many sockets brought it.
        page.wait_for_selector("#download:not([hidden])")
        inits = page.evaluate(
            """async () => {
              const bytes = new Uint8Array(await (await fetch(document.getElementById("download").href)).arrayBuffer());
              let count = 0;
              for (let at = 0; at + 8 <= bytes.length; ) {
                const size = new DataView(bytes.buffer).getUint32(at);
                if (String.fromCharCode(...bytes.subarray(at + 4, at + 8)) === "moov") count += 1;
                if (size < 8) break;
                at += size;
              }
              return count;
            }"""
        )
        assert inits == 1
        assert page.problems == []
    finally:
        relay.close()
        stop_server(server)
