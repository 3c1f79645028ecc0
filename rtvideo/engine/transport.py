"""The RPC queue between the API process and worker rank 0.

Two ZeroMQ PUSH/PULL pipes over ``ipc://`` sockets in a private directory:
control (client -> worker) and results (worker -> client); over TCP
(``Endpoints.tcp``) when the worker group is started by a launcher, on this
machine or another. Why ZeroMQ rather than ``multiprocessing`` queues:

- the client side is natively asyncio (``zmq.asyncio``): no thread that blocks
  on ``Queue.get`` and hops results into the event loop;
- messages are the msgpack bytes of ``rtvideo.engine.messages`` structs: no pickling.
  Encoding copies a chunk's payload into the message once; the worker then
  hands a message of 64 KiB or more to ZeroMQ by reference (``copy=False``)
  rather than copying it again. The client's ``recv`` and the decode each copy
  it once more, so a payload is not zero-copy end to end;
- a pipe stays ordered per sender and survives a slow reader (high-water mark)
  without a feeder thread of its own; both ends can ``poll`` it beside other
  file descriptors (the worker watches its parent's liveness pipe that way).

The client binds, workers connect. Encoding and decoding happen here only,
those of the messages between pipeline ranks too (``encode_rank``,
``decode_rank``: a micro-step's plan, a ring message's header, the decode
stage's frames), which travel on the ranks' own connections
(``rtvideo.workers.parallel``).
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import typing
from dataclasses import dataclass
from types import UnionType
from typing import Any

import msgspec
import zmq

from rtvideo.engine.messages import ControlMessage, RankMessage, ResultMessage

log = logging.getLogger(__name__)

_control_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_result_encoder = msgspec.msgpack.Encoder()
_result_decoder = msgspec.msgpack.Decoder(ResultMessage)


def encode_control(message: ControlMessage) -> bytes:
    return _control_encoder.encode(message)


def decode_control(data: bytes) -> ControlMessage:
    """Decode one control message; raises ``msgspec.DecodeError`` on bad bytes."""
    return _control_decoder.decode(data)


def encode_result(message: ResultMessage) -> bytes:
    return _result_encoder.encode(message)


def decode_result(data: bytes) -> ResultMessage:
    return _result_decoder.decode(data)


_rank_encoder = msgspec.msgpack.Encoder()
_rank_decoder = msgspec.msgpack.Decoder(RankMessage)


def encode_rank(message: RankMessage) -> bytes:
    """A message between pipeline ranks (``rtvideo.workers.parallel``): a plan, a ring
    header, a decode stage's frame."""
    return _rank_encoder.encode(message)


def decode_rank(data: bytes, kind: type | UnionType) -> Any:
    """Decode a message between pipeline ranks that must be a ``kind`` (a type,
    or a union of them: ``rtvideo.engine.messages.DecodeRequest``); raises
    ``msgspec.DecodeError`` saying which type was expected and what was wrong
    (not msgpack, no tag or another type's, a field missing, unknown or of the
    wrong type)."""
    try:
        message = _rank_decoder.decode(data)
    except msgspec.DecodeError as error:
        raise type(error)(f"not a valid {rank_type_name(kind)}: {error}") from None
    if not isinstance(message, kind):
        raise msgspec.ValidationError(f"not a valid {rank_type_name(kind)}: a {type(message).__name__}")
    return message


def rank_type_name(kind: type | UnionType) -> str:
    """``kind``'s name; a union's as its types' names joined by "or"."""
    if isinstance(kind, UnionType):
        return " or ".join(member.__name__ for member in typing.get_args(kind))
    return kind.__name__


@dataclass(frozen=True)
class Endpoints:
    """Addresses of the two pipes; picklable, handed to workers at spawn."""

    control: str
    results: str

    @classmethod
    def fresh(cls) -> tuple[Endpoints, str]:
        """New endpoints in a private temporary directory (returned for cleanup)."""
        directory = tempfile.mkdtemp(prefix="rtv-")
        return (
            cls(
                control=f"ipc://{os.path.join(directory, 'control')}",
                results=f"ipc://{os.path.join(directory, 'results')}",
            ),
            directory,
        )

    @classmethod
    def tcp(cls, address: str) -> Endpoints:
        """The pipes of an API process at ``HOST:PORT``: control on PORT, results on
        PORT + 1 (the API process binds them as given: HOST ``0.0.0.0`` listens on
        every interface; a worker connects to the API host's address)."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {address!r}")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return cls(control=f"tcp://{host}:{int(port)}", results=f"tcp://{host}:{int(port) + 1}")


class ResultSender:
    """Worker side of the results pipe, with an output thread of its own.

    ``send`` may be called from any thread and returns at once: the output
    thread encodes each message (a chunk's payload is megabytes) and sends it,
    in the order ``send`` was called, so neither the loop nor the control
    receiver ever waits on encoding or on the socket. One FIFO for every
    caller keeps the order a caller relies on: a message sent while holding a
    lock (the mailbox's) reaches the client before anything sent after it.
    The socket is used by the output thread alone, and lives in a ZeroMQ
    context of its own, so ``close`` can wait until what was sent has left
    the process (a worker about to exit at once, ``os._exit``, says why first).
    """

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._closing = threading.Lock()
        self._closed = False
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(endpoint)
        self._queue: queue.SimpleQueue[ResultMessage | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="result-sender", daemon=True)
        self._thread.start()

    def send(self, message: ResultMessage) -> None:
        self._queue.put(message)

    def close(self, timeout: float = 10.0) -> None:
        """Send what was queued, close the socket, and wait (up to its 2 s linger)
        until ZeroMQ has handed every message on."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout)
            self._socket.close()
            self._context.term()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                data = encode_result(message)
                self._socket.send(data, copy=len(data) < 65536)
            except Exception:  # keep sending the rest: one bad message must not silence the worker
                log.exception("could not send %s", type(message).__name__)
