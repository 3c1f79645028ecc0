"""A follower's decode thread (``DecodeServer``) that cannot go on: rank 0 gone
ends it quietly (the process ends with rank 0); anything else ends the rank,
saying why, so that rank 0 sees a rank's death and fails the group's sessions
instead of waiting for the decodes they need for ever. A connection that
raises stands in for the rank's sockets; the thread and its handling are real."""

from __future__ import annotations

import logging
import threading
import types

import pytest

from rtvideo.workers.parallel import decode_server
from rtvideo.workers.parallel.sockets import PeerClosed
from rtvideo.workers.pipelines.stub import StubPipeline


class FailingSockets:
    """A follower's sockets whose decode connection raises ``error`` on the first
    take, once ``go`` is set (after calling ``before_raise``, if any)."""

    rank = 1

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.go = threading.Event()
        self.before_raise = None

    def take(self, peer, kinds, tag, timeout_s, what):
        assert self.go.wait(10)
        if self.before_raise is not None:
            self.before_raise()
        raise self.error

    def post(self, peer, kind, tag, message):
        raise AssertionError("nothing to answer")


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """The codes the decode thread ended the process with (it is not ended)."""
    codes: list[int] = []
    monkeypatch.setattr(decode_server, "os", types.SimpleNamespace(_exit=codes.append))
    return codes


def serve(error: BaseException, closing: bool = False) -> None:
    sockets = FailingSockets(error)
    server = decode_server.DecodeServer(StubPipeline(), {}, sockets)
    if closing:  # the rank stops while the thread waits, and its sockets close under it
        sockets.before_raise = server._closing.set
    sockets.go.set()
    server._thread.join(10)
    assert not server._thread.is_alive()


def test_a_broken_decode_connection_ends_the_rank_saying_why(exits, caplog):
    with caplog.at_level(logging.ERROR, logger=decode_server.__name__):
        serve(RuntimeError("rank 1: 4096 frames from rank 0 nobody asked for"))
    assert exits == [2]
    assert "pipeline rank 1: the decode thread failed; the rank ends" in caplog.text
    assert "4096 frames from rank 0 nobody asked for" in caplog.text


def test_rank_0_gone_ends_only_the_thread(exits):
    serve(PeerClosed("rank 0 closed its connection"))
    assert exits == []


def test_a_failure_while_the_rank_stops_ends_only_the_thread(exits):
    serve(RuntimeError("the socket closed under a decode"), closing=True)
    assert exits == []
