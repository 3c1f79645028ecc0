"""API-key authentication, off unless ``ServerSettings.api_key`` is set.

A client presents the key as ``Authorization: Bearer <key>``, or (browsers,
which cannot set headers on a WebSocket) as the ``api_key`` query parameter or
the WebSocket subprotocol ``rtvideo.key.<key>``. Keys are compared in
constant time. Checked before any engine work. A key never reaches the log
(``rtvideo.server.logs.RedactSecrets``).
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection

SUBPROTOCOL_PREFIX = "rtvideo.key."
API_KEY_PARAM = "api_key"


def presented_keys(connection: HTTPConnection) -> list[str]:
    keys = []
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token:
        keys.append(token.strip())
    if API_KEY_PARAM in connection.query_params:
        keys.append(connection.query_params[API_KEY_PARAM])
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
