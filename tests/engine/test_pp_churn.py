"""Sessions churning through two pipeline ranks: a seeded script of sessions
that join while others are in the ring, at different lengths and steps, some
stopped mid-pipeline (before their first chunk, or with chunks in flight),
some sent a new prompt while they run, all at once.

Every session ends exactly once and cleanly, its chunks in order from 0;
every prompt sent ends exactly once; nothing stays held on rank 0 once the
last one ended, and the ranks serve on. Without stream batch every session,
the stopped ones included, made bit for bit what one rank makes of the same
start with its replay log: a stop or a neighbour joining and leaving never
touches another session's cache. With stream batch (chunks of a session in
the ring together, which changes the frames by design) the same invariants
hold, and a session's first chunk (nothing before it to run ahead of) is
what the same start makes on its own.

The scripts run one after another on one pair of engines, so sessions reuse
the ids of earlier scripts' sessions. CI runs two; ``RTVIDEO_CHURN_SCRIPTS=N``
runs N, a soak (about 3 s a script here, one-rank replays included).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from dataclasses import dataclass

import pytest
import pytest_asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import UnknownSessionError
from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
    StartSession,
)
from tests.engine.test_pipeline_parallel import payloads, run_sessions, start_engine, start_of
from tests.support import Collected

SHARED = pytest.mark.asyncio(loop_scope="module")
SESSIONS = 8
SCRIPTS = int(os.environ.get("RTVIDEO_CHURN_SCRIPTS", "2"))


@dataclass(frozen=True)
class Plan:
    """One session of the script."""

    start: StartSession
    after: tuple[str, int] | None  # begin once that session made that many chunks (or ended); None: at once
    prompt_after: int | None  # send a new prompt once this many chunks are in; None: never
    stop_after: int | None  # stop once this many chunks are in (0: as soon as it started); None: never


def script(seed: int) -> list[Plan]:
    """``SESSIONS`` plans drawn from ``seed``: open-ended sessions are always stopped."""
    rng = random.Random(seed)
    plans: list[Plan] = []
    for i in range(SESSIONS):
        chunks = rng.choice([None, 2, 3, 4, 5])
        steps = rng.choice([1, 2, 4])
        start = start_of(f"s{i}", 100 * seed + i, chunks, num_inference_steps=steps)
        after = (f"s{rng.randrange(i)}", rng.choice([0, 1, 2])) if i else None
        if chunks is None:
            stop_after = rng.choice([0, 1, 2, 3])
        else:
            stop_after = rng.choice([None, None, 0, *range(1, chunks)])
        prompt_after = rng.choice([None, 1, 2])
        plans.append(Plan(start, after, prompt_after, stop_after))
    return plans


class Progress:
    """Chunks each session made so far, and which ended: what later sessions wait on."""

    def __init__(self) -> None:
        self.chunks: dict[str, int] = {}
        self.ended: set[str] = set()
        self.changed = asyncio.Condition()

    async def note(self, sid: str, chunks: int, ended: bool = False) -> None:
        async with self.changed:
            self.chunks[sid] = chunks
            if ended:
                self.ended.add(sid)
            self.changed.notify_all()

    async def reached(self, sid: str, chunks: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.chunks.get(sid, -1) >= chunks or sid in self.ended)


async def drive(engine: EngineClient, plan: Plan, progress: Progress) -> Collected:
    """Run one plan to its session's end; everything the session said, in order."""
    if plan.after is not None:
        await progress.reached(*plan.after)
    sid = plan.start.session_id
    handle: SessionHandle = await engine.start_session(plan.start)
    await progress.note(sid, 0)
    seen = Collected()
    prompted = stopped = False
    while True:
        made = len(seen.chunks)
        # The session may have ended already, its last word queued here and not
        # yet read: the client then refuses the call (UnknownSessionError), and
        # the prompt counts as one that came after the end.
        if plan.prompt_after is not None and not (prompted or stopped) and made >= plan.prompt_after:
            with contextlib.suppress(UnknownSessionError):
                await handle.interact("p", Interaction(prompt=f"a new prompt for {sid}"))
            prompted = True
        if plan.stop_after is not None and not stopped and made >= plan.stop_after:
            with contextlib.suppress(UnknownSessionError):
                await handle.stop()
            stopped = True
        message = await handle.next(120.0)
        seen.messages.append(message)
        if isinstance(message, ChunkReady):
            await progress.note(sid, len(seen.chunks))
        elif isinstance(message, SessionDone | SessionFailed):
            await progress.note(sid, len(seen.chunks), ended=True)
            return seen


