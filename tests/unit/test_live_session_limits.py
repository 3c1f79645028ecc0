"""``LiveSession``'s per-session bounds, with the engine's answers made by a real
mailbox: what it keeps per ``event_id`` stays bounded however many
interactions a session sends; interactions past the rate are answered
``rate_limited`` and never reach the engine; spectators past the cap are refused;
an interaction that meets the session's end is answered, never lost."""

from __future__ import annotations

import asyncio

import pytest

from rtvideo.engine.client.errors import UnknownSessionError
from rtvideo.engine.mailbox import EVENT_ID_WINDOW, InteractionMailbox, OfferStatus
from rtvideo.engine.messages import Interaction, InteractionQueued, InteractionSuperseded
from rtvideo.server.live_session import JoinRefused, LiveSession
from rtvideo.server.metrics import Metrics
from rtvideo.server.output import SessionOutput
from rtvideo.server.schemas import EffectiveConfig
from rtvideo.server.session_registry import SessionRegistry
from rtvideo.server.settings import ServerSettings

CONFIG = EffectiveConfig(
    model="stub", prompt="p", negative_prompt="", seed=0, width=4, height=4, fps=16.0, num_frames=None,
    num_chunks=None, first_chunk_frames=1, frames_per_chunk=1, num_inference_steps=1, format="raw",
    transition_chunks=0, prompt_change="soft", max_lead_seconds=None,
)  # fmt: skip


class Handle:
    """The engine's side of one session: its results, in order."""

    session_id = "s"
    finished = False

    def __init__(self) -> None:
        self.results: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.results.get()


class Engine:
    """Answers interactions as the worker's control plane does, from a real mailbox."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.mailbox = InteractionMailbox(default_transition_chunks=0)
        self.received: list[str] = []
        self.ended = False  # the session's end came from the worker: the client refuses what follows, as it does

    async def interact(self, session_id: str, event_id: str, interaction: Interaction) -> None:
        if self.ended:
            raise UnknownSessionError(f"no open session {session_id!r}")
        self.received.append(event_id)
        offer = self.mailbox.offer(event_id, interaction, now=0.0)
        assert offer.status is not OfferStatus.CONFLICT
        if offer.superseded is not None:
            old = offer.superseded.event_id
            superseded = InteractionSuperseded(session_id=session_id, event_id=old, by_event_id=event_id)
            self.handle.results.put_nowait(superseded)
        queued = InteractionQueued(
            session_id=session_id,
            event_id=event_id,
            in_progress_chunk_index=None,
            expected_chunk_index=0,
            duplicate=offer.status is OfferStatus.DUPLICATE,
        )
        self.handle.results.put_nowait(queued)

    async def stop(self, session_id: str, reason: str) -> None:
        pass

    async def delivered(self, session_id: str, media_seconds: float) -> None:
        pass


class Viewer:
    def __init__(self, role: str = "controller") -> None:
        self.role = role
        self.controller_id: str | None = None
        self.format: str | None = None
        self.events: list[dict] = []

    def send_event(self, event: dict) -> None:
        self.events.append(event)

    def send_chunk(self, chunk) -> None:
        pass

    def session_ended(self, close_code: int, reason: str) -> None:
        pass

    def drop_slow(self, why: str) -> None:
        pass


async def session_with(**settings) -> tuple[LiveSession, Engine, Viewer]:
    metrics = Metrics(lambda: True)
    handle = Handle()
    engine = Engine(handle)
    output = SessionOutput("rtv-1", CONFIG, metrics)
    session = LiveSession(handle, output, engine, ServerSettings(**settings), metrics, SessionRegistry())
    controller = Viewer()
    session.attach_first(controller)
    return session, engine, controller


async def settled(session: LiveSession) -> None:
    """Until the pump has taken every result the engine gave."""
    while not session.handle.results.empty():
        await asyncio.sleep(0)
    await asyncio.sleep(0)


def end(session: LiveSession) -> None:
    session._pump_task.cancel()
    session._limit_task.cancel()


async def test_what_a_session_keeps_per_event_id_stays_bounded_after_10000_interactions():
    session, engine, controller = await session_with(max_interactions_per_s=1e9, interaction_burst=10**6)
    for i in range(10_000):
        await session.interact(controller, f"e{i}", Interaction(prompt=f"p{i}"))
        if i % 100 == 99:
            await settled(session)
    await settled(session)
    assert len(engine.received) == 10_000
    assert len(session.output.senders) == EVENT_ID_WINDOW  # which controller sent each of the newest ids
    assert engine.mailbox.remembered_ids == EVENT_ID_WINDOW
    assert session._answer_to == {}  # every answer found its controller
    assert list(session.output._queued) == ["e9999"]  # the superseded ones never apply: not kept
    superseded = [e for e in controller.events if e["type"] == "session.interaction.superseded"]
    assert superseded[-1]["event_id"] == "e9998" and superseded[-1]["controller"] == "c1"
    assert superseded[-1]["by_controller"] == "c1"
    end(session)


async def test_interactions_past_the_burst_are_answered_rate_limited_and_never_reach_the_engine():
    session, engine, controller = await session_with(max_interactions_per_s=2.0, interaction_burst=3)
    for i in range(5):
        await session.interact(controller, f"e{i}", Interaction(prompt="p"))
    await settled(session)
    assert engine.received == ["e0", "e1", "e2"]
    limited = [e for e in controller.events if e["type"] == "error"]
    assert [e["event_id"] for e in limited] == ["e3", "e4"]
    for error in limited:
        assert (error["code"], error["fatal"], error["request_id"]) == ("rate_limited", False, "rtv-1")
        assert "at most 2 per second (max_interactions_per_s), 3 at once (interaction_burst)" in error["message"]
    queued = [e["event_id"] for e in controller.events if e["type"] == "session.interaction.queued"]
    assert queued == ["e0", "e1", "e2"]
    assert [event for _, event in session.kept if event["type"] == "error"] == limited  # a resume gets them too
    end(session)


async def test_a_spectator_past_max_spectators_is_refused_and_a_controller_is_not_counted():
    session, _, _ = await session_with(max_spectators=2)
    for _ in range(2):
        session.join(Viewer("spectator"))
    with pytest.raises(JoinRefused) as refused:
        session.join(Viewer("spectator"))
    assert refused.value.code == "too_many_spectators" and refused.value.close_code == 1013
    assert "max_spectators = 2" in refused.value.message
    session.join(Viewer("controller"))  # controllers are not spectators
    assert sum(v.role == "spectator" for v in session.viewers) == 2
    gone = next(v for v in session.viewers if v.role == "spectator")
    await session.leave(gone, "client_disconnected")
    session.join(Viewer("spectator"))  # a place came free
    end(session)


async def test_an_interaction_that_meets_the_sessions_end_is_answered_session_ended():
    """The engine's end of the session arrived, and the pump has not yet told the
    viewers: an interaction sent then is answered with its event_id (a resume gets
    it too)."""
    session, engine, controller = await session_with()
    engine.ended = True
    await session.interact(controller, "late", Interaction(prompt="p"))
    errors = [e for e in controller.events if e["type"] == "error"]
    assert [(e["code"], e["event_id"], e["fatal"]) for e in errors] == [("session_ended", "late", False)]
    assert "ended before this interaction reached a chunk boundary" in errors[0]["message"]
    assert session._answer_to == {}  # no answer is awaited from the engine
    assert [event for _, event in session.kept if event["type"] == "error"] == errors
    end(session)
