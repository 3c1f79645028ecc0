"""The API process dispatches each message family by a table of (type -> handler)
(``rtvideo.server.dispatch``): every type of a family has an entry, so a wire type or
client event added without a handler fails here; and a type without one gets
a clear error naming it (a server bug: a session's pump fails the session),
or, for a client event, the protocol's ``unknown_type`` reply."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Literal, get_args

import pytest
from pydantic import BaseModel

from rtvideo.engine import messages as m
from rtvideo.server.dispatch import TypeDispatcher, UnhandledMessageError
from rtvideo.server.jobs import Job, JobRun
from rtvideo.server.live_session import LiveSession
from rtvideo.server.metrics import Metrics
from rtvideo.server.output import SessionOutput
from rtvideo.server.realtime import Close, Event, RealtimeConnection
from rtvideo.server.schemas import CLIENT_EVENT_TYPES, ClientEvent, JobRequest, SessionResumeEvent, SessionStartEvent
from rtvideo.server.session_registry import SessionRegistry
from rtvideo.server.settings import ServerSettings
from tests.unit.test_live_session_limits import CONFIG, Engine, Handle, Viewer, end, session_with

# Every result naming a session reaches its handle, but the answer to its start,
# which EngineClient.start_session takes before there is a handle.
START_ANSWERS = {m.SessionStarted, m.SessionRejected}
SESSION_RESULTS = {t for t in get_args(m.ResultMessage) if "session_id" in t.__struct_fields__} - START_ANSWERS
NON_MEDIA_RESULTS = SESSION_RESULTS - {m.ChunkReady}
# Where an interaction landed, or why not: the results about one interaction but its answer (queued).
INTERACTION_OUTCOMES = {t for t in SESSION_RESULTS if "event_id" in t.__struct_fields__} - {m.InteractionQueued}
CLIENT_EVENTS = set(get_args(get_args(ClientEvent)[0]))


def job() -> Job:
    return Job("video_1", JobRequest(prompt="p"), CONFIG, ttl_s=60.0)


def job_run() -> JobRun:
    return JobRun(job(), SessionOutput("video_1", CONFIG, Metrics(lambda: True)), store=None, feeder=None)


def connection(role: str) -> RealtimeConnection:
    conn = RealtimeConnection(None, None, ServerSettings(), "stub", Metrics(lambda: True), None)
    conn.role = role
    conn.session = SimpleNamespace(request_id="rtv-1")
    return conn


def sent(conn: RealtimeConnection) -> list[dict | Close]:
    """What is queued on the connection's outbox, in order: events as JSON objects."""
    items = []
    while not conn.outbox.empty():
        item = conn.outbox.get_nowait()
        items.append(json.loads(item.text) if isinstance(item, Event) else item)
    return items


class SessionFooEvent(BaseModel):
    """A client event no table knows."""

    type: Literal["session.foo"] = "session.foo"


# -- every type of each family has a handler ---------------------------------------------


def test_the_families_are_what_the_wire_modules_declare():
    assert m.ChunkReady in SESSION_RESULTS and m.SessionDone in NON_MEDIA_RESULTS and len(NON_MEDIA_RESULTS) == 6
    assert INTERACTION_OUTCOMES == {m.InteractionApplied, m.InteractionSuperseded, m.InteractionRejected}
    literals = {get_args(event.model_fields["type"].annotation)[0] for event in CLIENT_EVENTS}
    assert literals == set(CLIENT_EVENT_TYPES)  # what the parser takes is what the tables handle


async def test_every_session_result_has_a_live_session_handler():
    session, _, _ = await session_with()
    assert session._results.types == SESSION_RESULTS
    end(session)


def test_every_non_media_result_has_an_event_and_a_count():
    output = SessionOutput("rtv-1", CONFIG, Metrics(lambda: True))
    assert output._events.types == NON_MEDIA_RESULTS
    assert output._counts.types == NON_MEDIA_RESULTS


def test_every_session_result_has_a_job_run_handler():
    assert job_run()._results.types == SESSION_RESULTS


def test_every_interaction_outcome_has_a_job_record():
    assert job()._outcomes.types == INTERACTION_OUTCOMES


def test_every_client_event_has_a_handler_in_each_role():
    conn = connection("controller")
    assert set(conn._events_by_role) == {"controller", "spectator"}
    for role, events in conn._events_by_role.items():
        assert events.types == CLIENT_EVENTS, role
    assert conn._openers.types == {SessionStartEvent, SessionResumeEvent}  # any other first event is refused


# -- a type without a handler ------------------------------------------------------------


def test_a_dispatcher_names_the_type_it_has_no_handler_for():
    table = TypeDispatcher("test family", {int: lambda n: n + 1, str: str.upper})
    assert table(1) == 2 and table("a") == "A"
    with pytest.raises(UnhandledMessageError) as unhandled:
        table(1.5)
    assert str(unhandled.value) == "test family: no handler for a float message (handled: int, str)"
    assert TypeDispatcher("f", {}, on_unknown=lambda message: f"unknown {message!r}")(1.5) == "unknown 1.5"


