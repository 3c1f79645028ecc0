"""Form bodies for ``POST /v1/videos`` and ``/v1/videos/sync``.

API process, asyncio. The OpenAI SDK's ``videos.create`` posts
``multipart/form-data`` (``prompt``, ``model``, ``seconds``, ``size``, and an
optional ``input_reference`` file); an HTML form posts
``application/x-www-form-urlencoded``. ``FormBodies`` is an ASGI middleware
that turns either into the JSON body the routes take, before they read it, so
one schema (``JobRequest``) validates every body and names the field it
refuses, whatever the content type.

The contract: each form field is a field of the JSON body, its value as text
(``"4"`` for a number, ``"true"`` for a boolean: the schema converts it);
``interactions`` is a JSON array as text; a field left empty is as if it were
not sent; ``input_reference``, a multipart form's one file, is an input video
to restyle (video to video): its bytes reach the route beside the body, in the
request's scope (``INPUT_REFERENCE``), never in the JSON. A field given twice,
a file in any other field, an ``input_reference`` that is text, and a form
that does not parse are refused 422 ``invalid_request`` naming the field. A urlencoded body
that begins with ``{`` or ``[`` is JSON sent without its content type (what
``curl -d`` sends unless told) and is refused saying to add
``-H 'content-type: application/json'``. It sits inside
``BodyLimits``, so ``max_request_bytes`` (413) holds for forms as for JSON.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from rtvideo.server.limits import MAX_JSON_INT_DIGITS, JsonLimitError, parse_json_field
from rtvideo.server.schemas import JobRequest

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

FORM_TYPES = (b"multipart/form-data", b"application/x-www-form-urlencoded")
JSON_FIELDS = ("interactions",)  # form fields whose text is JSON
INT_FIELDS = frozenset(name for name, field in JobRequest.model_fields.items() if field.annotation in (int, int | None))
"""Form fields whose text is an integer (a prompt of digits is text)."""
REFERENCE = "input_reference"
INPUT_REFERENCE = "rtvideo.input_reference"
"""The scope key under which a form's ``input_reference`` file reaches the route (its bytes)."""
JSON_AS_FORM = (
    "body: this is JSON sent as a form (content-type application/x-www-form-urlencoded, what curl -d sends "
    "unless told); add -H 'content-type: application/json'"
)
REFERENCE_AS_TEXT = "input_reference: expected a video file (a file field of a multipart/form-data body), got text"


def _text(**more: str) -> dict[str, str]:
    """An OpenAPI string schema (built by call: a ``{"type": ...}`` literal reads as a protocol event)."""
    return dict(type="string", **more)


FORM_SCHEMA = dict(
    type="object",
    description=(
        "The JSON body's fields as form fields, each value as text (interactions: a JSON array as text; "
        "an empty field is as if not sent). What the OpenAI SDK's videos.create sends: prompt, model, "
        'seconds (e.g. "4"), size (WIDTHxHEIGHT); input_reference, a video file to restyle (with input_strength).'
    ),
    properties={
        "prompt": _text(),
        "model": _text(),
        "seconds": _text(),
        "size": _text(pattern="^[0-9]{1,5}x[0-9]{1,5}$"),
        "interactions": _text(description="a JSON array, as in the JSON body"),
        "input_reference": _text(
            format="binary",
            description="an input video to restyle (video to video), decoded and resampled to the job's size and fps",
        ),
        "input_strength": _text(description="with input_reference: 0-1, how far the video departs from it"),
    },
    required=["prompt"],
    additionalProperties=_text(),
)
OPENAPI_FORMS = {
    "requestBody": {
        "content": {
            "multipart/form-data": {"schema": FORM_SCHEMA},
            "application/x-www-form-urlencoded": {"schema": FORM_SCHEMA},
        }
    }
}
"""``openapi_extra`` for the routes that take forms: documents both form types beside JSON."""


class FormError(ValueError):
    """A form the server refuses; the message names the field."""


