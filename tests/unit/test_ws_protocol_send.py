"""``RealtimeWebSocketProtocol.send``: a message for a connection whose transport
is closing or lost is refused at once (``ClientDisconnected``), not written to
the dead transport (asyncio logs a warning for every such write past its fifth,
which a dropped client with events queued for it turned into dozens of lines).
The real protocol class, its transport a stand-in."""

from __future__ import annotations

import uvicorn
from uvicorn.server import ServerState
from websockets.protocol import State

from rtvideo.server.ws_protocol import ClientDisconnected, RealtimeWebSocketProtocol


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def open_connection() -> tuple[RealtimeWebSocketProtocol, Transport]:
    config = uvicorn.Config(app=lambda scope, receive, send: None, ws=RealtimeWebSocketProtocol)
    config.load()
    protocol = RealtimeWebSocketProtocol(config, ServerState(), {})
    transport = Transport()
    protocol.connection_made(transport)
    protocol.handshake_complete = True  # past the handshake: an open connection
    protocol.conn.state = State.OPEN
    return protocol, transport


async def test_a_message_for_a_lost_transport_is_refused_not_written():
    protocol, transport = open_connection()
    await protocol.send({"type": "websocket.send", "text": "an event"})
    assert len(transport.writes) == 1
    transport.closing = True  # reset by the peer: uvicorn hears of it a loop turn later
    for _ in range(10):
        try:
            await protocol.send({"type": "websocket.send", "text": "a queued event"})
        except ClientDisconnected:
            continue
        raise AssertionError("written to a transport that is closing")
    assert len(transport.writes) == 1