def test_session_output_refuses_a_result_it_has_no_event_for_by_name():
    output = SessionOutput("rtv-1", CONFIG, Metrics(lambda: True))
    rejected = m.SessionRejected(session_id="s", code="server_full", message="full")
    with pytest.raises(UnhandledMessageError, match="SessionOutput.count: no handler for a SessionRejected message"):
        output.event(rejected)
    with pytest.raises(UnhandledMessageError, match="SessionOutput.event: no handler for a SessionRejected message"):
        output._events(rejected)


async def test_a_job_run_records_each_outcome_and_names_a_type_it_has_no_handler_for():
    run = job_run()
    applied = m.InteractionApplied(
        session_id="video_1", event_id="scheduled-0", generation_chunk_index=2, first_frame_index=10,
        media_start_seconds=0.625, queued_to_applied_ms=0.0, transition_chunks=0,
    )  # fmt: skip
    await run.result(applied)
    await run.result(m.InteractionSuperseded(session_id="video_1", event_id="scheduled-1", by_event_id="scheduled-2"))
    rejected = m.InteractionRejected(
        session_id="video_1", event_id="scheduled-2", code="interaction_too_late", message="late"
    )
    await run.result(rejected)
    assert run.job.outcomes == {
        "scheduled-0": {"status": "applied", "generation_chunk_index": 2, "first_frame_index": 10,
                        "media_start_seconds": 0.625},
        "scheduled-1": {"status": "superseded", "by_event_id": "scheduled-2"},
        "scheduled-2": {"status": "rejected", "error": {"code": "interaction_too_late", "message": "late"}},
    }  # fmt: skip
    with pytest.raises(UnhandledMessageError, match="JobRun result: no handler for a SessionRejected message"):
        await run.result(m.SessionRejected(session_id="video_1", code="server_full", message="full"))
    with pytest.raises(UnhandledMessageError, match="Job outcome: no handler for a InteractionQueued message"):
        run.job.record(m.InteractionQueued(session_id="video_1", event_id="e", in_progress_chunk_index=None,
                                           expected_chunk_index=0, duplicate=False))  # fmt: skip


@pytest.mark.parametrize(
    ("reason", "status", "error"),
    [
        ("completed", "completed", None),
        ("cancelled", "cancelled", None),
        ("shutdown", "failed", "interrupted_by_restart"),
        ("parent_exited", "failed", "interrupted_by_restart"),
    ],
)
async def test_a_jobs_end_is_its_sessions(reason, status, error):
    run = job_run()
    done = m.SessionDone(
        session_id="video_1", chunks=0, frames=0, stopped=reason != "completed", reason=reason, applied=()
    )
    await run.result(done)
    assert run.job.status == status and (run.job.error or {}).get("code") == error


async def test_a_failed_session_fails_its_job_with_its_code():
    run = job_run()
    await run.result(m.SessionFailed(session_id="video_1", code="pipeline_error", message="boom"))
    assert (run.job.status, run.job.error) == ("failed", {"code": "pipeline_error", "message": "boom"})


class EndingHandle(Handle):
    """A handle whose stream ends with the session's end, as ``SessionHandle``'s does."""

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        message = await self.results.get()
        self.finished = isinstance(message, m.SessionDone | m.SessionFailed)
        return message

    async def next(self, timeout: float | None = None):
        return await self.__anext__()


class StoppingEngine(Engine):
    async def stop(self, session_id: str, reason: str) -> None:
        done = m.SessionDone(session_id=session_id, chunks=0, frames=0, stopped=True, reason=reason, applied=())
        self.handle.results.put_nowait(done)


async def test_a_result_without_a_handler_fails_its_session_naming_the_type(caplog):
    metrics = Metrics(lambda: True)
    handle = EndingHandle()
    output = SessionOutput("rtv-1", CONFIG, metrics)
    session = LiveSession(handle, output, StoppingEngine(handle), ServerSettings(), metrics, SessionRegistry())
    controller = Viewer()
    session.attach_first(controller)
    with caplog.at_level(logging.ERROR, logger="rtvideo.server.live_session"):
        handle.results.put_nowait(m.SessionRejected(session_id="s", code="server_full", message="full"))
        await session.close()
    assert "LiveSession result: no handler for a SessionRejected message" in caplog.text
    failure = [e for e in controller.events if e["type"] == "error"]
    assert failure == [{"type": "error", "code": "internal_error", "message": "the server failed this session",
                        "fatal": True, "request_id": "rtv-1"}]  # fmt: skip
    assert session.ended


@pytest.mark.parametrize("role", ["controller", "spectator"])
async def test_a_client_event_without_a_handler_gets_the_unknown_type_error(role):
    conn = connection(role)
    assert await conn._events_by_role[role](SessionFooEvent()) is None  # the connection reads on
    [error] = sent(conn)
    assert error["code"] == "unknown_type" and error["request_id"] == "rtv-1" and not error["fatal"]
    assert error["message"].startswith("unknown message type 'session.foo'; known: session.start, session.resume")


async def test_a_first_event_that_neither_starts_nor_resumes_is_refused():
    conn = connection("controller")
    conn.session = None
    await conn._openers(SessionFooEvent())
    error, close = sent(conn)
    assert error["code"] == "start_required" and error["fatal"] and close.code == 1008
    assert error["message"] == "the first message must be session.start or session.resume, not session.foo"