def form_to_json(items: list[tuple[str, str | UploadFile]]) -> dict[str, Any]:
    """The JSON body a form's fields stand for (the module's contract), the
    ``input_reference`` file left out (``_parse`` reads it); ``FormError`` naming the
    field when it cannot."""
    body: dict[str, Any] = {}
    references = 0
    for name, value in items:
        if name == REFERENCE or name.startswith(REFERENCE + "["):
            if isinstance(value, str):
                raise FormError(REFERENCE_AS_TEXT)
            references += 1
            if references > 1:
                raise FormError(f"{REFERENCE}: given more than once; give one video file")
            continue
        if not isinstance(value, str):
            raise FormError(f"{name}: expected a text value, got a file ({value.filename or 'unnamed'})")
        if name in body:
            raise FormError(f"{name}: given more than once; give it once")
        if value == "":
            continue
        if name in JSON_FIELDS:
            try:
                body[name] = parse_json_field(value, name)
            except JsonLimitError as error:  # too deep, or an integer too long: named within the field
                raise FormError(str(error)) from None
            except json.JSONDecodeError as error:
                raise FormError(f"{name}: not valid JSON ({error.msg}) at character {error.pos}") from None
        else:
            digits = value.strip().lstrip("+-")
            if name in INT_FIELDS and digits.isdigit() and len(digits) > MAX_JSON_INT_DIGITS:  # as in a JSON body
                raise FormError(
                    f"{name}: an integer of {len(digits)} digits; at most {MAX_JSON_INT_DIGITS} are accepted"
                )
            body[name] = value
    return body


class FormBodies:
    """ASGI middleware: a form posted to one of ``paths`` reaches the app as the
    equivalent JSON body (``form_to_json``), or is refused 422 in the project's
    error shape. Every other request passes untouched."""

    def __init__(self, app: Callable, paths: tuple[str, ...]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type not in FORM_TYPES:
            return await self.app(scope, receive, send)
        body = bytearray()
        more = True
        while more:  # already bounded by BodyLimits, outside this middleware
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if content_type == b"application/x-www-form-urlencoded" and body.lstrip()[:1] in (b"{", b"["):
            return await _refuse(send, JSON_AS_FORM)  # no form's field name begins so
        try:
            fields, reference = await _parse(scope, bytes(body))
        except FormError as error:
            return await _refuse(send, str(error))
        payload = json.dumps(fields).encode()
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": payload, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        rest = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"content-type", b"content-length")]
        json_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await self.app({**scope, "headers": rest + json_headers, INPUT_REFERENCE: reference}, replay, send)


async def _parse(scope: Scope, body: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The JSON body a form stands for, and the bytes of its ``input_reference`` file (None: none)."""
    sent = False

    async def once() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    # Without "app" in the scope Starlette raises the parser's own error, not an HTTP 400.
    request = Request({k: v for k, v in scope.items() if k != "app"}, once)
    try:
        form = await request.form()
    except MultiPartException as error:
        raise FormError(f"body: not a valid form ({error.message})") from None
    except Exception as error:  # whatever else the parser meets in a malformed body: the client's error
        raise FormError(f"body: not a valid form ({type(error).__name__}: {error})") from None
    try:
        items = list(form.multi_items())
        not_text(scope, body, items)
        fields = form_to_json(items)
        files = [value for name, value in items if name == REFERENCE and not isinstance(value, str)]
        return fields, (await files[0].read() if files else None)
    finally:
        await form.close()


def not_text(scope: Scope, body: bytes, items: list[tuple[str, str | UploadFile]]) -> None:
    """``FormError`` naming the first field whose value is not text in the form's
    charset (UTF-8 unless its content type names another). Starlette decodes
    such a value anyway: a multipart one as latin-1, an urlencoded one with
    U+FFFD for each byte it cannot read. An urlencoded field is decoded here
    strictly; a multipart value read right is in the body as it encodes, and
    one read as latin-1 from bytes that are not UTF-8 is not."""
    headers = {name.lower(): value for name, value in scope.get("headers", [])}
    content_type, params = parse_options_header(headers.get(b"content-type", b""))  # as Starlette's parser reads it
    charset = params.get(b"charset", b"utf-8").decode("latin-1") or "utf-8"
    if content_type == b"application/x-www-form-urlencoded":
        for pair in body.split(b"&"):
            name, _, value = pair.partition(b"=")
            try:
                unquote_to_bytes(value.replace(b"+", b" ")).decode(charset)
            except (UnicodeDecodeError, LookupError):
                field = unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8", errors="replace")
                raise FormError(f"{field}: not {charset} text") from None
        return
    for name, value in items:
        if isinstance(value, str):
            try:
                encoded = value.encode(charset)
            except (UnicodeEncodeError, LookupError):
                encoded = None
            if encoded is None or encoded not in body:
                raise FormError(f"{name}: not {charset} text")


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps({"error": {"code": "invalid_request", "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 422, "headers": headers})
    await send({"type": "http.response.body", "body": body})
