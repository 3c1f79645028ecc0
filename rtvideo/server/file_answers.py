"""How the API answers HEAD requests and a video's byte ranges.

API process. ``HeadAsGet`` is an ASGI middleware: a HEAD request to a route
that takes GET is answered as that GET would be, its status and headers
(``Content-Length`` included), without its body (RFC 9110, 9.3.2: a server
that takes GET takes HEAD), so ``curl -I`` works on every GET route. The
route sees a GET; ``HEAD_ONLY`` in its scope says the body will be dropped,
and ``VideoFile`` reads it to send no file at all.

``VideoFile`` is the file answer of ``/content``: Starlette's ``FileResponse``
with its ``Range`` handling held to RFC 9110, 14.2, and errors in the API's
one shape:

- a range unit other than ``bytes``, or a range-set that does not parse
  (``bytes=abc``, ``bytes=5-2``), is ignored: the whole video, 200 (the
  server MAY ignore an invalid one, MUST ignore an unknown unit; Starlette
  answered both 400 in plain text);
- of several ranges, those that start past the end are dropped (the rest
  are answered, 206); when none is left, 416 ``range_not_satisfiable`` with
  ``Content-Range: bytes */SIZE``, in JSON;
- an ``If-Range`` that does not match the file's validators makes the
  ``Range`` ignored: the whole video, 200 (RFC 9110, 13.1.5).
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Message, Receive, Scope, Send

HEAD_ONLY = "rtvideo.head_only"
"""Scope key: this GET answers a HEAD request, its body dropped."""


class HeadAsGet:
    """ASGI middleware: HEAD answered as GET without the body (the module's docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message: Message) -> None:
            if message["type"] in ("http.response.body", "http.response.pathsend"):
                if message.get("more_body", False):
                    return  # a part of the body: dropped
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET", HEAD_ONLY: True}, receive, headers_only)


class VideoFile(FileResponse):
    """A stored video as the answer, ranges as the module's docstring says."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get(HEAD_ONLY):
            scope = {**scope, "method": "HEAD"}  # Starlette's own HEAD: the headers, no file read
        if self.stat_result is None:  # once, here: the If-Range check needs the validators it sets
            self.stat_result = await anyio.to_thread.run_sync(os.stat, self.path)
            self.set_stat_headers(self.stat_result)
        headers = {name: value.decode("latin-1") for name, value in scope.get("headers", [])}
        http_range, if_range = headers.get(b"range"), headers.get(b"if-range")
        if http_range is not None and (if_range is None or self._should_use_range(if_range)):
            size = self.stat_result.st_size
            try:
                self._parse_range_header(http_range, size)
            except RangeNotSatisfiable:
                return await self._unsatisfiable(send, http_range, size)
        await super().__call__(scope, receive, send)

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        """The byte ranges asked for that lie in the file (RFC 9110, 14.1.1: a
        set is satisfiable if any of its ranges is, and only those are sent);
        ``[]``: ignored, the whole file (another unit, a set that does not
        parse, a range whose last byte comes before its first);
        ``RangeNotSatisfiable`` when none lies in the file."""
        units, equals, ranges = http_range.partition("=")
        if not equals or units.strip().lower() != "bytes" or ranges.count(",") + 1 > cls.max_ranges:
            return []
        asked = cls._parse_ranges(ranges, file_size)  # (start, end) pairs; parts that do not parse are skipped
        if not asked or any(start >= end for start, end in asked if start < file_size):
            return []
        kept = [(start, end) for start, end in asked if start < file_size]
        if not kept:
            raise RangeNotSatisfiable(file_size)
        try:  # Starlette's own, on the ranges kept: it merges those that overlap
            return super()._parse_range_header("bytes=" + ",".join(f"{s}-{e - 1}" for s, e in kept), file_size)
        except MalformedRangeHeader:
            return []

    @staticmethod
    async def _unsatisfiable(send: Send, http_range: str, size: int) -> None:
        message = f"range: {http_range!r}: no byte of it lies within the video's {size} bytes"
        body = json.dumps({"error": {"code": "range_not_satisfiable", "message": message}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"content-range", f"bytes */{size}".encode()),
        ]
        await send({"type": "http.response.start", "status": 416, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
