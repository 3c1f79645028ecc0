"""The RPC queue between the API process and worker rank 0.

Two ZeroMQ PUSH/PULL pipes over ``ipc://`` sockets in a private directory:
control (client -> worker) and results (worker -> client). Why ZeroMQ rather
than ``multiprocessing`` queues:

- the client side is natively asyncio (``zmq.asyncio``): no thread that blocks
  on ``Queue.get`` and hops results into the event loop;
- messages are the msgpack bytes of ``engine.messages`` structs: no pickling.
  Encoding copies a chunk's payload into the message once; the worker then
  hands a message of 64 KiB or more to ZeroMQ by reference (``copy=False``)
  rather than copying it again. The client's ``recv`` and the decode each copy
  it once more, so a payload is not zero-copy end to end;
- a pipe stays ordered per sender and survives a slow reader (high-water mark)
  without a feeder thread of its own; both ends can ``poll`` it beside other
  file descriptors (the worker watches its parent's liveness pipe that way).

The client binds, workers connect. Encoding and decoding happen here only.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

import msgspec
import zmq

from engine.messages import ControlMessage, ResultMessage

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


class ResultSender:
    """Worker side of the results pipe; safe to call from several threads.

    The lock orders sends from the control-receiver thread and the loop
    thread on one socket, so a message sent while holding another lock (the
    mailbox's) reaches the client before anything sent after that lock.
    """

    def __init__(self, context: zmq.Context, endpoint: str) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(endpoint)
        self._lock = threading.Lock()

    def send(self, message: ResultMessage) -> None:
        data = encode_result(message)
        with self._lock:
            self._socket.send(data, copy=len(data) < 65536)

    def close(self) -> None:
        with self._lock:
            self._socket.close()
