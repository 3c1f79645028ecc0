"""A chunk is made once for all of a session's viewers: encoded once per
format (``Rendition``, the session's ``SessionOutput``), and written to every
connection as the same bytes, framed by ``rtvideo.send_media``
(``rtvideo.server.ws_protocol``) without a copy or a compression per viewer; and a
spectator that falls behind is dropped, never held for."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import PerMessageDeflate
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from rtvideo.server.metrics import Metrics
from rtvideo.server.realtime import END, RealtimeConnection
from rtvideo.server.rendition import Rendition
from rtvideo.server.resume_buffer import BufferedChunk
from rtvideo.server.settings import ServerSettings
from rtvideo.server.ws_protocol import SEND_MEDIA, ClientDisconnected, RealtimeWebSocketProtocol

# -- the frames send_media writes -------------------------------------------------------


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes | memoryview] = []
        self.closing = False

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing


class Protocol:
    """What ``send_media`` reads of its protocol: the real method runs on it."""

    def __init__(self, deflate: bool = True) -> None:
        self.writable = asyncio.Event()
        self.writable.set()
        self.disconnected = self.close_sent = False
        self.transport = Transport()
        self.conn = ServerProtocol(state=State.OPEN)
        if deflate:  # as negotiated with a browser or the websockets client
            self.conn.extensions = [PerMessageDeflate(False, False, 12, 12)]

    async def send_media(self, text: bytes, parts) -> None:
        await RealtimeWebSocketProtocol.send_media(self, text, parts)

    def send_text(self, text: str) -> None:
        """uvicorn's own send, compressed when deflate was negotiated."""
        self.conn.send_text(text.encode())
        self.transport.writes.append(b"".join(self.conn.data_to_send()))


def client_reads(transport: Transport) -> list[Frame]:
    client = ClientProtocol(parse_uri("ws://server/v1/realtime/video"), state=State.OPEN, max_size=None)
    client.extensions = [PerMessageDeflate(False, False, 12, 12)]
    client.receive_data(b"".join(bytes(w) for w in transport.writes))
    return [event for event in client.events_received() if isinstance(event, Frame)]


@pytest.mark.parametrize("size", [0, 100, 1000, 70_000])  # each header length: 7, 16 and 64 bits
async def test_media_frames_read_as_a_text_and_a_binary_message_between_compressed_ones(size):
    protocol = Protocol()
    init, fragment = b"INIT" * 10, np.random.default_rng(size).bytes(size)
    metadata = json.dumps({"type": "video.chunk_metadata", "pad": "x" * size}).encode()
    protocol.send_text("before")  # compressed, as its neighbours are
    await protocol.send_media(metadata, (init, fragment))
    await protocol.send_media(b"{}", (fragment,))
    protocol.send_text("after")
    frames = client_reads(protocol.transport)
    assert [(f.opcode, bytes(f.data)) for f in frames] == [
        (Opcode.TEXT, b"before"),
        (Opcode.TEXT, metadata),
        (Opcode.BINARY, init + fragment),
        (Opcode.TEXT, b"{}"),
        (Opcode.BINARY, fragment),
        (Opcode.TEXT, b"after"),
    ]
    assert protocol.transport.writes[0][0] & 0x40  # uvicorn's own text: compressed (RSV1)
    assert not protocol.transport.writes[1][0] & 0x40  # the media: not


async def test_media_are_written_as_the_callers_bytes_not_a_copy():
    protocol = Protocol()
    fragment = b"f" * 100_000
    await protocol.send_media(b"{}", (fragment,))
    _, payload = protocol.transport.writes
    assert isinstance(payload, memoryview) and payload.obj is fragment


async def test_send_media_waits_for_the_write_buffer_and_refuses_a_closing_connection():
    protocol = Protocol()
    protocol.writable.clear()  # over the high-water mark
    sending = asyncio.create_task(protocol.send_media(b"{}", (b"x",)))
    await asyncio.sleep(0)
    assert not sending.done() and protocol.transport.writes == []
    protocol.writable.set()
    await sending
    assert len(protocol.transport.writes) == 2
    protocol.close_sent = True
    with pytest.raises(ClientDisconnected):
        await protocol.send_media(b"{}", (b"x",))


# -- one encoding and one payload for every viewer ----------------------------------------


class Viewer:
    def __init__(self) -> None:
        self.chunks: list[BufferedChunk] = []

    def send_chunk(self, chunk: BufferedChunk) -> None:
        self.chunks.append(chunk)

    def send_event(self, event) -> None:
        pass

    def session_ended(self, code, reason) -> None:
        pass


