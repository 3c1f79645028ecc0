"""The drain's wait (``rtvideo.server.drain.Drainer``): a session is over for it once
the engine ended it and every realtime connection attached to one has
written its last event and close."""

from __future__ import annotations

import asyncio

from rtvideo.server.drain import Drainer


class _Engine:
    """The calls the drainer makes of the engine client."""

    def __init__(self, open_sessions: list[str]) -> None:
        self.sessions = open_sessions
        self.stopped: list[tuple[str, str]] = []
        self.restarts_stopped_for: str | None = None

    def no_more_restarts(self, why: str) -> None:
        self.restarts_stopped_for = why

    def open_sessions(self) -> list[str]:
        return list(self.sessions)

    async def stop(self, session_id: str, reason: str) -> None:
        self.stopped.append((session_id, reason))
        self.sessions.remove(session_id)


async def _settle() -> None:
    for _ in range(20):  # let the drain run up to its wait (no timers involved)
        await asyncio.sleep(0)


async def test_the_drain_waits_for_a_connection_still_delivering_an_end():
    capacity = asyncio.Condition()
    engine = _Engine([])
    drainer = Drainer(engine, capacity, grace_s=60)
    drainer.delivering = 1  # the engine's session is over; its client's session.done is still queued
    drain = asyncio.create_task(drainer.drain())
    await _settle()
    assert drainer.draining and not drain.done()
    drainer.delivering = 0
    async with capacity:
        capacity.notify_all()
    await asyncio.wait_for(drain, 5)
    assert engine.stopped == []  # nothing was cut short


async def test_at_the_deadline_the_sessions_left_are_stopped_as_shutdown():
    capacity = asyncio.Condition()
    engine = _Engine(["a", "b"])
    drainer = Drainer(engine, capacity, grace_s=0.0)
    await asyncio.wait_for(drainer.drain(), 15)
    assert engine.stopped == [("a", "shutdown"), ("b", "shutdown")]
    assert engine.restarts_stopped_for == "the server is shutting down"  # a worker lost now is not replaced
