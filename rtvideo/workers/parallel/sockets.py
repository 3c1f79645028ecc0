"""Direct TCP connections between pipeline ranks: the plans, and on CPUs the ring.

Worker processes. ``RankSockets`` connects every rank to the ranks it sends
to (rank 0 to every follower, for the plans; each rank to the next one, for
the ring; the last rank to rank 0) and carries four kinds of frame on
them: a micro-step's plan (rank 0 to each follower: an encoded
``rtvideo.engine.messages.RankPlan``), a ring message (the same ``Message`` as
``RingLink``'s: its ``RingHeader`` naming rows, failures and tensor shapes,
then the tensors' bytes), a plan that carries rank 1's ring
message (rank 0 to rank 1: the rows rank 1 runs under that plan, in one
write) and a stop. A second set of
connections, rank 0 and each follower both ways, carries the decode stage's
requests, results and cancellations (``rtvideo.workers.parallel.rank_decode``), so
that traffic never stands in the ring's way: the thread that waits for a
ring message or a plan is the one that reads its connection.

Why not ``torch.distributed``'s point-to-point operations on a CPU: over
gloo, receiving a message that has already been sent costs 0.5-2.5 ms on
the 2-core development machine (a rendezvous through gloo's own threads,
which wait for a core the computing ranks hold), and a ZeroMQ send wakes an
I/O thread the same way; a micro-step of the demo model is about 10 ms, so
those waits were a quarter of it. Here the computing thread writes a frame
into the kernel's socket buffer itself (one copy, no other thread woken)
and the receiver, blocked in ``poll`` on an otherwise idle core, reads it.
``EngineConfig.pp_transport`` chooses: ``auto`` (these sockets on a CPU,
NCCL point-to-point on GPUs, whose tensors stay on the device), ``torch``
(``RingLink`` over gloo or NCCL: the plans still travel here).

``send`` is non-blocking in the same sense as ``RingLink.send``: the frame
goes into the kernel's buffer (the second buffer of the double buffering),
and what does not fit is written by a thread of the connection while the
caller computes; ``wait_sent`` waits for it. So two ranks sending each
other large messages never deadlock. Frames of one connection arrive in
order; ``recv`` matches by (peer, kind, tag) and keeps frames that arrive
before they are asked for, so the order a rank asks in does not have to be
the order they were sent in. Several threads may wait on one connection for
frames of different kinds: one of them reads at a time and hands the others
what it read for them. Every wait has the timeout (``LinkTimeout``);
a peer whose connection closes raises ``PeerClosed`` at once, naming it.
"""

from __future__ import annotations

import datetime
import math
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import torch

from rtvideo.engine.messages import DecodeCancel, Decoded, DecodeRequest, RingHeader
from rtvideo.engine.transport import encode_rank, rank_type_name
from rtvideo.workers.parallel.link import (
    BadMessage,
    LinkTimeout,
    Message,
    aligned,
    frame_header,
    tensor_dtype,
    tensor_specs,
)

_PREFIX = struct.Struct("<4sB3xqIQ")  # magic, kind, tag, header bytes, payload bytes
_MAGIC = b"RTV1"
_HELLO = struct.Struct("<4sII")  # magic, the sending rank, the channel: the first bytes of a connection
HELLO_TIMEOUT_S = 5.0  # how long an accepted connection may take to say which rank it is
PLAN, RING, STOP, DECODE, DECODED, CANCEL, PLAN_RING = 1, 2, 3, 4, 5, 6, 7
PIPELINE, DECODES = 0, 1  # the channels: plans and the ring; the decode stage's frames
CHANNEL = {
    PLAN: PIPELINE,
    RING: PIPELINE,
    STOP: PIPELINE,
    PLAN_RING: PIPELINE,
    DECODE: DECODES,
    DECODED: DECODES,
    CANCEL: DECODES,
}
HEADER = {RING: RingHeader, DECODE: DecodeRequest, DECODED: Decoded, CANCEL: DecodeCancel}
"""What the header of each kind of message frame is (``rtvideo.engine.messages``)."""
FRAME_NAME = {RING: "a ring message", DECODE: "a decode request", DECODED: "a decoded chunk", CANCEL: "a decode cancel"}
_CARRIED = struct.Struct("<Iq")  # a plan carrying a ring message: the plan's bytes, the ring message's tag
MAX_KEPT = {PIPELINE: 256, DECODES: 16384}
"""Frames a connection keeps for a later taker before it is broken as a
protocol error. On the pipeline channel a rank is at most a few micro-steps
ahead of another. On the decode channel, a follower's decode requests wait
there while its decode thread works (a cancel check reads the connection for
cancels, keeping the requests it passes); the engine holds a session with
``rtvideo.engine.pacing.max_chunks_decoding`` chunks out for decode (about 17), so
they number at most that many chunks a session, each a frame (a split chunk
one a latent frame, and one more): a few hundred for a few sessions."""


