"""The WebSocket protocol ``rtvideo serve`` runs: uvicorn's, plus closing now.

API process. uvicorn's WebSocket protocol (websockets, sans-I/O) writes every
frame, the close frame included, only once the socket's write buffer has
drained below its low-water mark. For a client that stopped reading that is
never, so an ASGI application cannot close such a client: ``websocket.close``
waits forever, and so does the connection's memory.

``RealtimeWebSocketProtocol`` adds one ASGI extension to the scope of every
accepted WebSocket, ``scope["extensions"]["rtvideo.close_now"]["close_now"]``:
a call ``close_now(code, reason, grace_s)`` queues the close frame behind
whatever the client has not read yet, without waiting for the buffer to
drain, tells the application the connection is gone (``websocket.disconnect``
with that code), and aborts the TCP connection after ``grace_s`` unless the
client has completed the closing handshake by then (it read everything, the
close frame last, and answered it). So a client that resumes reading within
the grace learns the code and the reason; one that does not is cut off, and
what the server buffered for it is freed.

``server.realtime`` uses it when present and falls back to an ordinary close
under another server (which then may wait on the client).
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

EXTENSION = "rtvideo.close_now"


class RealtimeWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args, **kwargs) -> None:
        """uvicorn's protocol, without websockets' per-frame debug lines: at
        ``--log-level debug`` they would write every event a client sends or gets
        (a session's tokens included) and every chunk into the log."""
        super().__init__(*args, **kwargs)
        self.conn.debug = False

    def data_received(self, data: bytes) -> None:
        """As uvicorn's, and a handshake that websockets refuses while parsing it
        (a request line or header over its own 8 KiB: 414 / 431) is answered and
        closed: uvicorn leaves that answer queued, never written, and the socket
        held for ever."""
        super().data_received(data)
        if self.conn.handshake_exc is not None and not self.close_sent and not self.transport.is_closing():
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.handshake_complete = self.close_sent = True
            self.transport.close()

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        # The application task was created above but has not run yet: the scope it
        # will read still takes the extension. A refused handshake has no scope use.
        if not self.close_sent and hasattr(self, "scope"):
            self.scope["extensions"][EXTENSION] = {"close_now": self.close_now}

    def close_now(self, code: int, reason: str, grace_s: float) -> None:
        """Queue the close frame behind the unread data and abort after ``grace_s``;
        a no-op once a close was sent or the connection is gone."""
        if self.close_sent or self.transport.is_closing():
            return
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.conn.send_close(code, reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        if self.read_paused:  # read the client's answer to the close
            self.read_paused = False
            self.transport.resume_reading()
        # handle_close cancels this when the client answers; run_asgi leaves the
        # transport to it once the application returns.
        self.close_timer = self.loop.call_later(grace_s, self.transport.abort)
