"""Limits checked before a request is parsed: body size, JSON nesting and
the length of JSON integers.

API process, asyncio. A realtime text message is at most
``MAX_TEXT_MESSAGE_CHARS`` long, and a connection's text at most
``TEXT_CHARS_PER_S`` a second (``TEXT_BURST_CHARS`` at once; the realtime
handler keeps the bucket). ``json_depth`` measures how deeply a JSON text nests
without parsing it (a regular expression skips strings, so brackets inside
a prompt do not count), so a message nested thousands deep is refused with
a clear error instead of exhausting the parser's recursion. ``long_integers``
names each integer longer than ``MAX_JSON_INT_DIGITS`` digits by its field,
where Python's parser would only refuse the whole text (past 4300 digits) or
spend its time converting it. ``parse_json`` applies both and parses (the
realtime socket's messages). ``BodyLimits`` is an ASGI middleware for HTTP:
a body larger than ``max_bytes`` is answered 413 as soon as that is known
(from ``Content-Length``, or while reading a body sent without one), never
read whole; a JSON body nested deeper than ``MAX_JSON_DEPTH``, or with an
integer too long, is answered 422 ``invalid_request`` naming the field. All
in the project's error shape.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

MAX_JSON_DEPTH = 32
"""Deepest JSON nesting a client message or request body may have (ours need 4)."""
MAX_JSON_INT_DIGITS = 100
"""Most digits of an integer in a client message or request body: far past any
field's bound (a seed has at most 19), far below what costs the parser time."""

MAX_TEXT_MESSAGE_CHARS = 131_072
"""Longest text message a realtime client may send: past any event's need (a
session.start with two prompts of ``MAX_PROMPT_CHARS`` characters, each escaped
as ``\\uXXXX`` pairs, is under 100,000), so a longer one is refused unread."""
TEXT_CHARS_PER_S = 262_144
"""Text a realtime connection may send a second, on average, before it is
closed (``too_many_messages``): a flood of valid messages otherwise costs the
API process's event loop their parsing, every session's time. Every message
counts at least ``MESSAGE_FLOOR_CHARS``, a binary one too, so a flood of
empty ones is closed as well (512 messages a second on average)."""
TEXT_BURST_CHARS = 1_048_576
"""...and at once: eight of the longest messages."""
MESSAGE_FLOOR_CHARS = 512
"""What a message counts against ``TEXT_CHARS_PER_S`` at least: its handling
(a reply, an error) costs the server however short it is."""

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_LONG_DIGITS = re.compile(rf"\d{{{MAX_JSON_INT_DIGITS + 1}}}")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def json_depth(text: str | bytes) -> int:
    """The deepest nesting of arrays and objects in ``text``; strings are skipped.
    For text that is not valid JSON the figure is only an estimate; the parser
    that runs next says what is wrong with it."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    depth = deepest = 0
    for token in _TOKENS.finditer(text):
        char = token.group()[0]
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


class JsonLimitError(ValueError):
    """JSON refused before it is read: the message says why, naming the field."""


class TooLongError(JsonLimitError):
    """A text message longer than ``MAX_TEXT_MESSAGE_CHARS``."""


class TooDeepError(JsonLimitError):
    """JSON nested deeper than ``MAX_JSON_DEPTH``."""


class IntegerTooLongError(JsonLimitError):
    """JSON holding an integer of more than ``MAX_JSON_INT_DIGITS`` digits."""


def too_deep(text: str | bytes) -> str | None:
    """Why ``text`` nests too deeply to parse, or None."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        return f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted"
    return None


class _LongInteger:
    """What the parser makes of an integer too long to convert: its digit count."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _bounded_int(text: str) -> int | _LongInteger:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_JSON_INT_DIGITS else _LongInteger(digits)


def _long_integer_fields(value: Any, path: tuple[str, ...] = ()) -> list[str]:
    """``where: why`` for each ``_LongInteger`` in a parsed value, where as the
    fields' names and list indices joined by dots (``body`` at the top)."""
    if isinstance(value, _LongInteger):
        where = ".".join(path) or "body"
        return [f"{where}: an integer of {value.digits} digits; at most {MAX_JSON_INT_DIGITS} are accepted"]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [found for key, item in items for found in _long_integer_fields(item, (*path, str(key)))]