class PeerClosed(RuntimeError):
    """A peer rank's connection closed (the rank exited or died)."""


@dataclass
class _Frame:
    kind: int
    tag: int
    header: bytes
    payload: bytearray


def sends_to(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` writes to: the next rank of the ring (the last rank:
    rank 0), and, for rank 0, every follower (the plans)."""
    targets = {(rank + 1) % world}
    if rank == 0:
        targets.update(range(1, world))
    targets.discard(rank)
    return sorted(targets)


def receives_from(rank: int, world: int) -> list[int]:
    return [peer for peer in range(world) if rank in sends_to(peer, world)]


def decode_peers(rank: int, world: int) -> list[int]:
    """The ranks ``rank`` exchanges decode frames with, both ways: rank 0 with
    every follower."""
    return list(range(1, world)) if rank == 0 else [0]


def _links(rank: int, world: int, writing: bool) -> list[tuple[int, int]]:
    """(peer, channel) of every connection ``rank`` writes (or reads)."""
    ring = sends_to(rank, world) if writing else receives_from(rank, world)
    return [(peer, PIPELINE) for peer in ring] + [(peer, DECODES) for peer in decode_peers(rank, world)]


def advertised_host(store_host: str | None) -> str:
    """The address other ranks reach this one at: ``RTVIDEO_ADVERTISE_HOST``,
    else the local address of the route toward ``store_host`` (None: loopback)."""
    configured = os.environ.get("RTVIDEO_ADVERTISE_HOST")
    if configured:
        return configured
    if store_host in (None, "", "127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((store_host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


class _Outgoing:
    """One connection this rank writes to: frames go out in order, written by
    the caller while the kernel takes them, by the connection's thread after."""

    def __init__(self, sock: socket.socket, peer: int, timeout_s: float) -> None:
        self.sock, self.peer, self.timeout_s = sock, peer, timeout_s
        self._queue: deque[memoryview] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._write, name=f"rank-send-{peer}", daemon=True)
        self._thread.start()

    def post(self, data: memoryview) -> None:
        with self._cond:
            if self._error is not None:
                raise self._error
            if not self._queue:
                try:
                    data = data[self.sock.send(data, socket.MSG_DONTWAIT) :]
                except BlockingIOError:
                    pass
                except OSError as error:
                    raise self._closed_error(error) from error
                if not data:
                    return
            self._queue.append(data)
            self._cond.notify_all()

    def drain(self, deadline: float) -> None:
        with self._cond:
            while self._queue and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkTimeout(f"send to rank {self.peer} not done within {self.timeout_s:g} s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.sock.close()

    def _write(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                data = self._queue[0]
            try:
                if not poller.poll(self.timeout_s * 1000):
                    raise LinkTimeout(f"send to rank {self.peer} not done within {self.timeout_s:g} s")
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except (OSError, LinkTimeout) as error:
                with self._cond:
                    self._error = error if isinstance(error, LinkTimeout) else self._closed_error(error)
                    self._cond.notify_all()
                return
            with self._cond:
                if sent == len(data):
                    self._queue.popleft()
                else:
                    self._queue[0] = data[sent:]
                self._cond.notify_all()

    def _closed_error(self, error: OSError) -> PeerClosed:
        return PeerClosed(f"rank {self.peer} closed its connection ({error.strerror or error})")


class _Incoming:
    """One connection this rank reads: frames in the order they were sent, those
    not asked for yet kept aside. Threads that wait on it take turns to read:
    the reader keeps what is not its own and wakes the others to look."""

    def __init__(self, sock: socket.socket, peer: int, rank: int, timeout_s: float, max_kept: int) -> None:
        self.sock, self.peer, self.rank, self.timeout_s = sock, peer, rank, timeout_s
        self.max_kept = max_kept  # frames kept for later takers before the connection counts as broken
        self.kept: deque[_Frame] = deque()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._cond = threading.Condition()
        self._reading = False  # a thread is reading the socket
        self._error: BaseException | None = None  # the connection failed: every taker raises it

    def take(self, kinds: tuple[int, ...], tag: int | None, deadline: float | None, what: str) -> _Frame:
        """The first frame of one of ``kinds`` (and ``tag``, unless None); waits
        until ``deadline`` (None: as long as it takes), then ``LinkTimeout``."""
        while True:
            with self._cond:
                while True:
                    frame = self._kept(kinds, tag)
                    if frame is not None:
                        return frame
                    if self._error is not None:
                        raise self._error
                    if not self._reading:
                        self._reading = True
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise self._timeout(what)
                    self._cond.wait(left)
            try:
                frame = self._read(deadline, what)
            except BaseException as error:  # closed, or stalled mid-frame: broken for every taker
                with self._cond:
                    self._reading = False
                    self._error = error
                    self._cond.notify_all()
                raise
            with self._cond:
                self._reading = False
                self._cond.notify_all()
                if frame is None:  # nothing began to arrive by the deadline: the connection is intact
                    raise self._timeout(what)
                if frame.kind in kinds and (tag is None or frame.tag == tag):
                    return frame
                if len(self.kept) >= self.max_kept:
                    self._error = RuntimeError(
                        f"rank {self.rank}: {self.max_kept} frames from rank {self.peer} nobody asked for"
                    )
                    raise self._error
                self.kept.append(frame)

    def keep(self, frame: _Frame) -> None:
        """A frame that came inside another (a ring message a plan carried): kept
        for whoever asks for it, as a frame read ahead of its turn is."""
        with self._cond:
            self.kept.append(frame)
            self._cond.notify_all()

    def _kept(self, kinds: tuple[int, ...], tag: int | None) -> _Frame | None:
        for frame in self.kept:
            if frame.kind in kinds and (tag is None or frame.tag == tag):
                self.kept.remove(frame)
                return frame
        return None

    def _timeout(self, what: str) -> LinkTimeout:
        return LinkTimeout(f"rank {self.rank}: {what} from rank {self.peer} not done within {self.timeout_s:g} s")

    def _read(self, deadline: float | None, what: str) -> _Frame | None:
        """The next frame; None when none began to arrive by ``deadline``."""
        prefix = bytearray(_PREFIX.size)
        if not self._fill(memoryview(prefix), deadline, what, started=False):
            return None
        magic, kind, tag, header_size, payload_size = _PREFIX.unpack(prefix)
        if magic != _MAGIC:
            raise RuntimeError(f"rank {self.rank}: a frame from rank {self.peer} does not begin with {_MAGIC!r}")
        header = bytearray(header_size)
        self._fill(memoryview(header), None, what)
        payload = bytearray(payload_size)
        self._fill(memoryview(payload), None, what)
        return _Frame(kind, tag, bytes(header), payload)

    def _fill(self, view: memoryview, deadline: float | None, what: str, started: bool = True) -> bool:
        """Read ``view`` full. Before a frame's first byte (``started`` False) it
        gives up at ``deadline`` (False); once a frame has begun, the rest must
        come within the connection's timeout, whatever the caller's deadline: a
        frame is never left half read."""
        got = 0
        if started:
            deadline = time.monotonic() + self.timeout_s
        while got < len(view):
            timeout_ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
            if not self._poller.poll(timeout_ms):
                if got == 0 and not started:
                    return False
                raise LinkTimeout(
                    f"rank {self.rank}: {what} from rank {self.peer} not done within {self.timeout_s:g} s"
                )
            try:
                count = self.sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as error:
                raise PeerClosed(f"rank {self.peer} closed its connection ({error.strerror or error})") from error
            if count == 0:
                raise PeerClosed(f"rank {self.peer} closed its connection")
            got += count
            if not started:
                started, deadline = True, time.monotonic() + self.timeout_s
        return True


class RankSockets:
    """This rank's connections to the others (see the module's docstring). Has
    ``RingLink``'s interface (``send``, ``recv``, ``wait_sent``, the counters),
    so the ring runs on it as it does on ``torch.distributed``."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.device = torch.device("cpu")
        self._out: dict[tuple[int, int], _Outgoing] = {}  # (peer, channel) -> connection
        self._in: dict[tuple[int, int], _Incoming] = {}
        self._listener: socket.socket | None = None
        self.bytes_sent = 0
        self.transfers = 0

    # -- joining -----------------------------------------------------------------

    def listen(self, store, host: str, bind_host: str | None = None, port: int = 0) -> None:
        """Listen on ``port`` (0: any free one), and leave ``host:port`` in
        ``store`` for the ranks that write to this one. A port taken already
        raises ``OSError`` naming it."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((bind_host or host, port))
        except OSError as error:
            listener.close()
            why = f"pipeline rank {self.rank} cannot listen on port {port}: {error.strerror}"
            raise OSError(error.errno, why) from None
        listener.listen(self.world)
        self._listener = listener
        store.set(f"sockets/{self.rank}", f"{host}:{listener.getsockname()[1]}")

    def connect(self, store, timeout_s: float) -> None:
        """Connect to every rank this one writes to and accept every rank that
        writes to it (after ``listen`` on every rank; the order does not matter)."""
        deadline = time.monotonic() + timeout_s
        for peer, channel in _links(self.rank, self.world, writing=True):
            store.wait([f"sockets/{peer}"], datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
            host, port = store.get(f"sockets/{peer}").decode().rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_HELLO.pack(_MAGIC, self.rank, channel))
            self._out[peer, channel] = _Outgoing(sock, peer, self.timeout_s)
        expected = set(_links(self.rank, self.world, writing=False))
        while expected - set(self._in):
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError as error:
                missing = sorted({peer for peer, _ in expected - set(self._in)})
                raise LinkTimeout(
                    f"rank {self.rank}: ranks {missing} did not connect within {timeout_s:g} s"
                ) from error
            sock.settimeout(min(HELLO_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
            hello = bytearray(_HELLO.size)
            view, got = memoryview(hello), 0
            try:
                while got < len(hello):
                    count = sock.recv_into(view[got:])
                    if count == 0:
                        break
                    got += count
            except OSError:  # a connection that is not a rank's (silent, or reset): not ours
                got = 0
            magic, peer, channel = _HELLO.unpack(hello) if got == len(hello) else (b"", -1, -1)
            if magic != _MAGIC or (peer, channel) not in expected or (peer, channel) in self._in:
                sock.close()
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._in[peer, channel] = _Incoming(sock, peer, self.rank, self.timeout_s, MAX_KEPT[channel])
        self._listener.close()
        self._listener = None

    # -- plans (rank 0 to every follower) -----------------------------------------

    def send_plan(self, number: int, raw: bytes, ring: tuple[int, Message] | None = None) -> None:
        """Plan ``number`` (its bytes) to every follower; with ``ring`` (tag,
        message), rank 1's ring message of that tag goes in the same frame
        (``PLAN_RING``): one write where there would be two. The follower
        keeps it aside as the ring message it is, for ``recv``."""
        for peer in range(1, self.world):
            if peer == 1 and ring is not None:
                tag, message = ring
                header, parts = _encoded(message)
                self._post(peer, PLAN_RING, number, _CARRIED.pack(len(raw), tag) + raw + header, parts)
                self.transfers += 1
            else:
                self._post(peer, PLAN, number, raw, [])

    def send_stop(self) -> None:
        for peer in range(1, self.world):
            try:
                self._post(peer, STOP, 0, b"", [])
            except (PeerClosed, LinkTimeout):
                pass

    def recv_plan(self) -> bytes | None:
        """The next plan from rank 0 (waits as long as it takes); None at a stop.
        A ring message the plan carried is kept for ``recv``."""
        incoming = self._in[0, PIPELINE]
        frame = incoming.take((PLAN, PLAN_RING, STOP), None, None, "plan")
        if frame.kind == STOP:
            return None
        if frame.kind == PLAN:
            return frame.header
        size, tag = _CARRIED.unpack_from(frame.header)
        start = _CARRIED.size
        incoming.keep(_Frame(RING, tag, frame.header[start + size :], frame.payload))
        return frame.header[start : start + size]

    # -- the ring (RingLink's interface) ------------------------------------------

    def send(self, peer: int, tag: int, message: Message) -> None:
        """Post ``message`` (its header a ``RingHeader``) to ``peer``; returns once
        the kernel holds it or the connection's thread has what it did not take."""
        if not isinstance(message.header, RingHeader):
            raise TypeError(f"a ring message's header is a RingHeader, not {type(message.header).__name__}")
        self.post(peer, RING, tag, message)
        self.transfers += 1

    def recv(self, peer: int, tag: int) -> Message:
        """The ring message ``peer`` sent with ``tag``; ``LinkTimeout`` past the
        timeout, ``PeerClosed`` when the peer's connection closes, ``BadMessage``
        when its header is not a valid ``RingHeader``."""
        _, message = self.take(peer, (RING,), tag, self.timeout_s, "ring message")
        return message

    # -- any kind of frame ----------------------------------------------------------

    def post(self, peer: int, kind: int, tag: int, message: Message) -> None:
        """One frame of ``kind`` to ``peer``: the message's header (with its
        tensors' shapes and types), which must be of the kind's type
        (``HEADER``: ``TypeError`` otherwise), and tensors."""
        if not isinstance(message.header, HEADER[kind]):
            wanted = rank_type_name(HEADER[kind])
            raise TypeError(f"{FRAME_NAME[kind]}'s header is a {wanted}, not {type(message.header).__name__}")
        header, parts = _encoded(message)
        self._post(peer, kind, tag, header, parts)

    def take(
        self, peer: int, kinds: tuple[int, ...], tag: int | None, timeout_s: float | None, what: str
    ) -> tuple[int, Message]:
        """The next frame from ``peer`` of one of ``kinds`` (and ``tag``, unless
        None), as (kind, message); waits up to ``timeout_s`` (None: as long as it
        takes), then ``LinkTimeout``; ``PeerClosed`` when the connection closes.
        The tensors are views of the received bytes. ``BadMessage`` when the
        header is not of the type the frame's kind carries (``HEADER``), naming
        what is wrong with it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        frame = self._in[peer, _channel(kinds)].take(kinds, tag, deadline, what)
        header = frame_header(frame.header, HEADER[frame.kind], self.rank, peer, FRAME_NAME[frame.kind])
        specs = [(spec.shape, tensor_dtype(spec)) for spec in header.tensors]
        tensors, offset = [], 0
        for shape, kind in specs:
            count = math.prod(shape) * kind.itemsize
            if offset + count > len(frame.payload):
                raise BadMessage(f"rank {self.rank}: a frame from rank {peer} is shorter than its tensors")
            if count:
                flat = torch.frombuffer(frame.payload, dtype=torch.uint8, count=count, offset=offset)
                tensors.append(flat.view(kind).reshape(shape))
            else:
                tensors.append(torch.empty(shape, dtype=kind))
            offset += aligned(count)
        return frame.kind, Message(header, tensors)

    def wait_sent(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for outgoing in self._out.values():
            outgoing.drain(deadline)

    def close(self) -> None:
        for outgoing in self._out.values():
            outgoing.close()
        for incoming in self._in.values():
            incoming.sock.close()
        if self._listener is not None:
            self._listener.close()

    def _post(self, peer: int, kind: int, tag: int, header: bytes, parts: list[torch.Tensor]) -> None:
        """One frame, written once into one buffer: prefix, header, then each
        tensor's bytes at a multiple of ``ALIGN`` from the payload's start."""
        sizes = [t.numel() * t.element_size() for t in parts]
        payload = sum(aligned(size) for size in sizes)
        start = _PREFIX.size + len(header)
        frame = bytearray(start + payload)
        _PREFIX.pack_into(frame, 0, _MAGIC, kind, tag, len(header), payload)
        frame[_PREFIX.size : start] = header
        if payload:
            flat = torch.frombuffer(frame, dtype=torch.uint8)
            offset = start
            for t, size in zip(parts, sizes, strict=True):
                if size:
                    flat[offset : offset + size].copy_(t.reshape(-1).view(torch.uint8))
                offset += aligned(size)
        self._out[peer, CHANNEL[kind]].post(memoryview(frame))
        self.bytes_sent += len(frame)


def _encoded(message: Message) -> tuple[bytes, list[torch.Tensor]]:
    """A message's header (a ``RingHeader`` or a decode frame, with its tensors'
    shapes and types, through ``encode_rank``) and its tensors on the host, as
    a frame carries them."""
    parts = [t.detach().contiguous().cpu() for t in message.tensors]
    return encode_rank(msgspec.structs.replace(message.header, tensors=tensor_specs(parts))), parts


def _channel(kinds: tuple[int, ...]) -> int:
    channels = {CHANNEL[kind] for kind in kinds}
    if len(channels) != 1:
        raise ValueError(f"frames of kinds {kinds} travel on different connections")
    return channels.pop()
