"""``rtvideo.server.logs.redact``: every credential a log line can carry is masked,
whatever the spelling of its name, and nothing else changes."""

from __future__ import annotations

import logging

import pytest

from rtvideo.server.logs import RedactSecrets, redact


@pytest.mark.parametrize(
    "line, masked",
    [
        ('1.2.3.4:5 - "GET /v?api_key=S HTTP/1.1" 200', '1.2.3.4:5 - "GET /v?api_key=*** HTTP/1.1" 200'),
        ("/v1/models?api%5Fkey=S&limit=2", "/v1/models?api%5Fkey=***&limit=2"),
        ("/v1/models?%61%70%69%5f%6b%65%79=S", "/v1/models?%61%70%69%5f%6b%65%79=***"),
        ("/v1/models?api%255Fkey=S", "/v1/models?api%255Fkey=***"),  # encoded twice
        ("/v1/models?API_KEY=S", "/v1/models?API_KEY=***"),
        ('"WebSocket /v?watch=S&format=fmp4" [accepted]', '"WebSocket /v?watch=***&format=fmp4" [accepted]'),
        ('"WebSocket /v1/realtime/video?w%61tch=S" 403', '"WebSocket /v1/realtime/video?w%61tch=***" 403'),
        ("/v1/realtime/video?format=raw&control=S", "/v1/realtime/video?format=raw&control=***"),
        ("/x?a=1?api_key=S?T&b=2", "/x?a=1?api_key=***&b=2"),  # a "?" inside a value does not end it
        ("/x?resume_token=S", "/x?resume_token=***"),
        ("< Authorization: Bearer S", "< Authorization: Bearer ***"),
        ("< Sec-WebSocket-Protocol: rtvideo.key.S, x", "< Sec-WebSocket-Protocol: rtvideo.key.***, x"),
        ('{"type": "session.resume", "resume_token": "S"}', '{"type": "session.resume", "resume_token": "***"}'),
        ('{"watch_token": "S", "control_token": "S"}', '{"watch_token": "***", "control_token": "***"}'),
    ],
)
def test_every_spelling_of_a_credential_is_masked(line, masked):
    assert redact(line) == masked


@pytest.mark.parametrize(
    "line", ["/v1/videos?limit=20&order=asc", "/x?format=fmp4&api_key=", "session rtv-1 ended: stopped", ""]
)
def test_a_line_without_a_credential_is_unchanged(line):
    assert redact(line) == line


def test_the_filter_masks_an_access_record_s_args_and_any_other_record_s_message():
    access = logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', None, None)
    access.args = ("1.2.3.4:5", "GET", "/v1/models?api_key=S", "1.1", 200)
    assert RedactSecrets().filter(access) and access.args[2] == "/v1/models?api_key=***"
    other = logging.LogRecord("uvicorn.error", 20, "", 0, '%s - "WebSocket %s"', ("1.2.3.4:5", "/v?watch=S"), None)
    assert RedactSecrets().filter(other) and other.getMessage() == '1.2.3.4:5 - "WebSocket /v?watch=***"'
