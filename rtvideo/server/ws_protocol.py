"""The WebSocket protocol ``rtvideo serve`` runs: uvicorn's, plus closing now
and media written once for every viewer.

API process. uvicorn's WebSocket protocol (websockets, sans-I/O) writes every
frame, the close frame included, only once the socket's write buffer has
drained below its low-water mark. For a client that stopped reading that is
never, so an ASGI application cannot close such a client: ``websocket.close``
waits forever, and so does the connection's memory.

``RealtimeWebSocketProtocol`` adds two ASGI extensions to the scope of every
accepted WebSocket. The first, ``scope["extensions"]["rtvideo.close_now"]["close_now"]``:
a call ``close_now(code, reason, grace_s)`` queues the close frame behind
whatever the client has not read yet, without waiting for the buffer to
drain, tells the application the connection is gone (``websocket.disconnect``
with that code), and aborts the TCP connection after ``grace_s`` unless the
client has completed the closing handshake by then (it read everything, the
close frame last, and answered it). So a client that resumes reading within
the grace learns the code and the reason; one that does not is cut off, and
what the server buffered for it is freed.

The second, ``scope["extensions"]["rtvideo.send_media"]["send_media"]``:
``await send_media(text, parts)`` writes a chunk's ``video.chunk_metadata``
text message and its binary message (the concatenation of ``parts``) back to
back, once the socket's write buffer is below its high-water mark (as every
uvicorn send waits). The frames are built here, not by the connection's
websockets state: a few header bytes, and the payload's parts written to the
transport as they are, never copied or compressed by the server. A session's
chunk is one ``bytes`` object shared by all of its viewers, so a viewer costs
a write, not an encoding: through uvicorn's own send, every connection that
negotiated permessage-deflate (browsers and the ``websockets`` client do)
would compress its own copy of every chunk, ~70 ms of the event loop per
256x256 raw chunk and viewer. A message sent uncompressed (RSV1 clear) is
valid on a connection that negotiated permessage-deflate (RFC 7692, section
6), and leaves the compression context of the connection's other messages
alone; media are compressed already, or raw.

The third, ``scope["extensions"]["rtvideo.close_answered"]["answered"]``: a
future that says how the connection ended: True once the client answered the
server's close frame (it read everything before it, the close last) or
closed first with a close frame of its own; False when the connection was
lost without one (the client dropped, or never answered within uvicorn's
close timeout). That is how the server knows whether a session's end reached
its controller, or is still owed to a resume.

Two more departures from uvicorn's protocol: a text message that is not
UTF-8 closes the connection 1007 with a reason saying so, in one log line
(uvicorn logs an error with a traceback for each, and gives no reason); and a
message for a connection whose transport is closing or lost is refused at
once (``ClientDisconnected``), not written to the dead transport.

``rtvideo.server.realtime`` uses them when present and falls back to uvicorn's
ordinary close and sends under another server (which then may wait on the
client, and frames each viewer's media itself).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Opcode
from websockets.protocol import State

log = logging.getLogger(__name__)

CLOSE_INVALID_DATA = 1007  # RFC 6455: a message whose data is not what its type says (text not UTF-8)
EXTENSION = "rtvideo.close_now"
SEND_MEDIA = "rtvideo.send_media"
CLOSE_ANSWERED = "rtvideo.close_answered"


def frame_header(opcode: Opcode, length: int) -> bytes:
    """The header of one final, unmasked, uncompressed WebSocket frame of
    ``length`` payload bytes (RFC 6455, section 5.2): what a server sends."""
    first = 0x80 | opcode  # FIN, RSV1-3 clear
    if length < 126:
        return struct.pack("!BB", first, length)
    if length < 1 << 16:
        return struct.pack("!BBH", first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


class RealtimeWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args, **kwargs) -> None:
        """uvicorn's protocol, without websockets' per-frame debug lines: at
        ``--log-level debug`` they would write every event a client sends or gets
        (a session's tokens included) and every chunk into the log."""
        super().__init__(*args, **kwargs)
        self.conn.debug = False
        self.close_answered = self.loop.create_future()  # CLOSE_ANSWERED: see the module's docstring

    def _answered(self, answered: bool) -> None:
        if not self.close_answered.done():
            self.close_answered.set_result(answered)

    def handle_close(self, event) -> None:
        """A close frame from the client: the answer to the server's, or its own."""
        self._answered(True)
        super().handle_close(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._answered(False)  # a no-op when a close frame came first
        super().connection_lost(exc)

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

    def send_receive_event_to_app(self) -> None:
        """As uvicorn's, but a text message that is not UTF-8 closes the connection
        with 1007 and a reason saying so, logged in one line: uvicorn closes it
        with no reason and logs an error with a traceback, one for every such
        message any client sends."""
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError as error:
                self.frames = []
                log.info("websocket %s: a text message that is not UTF-8 (%s): closed 1007", self.client, error.reason)
                self.conn.send_close(CLOSE_INVALID_DATA, "a text message that is not valid UTF-8")
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    def handle_connect(self, event) -> None:
        super().handle_connect(event)
        # The application task was created above but has not run yet: the scope it
        # will read still takes the extension. A refused handshake has no scope use.
        if not self.close_sent and hasattr(self, "scope"):
            self.scope["extensions"][EXTENSION] = {"close_now": self.close_now}
            self.scope["extensions"][SEND_MEDIA] = {"send_media": self.send_media}
            self.scope["extensions"][CLOSE_ANSWERED] = {"answered": self.close_answered}

    async def send(self, message) -> None:
        """As uvicorn's, but a message for a connection whose transport is closing
        or lost raises ``ClientDisconnected`` at once: uvicorn learns of a reset
        only a loop turn later, and meanwhile wrote each queued event to the dead
        transport, which logs a warning for every write past its fifth."""
        await self.writable.wait()
        if message["type"] == "websocket.send" and self.transport.is_closing():
            raise ClientDisconnected()
        await super().send(message)

    async def send_media(self, text: bytes, parts: Sequence[bytes]) -> None:
        """Write the text message ``text`` (UTF-8) and the binary message of
        ``parts`` back to back, once the write buffer is below its high-water
        mark. ``ClientDisconnected`` once the connection is closing or gone."""
        await self.writable.wait()
        if self.disconnected or self.close_sent or self.transport.is_closing() or self.conn.state is not State.OPEN:
            raise ClientDisconnected()
        size = sum(len(part) for part in parts)
        self.transport.write(frame_header(Opcode.TEXT, len(text)) + text + frame_header(Opcode.BINARY, size))
        for part in parts:
            if part:
                self.transport.write(memoryview(part))  # a view: what the socket does not take at once is copied once

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
