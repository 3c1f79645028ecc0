"""The API process's log: one format for the server's own lines and uvicorn's,
and no secret in any of them.

API process. ``logging_config(level)`` is the ``logging.config.dictConfig``
schema that ``rtvideo serve`` hands uvicorn as its ``log_config`` (uvicorn
applies it before anything logs). Every line is timestamped and tagged
``api``, as the workers' lines are tagged ``worker[rank]`` (``rtvideo.workers.process_log``),
so one stream read by an operator, or by ``journalctl``, says which process
wrote what and when. The server's own loggers (``server.*``, ``engine.*``:
sessions that end, fail, resume or are abandoned, draining, worker restarts)
log at ``level``; other libraries only their warnings and errors, so ``debug``
is the server's detail and not every dependency's. uvicorn's access log keeps
its own fields (client, request line, status) after the same prefix, on
stdout as uvicorn writes it.

Secrets: both handlers pass every record through ``RedactSecrets``, which
masks (``***``) the value of every query parameter that carries a credential
(``SECRET_PARAMS``: the API key, and the realtime sessions' resume, watch and
control tokens), whatever the spelling of its name (percent-encoded, in any
case), the same names as JSON fields, a bearer token and the key subprotocol
(``rtvideo.key.``). ``redact_uvicorn_loggers`` puts the same filter on
uvicorn's own loggers, for an app served without this configuration.

``AnswersToGoneClients`` gives the access log its line for an answer whose
client left before it (``/v1/videos/sync``'s 499), which uvicorn never writes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, get_args
from urllib.parse import unquote_plus

from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from rtvideo.engine.config import LOG_LEVELS
from rtvideo.server.auth import API_KEY_PARAM, SUBPROTOCOL_PREFIX
from rtvideo.server.session_registry import TokenKind

PREFIX = "%(asctime)s api %(levelname)s"
OWN_LOGGERS = ("rtvideo.server", "rtvideo.engine")

SECRET_PARAMS = frozenset({API_KEY_PARAM, *get_args(TokenKind), *(f"{kind}_token" for kind in get_args(TokenKind))})
"""Names whose value is a credential: ``api_key``, each session token kind as a
query parameter (``?watch=``, ``?control=``, ``resume``) and as an event field
(``resume_token``, ``watch_token``, ``control_token``). Compared after
percent-decoding and in lower case."""

MASK = "***"
_SEPARATOR = re.compile(r"[?&;]")  # where a query parameter may begin
_NAME = re.compile(r"([^=&;?\s\"'#]+)=")
_VALUE_END = re.compile(r"[&\s]|\"(?=\s|$)|$")  # as the server splits a query: at "&" only
_FIELD = re.compile(r"(?P<lead>\"(?P<name>[A-Za-z_]+)\"\s*:\s*\")(?P<value>[^\"]*)")
_BEARER = re.compile(r"(?P<lead>\bbearer\s+)[^\s\"',]+", re.IGNORECASE)
_SUBPROTOCOL = re.compile(rf"(?P<lead>{re.escape(SUBPROTOCOL_PREFIX)})[^\s\"',]+", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether a parameter or field ``name``, as written in a URL (percent-encoded
    any number of times, ``+`` for a space), names a credential."""
    for _ in range(4):  # an encoded name decoded again, a few times over
        decoded = unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return name.strip().lower() in SECRET_PARAMS


def _mask_params(text: str) -> str:
    """Every ``NAME=VALUE`` after a ``?``, ``&`` or ``;`` whose name is a secret's,
    its value masked up to the next ``&`` or space (or a closing quote: a logged
    request line's), as the server reads it (a ``?`` or ``;`` inside does not end
    it). One pass: each character is read a bounded number of times."""
    pieces, done = [], 0
    for separator in _SEPARATOR.finditer(text):
        if separator.end() <= done:
            continue  # inside a value already masked
        name = _NAME.match(text, separator.end())
        if name is None or not is_secret_name(name[1]):
            continue
        end = _VALUE_END.search(text, name.end()).start()
        if end > name.end():
            pieces += [text[done : name.end()], MASK]
            done = end
    return "".join(pieces) + text[done:] if pieces else text


def _mask_field(match: re.Match) -> str:
    return match["lead"] + MASK if match["value"] and is_secret_name(match["name"]) else match[0]


def redact(text: str) -> str:
    """``text`` with every credential it carries replaced by ``***``."""
    if not text:
        return text
    text = _mask_params(text)
    text = _FIELD.sub(_mask_field, text)
    text = _BEARER.sub(lambda m: m["lead"] + MASK, text)
    return _SUBPROTOCOL.sub(lambda m: m["lead"] + MASK, text)


class RedactSecrets(logging.Filter):
    """Masks credentials in a record before any handler writes it. An access
    record (uvicorn's ``AccessFormatter`` reads its five args) has its string
    args masked; any other record its formatted message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
            return True
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a malformed record: the handler reports it as it would
            return True
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def redact_uvicorn_loggers() -> None:
    """Put ``RedactSecrets`` on uvicorn's access and error loggers (once each):
    the error logger records each WebSocket handshake with its full path."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


class AnswersToGoneClients:
    """ASGI middleware: an access line for an answer whose client had gone.

    uvicorn writes a request's access line as it sends the answer's start, and
    once the client has disconnected it sends nothing, so logs nothing. A route
    that saw its client go (it read ``http.disconnect``) and answers all the
    same (``/v1/videos/sync``: 499 ``client_closed``) gets that line here, in
    uvicorn's format, on uvicorn's access logger (redacted as every line is)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gone = False

        async def receive_watched() -> dict[str, Any]:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"  # before the answer: the client left
            return message

        async def send_logged(message: dict[str, Any]) -> None:
            access = logging.getLogger("uvicorn.access")
            if gone and message["type"] == "http.response.start" and access.hasHandlers():
                path = get_path_with_query_string(scope)
                client = get_client_addr(scope)
                version = scope["http_version"]
                access.info('%s - "%s %s HTTP/%s" %d', client, scope["method"], path, version, message["status"])
            await send(message)

        await self.app(scope, receive_watched, send_logged)


def logging_config(level: str) -> dict:
    """The dictConfig for an API process logging at ``level`` (one of
    ``rtvideo.engine.config.LOG_LEVELS``; ``ValueError`` naming it otherwise)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"redact": {"()": RedactSecrets}},
        "formatters": {
            "default": {"format": f"{PREFIX} %(message)s"},
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": f'{PREFIX} %(client_addr)s - "%(request_line)s" %(status_code)s',
                "use_colors": False,
            },
        },
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
                "filters": ["redact"],
            },
            "access": {
                "class": "logging.StreamHandler",
                "formatter": "access",
                "stream": "ext://sys.stdout",
                "filters": ["redact"],
            },
        },
        "root": {"handlers": ["default"], "level": "WARNING"},
        "loggers": {
            **{name: {"level": upper} for name in OWN_LOGGERS},
            "uvicorn": {"handlers": ["default"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": ["access"], "level": upper, "propagate": False},
            # The form parser warns of each malformed multipart body it meets: a client's
            # fault, answered 422 naming it (job_forms), not the operator's to read.
            "python_multipart": {"level": "ERROR"},
        },
    }
