"""API-key authentication, off unless ``ServerSettings.api_key`` is set.

A client presents the key as ``Authorization: Bearer <key>``, or (browsers,
which cannot set headers on a WebSocket) as the ``api_key`` query parameter or
the WebSocket subprotocol ``rtvideo.key.<key>``. Keys are compared in
constant time. Checked before any engine work.
"""

from __future__ import annotations

import hmac
import logging
import re

from starlette.requests import HTTPConnection

SUBPROTOCOL_PREFIX = "rtvideo.key."


def presented_keys(connection: HTTPConnection) -> list[str]:
    keys = []
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        keys.append(token.strip())
    if "api_key" in connection.query_params:
        keys.append(connection.query_params["api_key"])
    for protocol in connection.headers.get("sec-websocket-protocol", "").split(","):
        protocol = protocol.strip()
        if protocol.startswith(SUBPROTOCOL_PREFIX):
            keys.append(protocol[len(SUBPROTOCOL_PREFIX) :])
    return keys


def is_authorized(connection: HTTPConnection, api_key: str | None) -> bool:
    if api_key is None:
        return True
    expected = api_key.encode()
    # Compare every presented key, without stopping early, each in constant time.
    matches = [hmac.compare_digest(key.encode(), expected) for key in presented_keys(connection)]
    return any(matches)


def key_subprotocol(connection: HTTPConnection) -> str | None:
    """The auth subprotocol the client offered, to echo when accepting (browsers
    drop a socket whose server picks none of the offered subprotocols)."""
    for protocol in connection.headers.get("sec-websocket-protocol", "").split(","):
        if protocol.strip().startswith(SUBPROTOCOL_PREFIX):
            return protocol.strip()
    return None


_KEY_IN_QUERY = re.compile(r"(api_key=)[^&\s]*")


class RedactKeys(logging.Filter):
    """Keeps API keys given as a query parameter out of uvicorn's logs: its
    access log (HTTP requests) and its error log, where it records each
    WebSocket handshake with the full path."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = _KEY_IN_QUERY.sub(r"\1***", record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_KEY_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_access_log() -> None:
    """Install ``RedactKeys`` on uvicorn's access and error loggers (once each)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactKeys) for f in logger.filters):
            logger.addFilter(RedactKeys())
