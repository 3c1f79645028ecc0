"""A session's end is owed to its controller ``c1`` like its chunks: a session
that ends while ``c1`` is away (detached after a drop, or its socket lost with
the end still queued) stays resumable by its resume token, and the resume
gets the end; once the end reached ``c1`` or the grace is over, the
token finds nothing and the buffer is freed. Its watch and control tokens
find nothing from the end on. ``LiveSession`` with the engine's results
given by hand (the fakes of ``test_live_session_limits``)."""

from __future__ import annotations

import asyncio

import pytest

from rtvideo.engine.messages import SessionDone
from rtvideo.server.live_session import LiveSession, ResumeRefused
from tests.unit.test_live_session_limits import Viewer, session_with

DONE = SessionDone(session_id="s", chunks=0, frames=0, stopped=False, reason="completed", applied=())
GRACE_S = 0.05


class Connection(Viewer):
    """A viewer that records its close, as a connection queues it."""

    def __init__(self, role: str = "controller") -> None:
        super().__init__(role)
        self.closed: tuple[int, str] | None = None

    def session_ended(self, close_code: int, reason: str) -> None:
        self.closed = (close_code, reason)


async def ended(session: LiveSession) -> None:
    """The engine says the session completed; until the pump has handled it."""
    session.handle.results.put_nowait(DONE)
    while not session.ended:
        await asyncio.sleep(0)


def findable(session: LiveSession) -> dict[str, bool]:
    registry = session.registry
    return {
        "resume": registry.find("resume", session.resume_token) is session,
        "watch": registry.find("watch", session.watch_token) is session,
    }


def detached_gauge(session: LiveSession) -> float:
    return session.metrics.sessions_detached._value.get()


async def test_a_session_that_ends_while_detached_is_resumed_to_its_end_then_forgotten():
    session, _, c1 = await session_with(resume_grace_s=30.0)
    await session.leave(c1, "dropped")
    assert session.detached and detached_gauge(session) == 1
    await ended(session)
    assert findable(session) == {"resume": True, "watch": False}
    assert detached_gauge(session) == 0  # not a live session any more; its end is still owed

    back = Connection()
    session.resume(back, last_chunk_index=-1)
    start, done = back.events
    assert start["type"] == "video.start" and start["resumed"] is True
    assert done["type"] == "session.done" and done["reason"] == "completed"
    assert back.closed == (1000, "session done")
    assert back not in session.viewers  # nothing more will come to it
    assert findable(session)["resume"]  # until its end reached the client
    session.connection_finished(back, end_reached=True)
    assert findable(session) == {"resume": False, "watch": False}
    assert session._grace is None and len(session.buffer) == 0
    with pytest.raises(ResumeRefused, match="ended") as refused:
        session.resume(Connection(), last_chunk_index=-1)
    assert refused.value.code == "unknown_resume_token"


async def test_an_end_not_collected_within_the_grace_is_forgotten():
    session, _, c1 = await session_with(resume_grace_s=GRACE_S)
    await session.leave(c1, "dropped")
    grace = session._grace
    await ended(session)
    assert findable(session)["resume"]
    await grace  # the grace, counted from the drop, runs out
    assert findable(session) == {"resume": False, "watch": False}
    assert detached_gauge(session) == 0


async def test_an_end_that_reached_c1_is_not_kept_and_one_lost_with_the_socket_is():
    session, _, c1 = await session_with(resume_grace_s=30.0)
    await ended(session)
    await session.leave(c1, "ended")  # the connection leaves as the end is queued on it
    assert findable(session)["resume"]  # its writer has not said yet whether the end went out
    session.connection_finished(c1, end_reached=True)
    assert not findable(session)["resume"]

    session, _, c1 = await session_with(resume_grace_s=GRACE_S)
    await ended(session)
    await session.leave(c1, "ended")
    session.connection_finished(c1, end_reached=False)  # the socket dropped with the end still queued
    back = Connection()
    session.resume(back, last_chunk_index=-1)
    assert [e["type"] for e in back.events] == ["video.start", "session.done"] and back.closed is not None
    session.connection_finished(back, end_reached=False)  # lost again: the same grace, from the first loss
    await session._grace
    assert not findable(session)["resume"]


async def test_nothing_is_kept_when_c1_ended_the_session_itself_or_for_a_spectator():
    session, _, c1 = await session_with(resume_grace_s=30.0)
    spectator = Connection("spectator")
    session.join(spectator)
    await session.leave(c1, "client_disconnected")  # a close of its own: the session is stopped
    await ended(session)
    assert findable(session) == {"resume": False, "watch": False}
    assert spectator.events[-1]["type"] == "session.done" and spectator.closed is not None
    session.connection_finished(spectator, end_reached=False)  # a spectator is owed nothing
    assert session._grace is None


async def test_of_two_resumes_of_an_ended_session_one_takes_its_end():
    """The end goes to one resume at a time: a second while the first's
    connection is still taking it is refused as ``resume_token_in_use``; once
    that connection is over without the end reaching its client, a later
    resume may take it."""
    session, _, c1 = await session_with(resume_grace_s=30.0)
    await session.leave(c1, "dropped")
    await ended(session)
    first = Connection()
    session.resume(first, last_chunk_index=-1)
    with pytest.raises(ResumeRefused) as refused:
        session.resume(Connection(), last_chunk_index=-1)
    assert refused.value.code == "resume_token_in_use"
    session.connection_finished(first, end_reached=False)  # its socket went before the end reached it
    again = Connection()
    session.resume(again, last_chunk_index=-1)
    assert [event["type"] for event in again.events] == ["video.start", "session.done"]


async def test_a_resume_while_the_grace_has_run_out_and_the_session_is_being_abandoned_is_refused():
    session, engine, c1 = await session_with(resume_grace_s=GRACE_S)
    stopping, release = asyncio.Event(), asyncio.Event()

    async def slow_stop(session_id: str, reason: str) -> None:  # the engine's answer takes a while
        stopping.set()
        await release.wait()

    engine.stop = slow_stop
    await session.leave(c1, "dropped")
    await stopping.wait()  # the grace is over: the stop is on its way
    with pytest.raises(ResumeRefused, match="abandoned") as refused:
        session.resume(Connection(), last_chunk_index=-1)
    assert refused.value.code == "unknown_resume_token"
    release.set()