async def churn(engine: EngineClient, plans: list[Plan]) -> dict[str, Collected]:
    progress = Progress()
    runs = [drive(engine, plan, progress) for plan in plans]
    results = await asyncio.wait_for(asyncio.gather(*runs), timeout=240)
    return {plan.start.session_id: result for plan, result in zip(plans, results, strict=True)}


def check_ends(plans: list[Plan], got: dict[str, Collected]) -> None:
    """Each session ended once, cleanly, chunks in order; each prompt ended once."""
    for plan in plans:
        sid, result = plan.start.session_id, got[plan.start.session_id]
        assert isinstance(result.end, SessionDone), f"{sid}: {result.end}"
        assert sum(isinstance(m, SessionDone) for m in result.messages) == 1
        indices = [chunk.generation_chunk_index for chunk in result.chunks]
        assert indices == list(range(len(indices))), f"{sid}: chunks {indices}"
        assert result.end.chunks == len(indices)
        wanted = plan.start.num_chunks
        if plan.stop_after is None:
            assert result.end.reason == "completed" and len(indices) == wanted, f"{sid}: {result.end}"
        else:
            assert result.end.reason in ("stopped", "completed"), f"{sid}: {result.end}"
            assert wanted is None or len(indices) <= wanted
        ends = result.of(InteractionApplied) + result.of(InteractionSuperseded) + result.of(InteractionRejected)
        if result.of(InteractionQueued):  # a queued prompt ends once, before its session's last word
            assert [m.event_id for m in ends] == ["p"], f"{sid}: {ends}"
        else:  # refused at once (too late, stopping), or it came after the session ended: nothing here
            assert all(isinstance(m, InteractionRejected) for m in ends) and len(ends) <= 1, f"{sid}: {ends}"
        landed = [m.event_id for m in result.of(InteractionApplied) if m.generation_chunk_index < len(indices)]
        assert [a.event_id for a in result.end.applied] == landed  # the log of what was delivered


def replay_of(plan: Plan, result: Collected) -> StartSession:
    """One rank's start for what ``result`` delivered: as many chunks, its replay log scheduled."""
    start = plan.start
    scheduled = tuple(
        ScheduledInteraction(
            at_chunk=a.at_chunk,
            event_id=a.event_id,
            interaction=Interaction(prompt=a.prompt, transition_chunks=a.transition_chunks),
        )
        for a in result.end.applied
    )
    return start_of(
        start.session_id,
        start.seed,
        len(result.chunks),
        num_inference_steps=start.num_inference_steps,
        scheduled=scheduled,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_rank():
    engine = await start_engine(1, max_batch_rows=2, max_sessions=SESSIONS)
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_ranks():
    engine = await start_engine(2, max_batch_rows=2, max_sessions=SESSIONS)
    yield engine
    await engine.shutdown()


@SHARED
@pytest.mark.parametrize("seed", range(1, SCRIPTS + 1))
async def test_churn_through_two_ranks_ends_every_session_once_with_one_ranks_frames(seed, one_rank, two_ranks):
    plans = script(seed)
    got = await churn(two_ranks, plans)
    check_ends(plans, got)
    probe = await two_ranks.probe()
    assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()

    delivered = [plan for plan in plans if got[plan.start.session_id].chunks]
    expected = await run_sessions(one_rank, [replay_of(plan, got[plan.start.session_id]) for plan in delivered])
    for plan in delivered:
        sid = plan.start.session_id
        assert payloads(got[sid]) == payloads(expected[sid]), f"{sid} differs from one rank's ({plan})"

    after = await run_sessions(two_ranks, [start_of("after", 7, 2)])  # the ranks serve on
    assert isinstance(after["after"].end, SessionDone) and len(after["after"].chunks) == 2


async def test_churn_with_stream_batch_ends_every_session_once():
    # The decoders split (auto spreads them, as in the churn above): both placements see churn.
    two = await start_engine(2, max_batch_rows=2, max_sessions=SESSIONS, stream_batch=True, pp_decode="split")
    try:
        plans = script(3)
        got = await churn(two, plans)
        check_ends(plans, got)
        probe = await two.probe()
        assert probe.sessions == probe.runner_sessions == probe.pipeline_sessions == ()
        firsts = [plan for plan in plans if got[plan.start.session_id].chunks]
        alone = await run_sessions(two, [replay_of(plan, got[plan.start.session_id]) for plan in firsts[:2]])
        for plan in firsts[:2]:  # chunk 0 has nothing before it: neither stream batch nor churn changes it
            sid = plan.start.session_id
            assert payloads(got[sid])[0] == payloads(alone[sid])[0], sid
    finally:
        await two.shutdown()