def _parse(text: str | bytes) -> Any:
    """``text`` parsed; ``IntegerTooLongError`` naming each integer that is too long."""
    if _LONG_DIGITS.search(text if isinstance(text, str) else text.decode("utf-8", errors="replace")) is None:
        return json.loads(text)  # no run of digits that long anywhere: the plain parser
    value = json.loads(text, parse_int=_bounded_int)
    if found := _long_integer_fields(value):
        raise IntegerTooLongError("; ".join(found))
    return value


def parse_json_field(text: str, name: str) -> Any:
    """The JSON value a form's field ``name`` holds as text, parsed within the
    limits: ``TooDeepError`` or ``IntegerTooLongError`` naming the field (and
    the place inside it: ``interactions.0.at_chunk``), ``ValueError`` for
    text that is not JSON."""
    if (why := too_deep(text)) is not None:
        raise TooDeepError(f"{name}: {why}")
    value = json.loads(text, parse_int=_bounded_int)
    if found := _long_integer_fields(value, (name,)):
        raise IntegerTooLongError("; ".join(found))
    return value


def long_integers(text: str | bytes) -> str | None:
    """Why ``text`` holds an integer too long to read, naming each field, or None
    (also for text that is not JSON: the parser that runs next says what is wrong)."""
    try:
        _parse(text)
    except IntegerTooLongError as error:
        return str(error)
    except ValueError:
        return None
    return None


def parse_json(text: str | bytes) -> Any:
    """A realtime client's JSON text message, parsed within the limits:
    ``TooLongError``, ``TooDeepError`` or ``IntegerTooLongError`` (each a
    ``JsonLimitError``) naming what is wrong, ``ValueError`` for text that is
    not JSON."""
    if len(text) > MAX_TEXT_MESSAGE_CHARS:
        raise TooLongError(f"a text message of {len(text)} characters; at most {MAX_TEXT_MESSAGE_CHARS} are accepted")
    if (why := too_deep(text)) is not None:
        raise TooDeepError(why)
    return _parse(text)


class BodyLimits:
    """ASGI middleware: request bodies of at most ``max_bytes``, sent without a
    gap of ``body_timeout_s`` (else 408 and the connection closed: the head's
    own bound, ``header_timeout_s``, ends where the body begins), as sent (no
    ``Content-Encoding``), JSON in UTF-8, at most ``MAX_JSON_DEPTH`` deep and
    with no integer over ``MAX_JSON_INT_DIGITS`` digits, checked before the
    application reads the body."""

    def __init__(self, app: Callable, max_bytes: int, body_timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, "body_too_large", self._too_large(int(declared)))
        body = bytearray()
        more = True
        while more:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                why = f"no byte of the request body for {self.body_timeout_s:g} s ({len(body)} bytes came)"
                return await self._refuse(send, 408, "request_timeout", why)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(send, 413, "body_too_large", self._too_large(len(body), at_least=more))
        coding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if coding not in ("identity", ""):  # an empty list of codings is none
            message = f"content-encoding: {coding!r}: a body is read as it is sent; send it without a content coding"
            return await self._refuse(send, 422, "invalid_request", message)
        if b"json" in headers.get(b"content-type", b""):
            try:
                text = body.decode("utf-8")  # once: both checks below read this text
            except UnicodeDecodeError as error:
                message = f"body: not UTF-8 (byte {body[error.start]:#04x} at {error.start}); a JSON body is UTF-8"
                return await self._refuse(send, 422, "invalid_request", message)
            if (why := too_deep(text)) is not None:
                return await self._refuse(send, 422, "invalid_request", f"body: {why}")
            if (why := long_integers(text)) is not None:
                return await self._refuse(send, 422, "invalid_request", why)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return f"the request body is {'over ' if at_least else ''}{size} bytes; at most {self.max_bytes} are accepted"

    @staticmethod
    async def _refuse(send: Send, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status in (408, 413):  # the rest of the body may still come, or never: the connection ends here
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