async def test_each_chunk_of_a_rendition_is_encoded_once_for_all_of_its_viewers():
    viewers = [Viewer() for _ in range(16)]
    made = Rendition("jpeg", 32, 32, 16.0, lambda: viewers, print)
    calls = []
    encode = made._encoder.encode  # the real encoder, counted

    def counted(frames, first_frame_index):
        calls.append(first_frame_index)
        return encode(frames, first_frame_index)

    made._encoder.encode = counted
    rng = np.random.default_rng(0)
    for i in range(5):
        frames = rng.integers(0, 255, (4, 32, 32, 3), dtype=np.uint8)
        meta = {"num_frames": 4, "first_frame_index": 4 * i, "media_start_seconds": i / 4}
        made.offer(i, meta, frames, 0.01)
    while len(viewers[-1].chunks) < 5:
        await asyncio.sleep(0.005)
    assert calls == [0, 4, 8, 12, 16]  # once per chunk, not once per viewer
    for i in range(5):
        assert len({id(v.chunks[i]) for v in viewers}) == 1  # the same object for each of them
    made.close()


class Socket:
    """The parts of a Starlette WebSocket the writer uses, with uvicorn's ``send_media``."""

    def __init__(self, stalled: bool = False) -> None:
        self.sent: list[tuple[bytes, tuple]] = []
        self.stalled = asyncio.Event() if stalled else None
        self.scope = {"extensions": {SEND_MEDIA: {"send_media": self.send_media}}}

    async def send_media(self, text: bytes, parts) -> None:
        if self.stalled is not None:
            await self.stalled.wait()  # a client that never reads
        self.sent.append((text, parts))


def connection(socket: Socket, role: str, **settings) -> RealtimeConnection:
    conn = RealtimeConnection(socket, None, ServerSettings(**settings), "stub", Metrics(lambda: True), None)
    conn.role = role
    return conn


def chunk(index: int, size: int = 1000, init: bytes = b"") -> BufferedChunk:
    metadata = {"generation_chunk_index": index, "num_frames": 4, "media_start_seconds": index / 4}
    return BufferedChunk(index, metadata, bytes([index % 256]) * size, init, 0.01, 16.0)


async def test_every_connection_writes_the_same_payload_object_once_per_chunk():
    sockets = [Socket() for _ in range(8)]
    connections = [connection(s, "spectator" if i else "controller") for i, s in enumerate(sockets)]
    chunks = [chunk(i, init=b"INIT") for i in range(3)]
    for made in chunks:
        for conn in connections:
            conn.send_chunk(made)
    for conn in connections:
        conn.outbox.put_nowait(END)
        await conn._write_all()
    for socket in sockets:
        parts = [p for _, p in socket.sent]
        assert parts[0][0] is chunks[0].init and parts[0][1] is chunks[0].fragment  # the first behind the init
        assert [p for (p,) in parts[1:]] == [c.fragment for c in chunks[1:]]
        assert all(p is c.fragment for (p,), c in zip(parts[1:], chunks[1:], strict=True))
        metadata = [json.loads(t) for t, _ in socket.sent]
        assert [m["transport_chunk_index"] for m in metadata] == [0, 1, 2]
        assert [m["byte_length"] for m in metadata] == [1004, 1000, 1000]


async def test_a_spectator_with_more_media_waiting_than_a_controller_may_lag_is_dropped():
    """The client reads nothing: one chunk waits in the write, the rest in the
    outbox. Past max_undelivered_seconds (1 s: four 0.25 s chunks) of them the
    spectator is closed as slow, long before its bytes would be; a controller
    in its place is held by pacing instead, and only its byte limit closes it."""
    spectator = connection(Socket(stalled=True), "spectator", max_undelivered_seconds=1.0)
    controller = connection(Socket(stalled=True), "controller", max_undelivered_seconds=1.0)
    for conn in (spectator, controller):
        conn._writer = asyncio.create_task(conn._write_all())
        await asyncio.sleep(0)
    for i in range(4):
        for conn in (spectator, controller):
            conn.send_chunk(chunk(i))
        await asyncio.sleep(0)
    assert spectator.slow is None  # 1 s of media: not past it
    for conn in (spectator, controller):
        conn.send_chunk(chunk(4))
    assert spectator.slow == "1.2 s of media wait for this spectator, past max_undelivered_seconds (1)"
    assert spectator.outbox.empty() and spectator.backlog == 0  # what waited for it is let go
    assert controller.slow is None and controller.backlog_s == pytest.approx(1.25)
    await asyncio.sleep(0)
    assert spectator._writer.cancelled()
    controller._writer.cancel()
