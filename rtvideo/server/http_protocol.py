"""The HTTP/1.1 protocol ``rtvideo serve`` runs: uvicorn's (h11), with each
request's head bounded in size and in time.

API process, asyncio. uvicorn waits for a request's head (its request line and
headers) as long as the client likes: a client that sends half a head and then
nothing (or a byte now and then) holds its socket for ever, and enough of them
hold every descriptor the server has. h11 bounds a head's size only while it
arrives in pieces, and then answers a bare 400.

``guarded_h11(head_timeout_s)`` is the protocol class with both bounds:

- **time**: a head must be complete within ``head_timeout_s`` of the connection
  being made, or of the first byte of a later request on a kept-alive
  connection (trickling bytes does not extend it). Past it, a client that sent
  part of a head is answered 408 ``request_timeout`` and closed; one that sent
  nothing is closed.
- **size**: a head of more than ``MAX_HEAD_BYTES`` is answered at once, before
  the rest is read: 414 ``uri_too_long`` when its request line alone is over
  the bound (a WebSocket URL included: the upgrade is an HTTP request), else
  431 ``headers_too_large``; then the connection is closed.

A request h11 cannot parse at all (a malformed request line or header, two
``Content-Length`` headers, bad chunk framing) is answered 400
``bad_request``, where uvicorn answers in plain text.

Each refusal is in the project's error shape and logged in one line naming the
client and what was refused, never the request's URL (its query may carry a
credential). After it the server stops writing, drops what the client still
sends for ``LINGER_S`` (so the close does not reset the connection before the
client has read the answer), and closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (request line and headers) the server reads; h11's own
default for a head that arrives in pieces, applied however it arrives."""

LINGER_S = 1.0
"""After a refusal: how long what the client still sends is read and dropped, so
that the close does not reset the connection before the client read the answer."""

_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 finds a head's end
_REASONS = {400: "Bad Request", 408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class GuardedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the head bounds above; ``head_timeout_s``
    is set by ``guarded_h11``."""

    head_timeout_s: float = 10.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_received = 0  # bytes of the head being waited for, as far as they came
        self.refused = False  # answered 408 / 414 / 431: the rest is dropped until the close

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.conn.their_state is h11.IDLE:  # a head is awaited: this is (part of) it
            if self.head_timer is None:
                self._arm_head_timer()
            self.head_received += len(data)
            if self.head_received > MAX_HEAD_BYTES and (status := self._oversized(data)) is not None:
                part = "request line" if status == 414 else "request head"
                self._refuse(status, f"the {part} is over {MAX_HEAD_BYTES} bytes")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection is past it)
            self._disarm_head_timer()
            self.head_received = 0

    def _oversized(self, data: bytes) -> int | None:
        """414 or 431 when the head, as far as it came, is over ``MAX_HEAD_BYTES``;
        None when it ended within the bound (a body may follow it in ``data``)."""
        received = self.conn.trailing_data[0] + data
        end = _HEAD_END.search(received)
        if end is not None and end.end() <= MAX_HEAD_BYTES:
            return None
        line_end = received.find(b"\n")
        return 414 if line_end < 0 or line_end > MAX_HEAD_BYTES else 431

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.head_received or self.conn.trailing_data[0]:
            self._refuse(408, f"the request head was not complete within {self.head_timeout_s:g} s")
        else:
            log.debug("%s - nothing sent within %g s; closed", self._client(), self.head_timeout_s)
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` in the project's error shape, log it, and close."""
        code = {400: "bad_request", 408: "request_timeout", 414: "uri_too_long", 431: "headers_too_large"}[status]
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        log.info("%s - %d %s: %s; closed", self._client(), status, code, message)
        self._disarm_head_timer()
        self.refused = True
        self.transport.write(head + body)
        if self.transport.can_write_eof():  # the client reads the answer, then the end of the stream
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn answers a request h11 cannot parse, in the project's error
        shape (uvicorn's own is plain text)."""
        message = (
            "the request is not valid HTTP/1.1: a malformed request line or header, "
            "or a body whose length is not one (Content-Length or chunked framing)"
        )
        self._refuse(400, message)

    def _client(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


def guarded_h11(head_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's ``http`` setting, heads due within ``head_timeout_s``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"head_timeout_s": head_timeout_s})
