"""The benches read a session's results through dispatch tables
(``rtvideo.server.dispatch``), one entry per result a session's handle yields: ``rtvideo
bench pp`` counts a session's frames and ends with it, failing on a failed
session; ``rtvideo bench engine`` measures where each interaction lands and
ends when its session does."""

from __future__ import annotations

import random
from typing import get_args

import pytest

from rtvideo.bench.engine import BenchOptions, InteractionsRun
from rtvideo.bench.pp import SessionRun
from rtvideo.engine import messages as m

# What a session's handle yields: every result naming a session but the answer to its start.
SESSION_RESULTS = {t for t in get_args(m.ResultMessage) if "session_id" in t.__struct_fields__} - {
    m.SessionStarted,
    m.SessionRejected,
}
TIMING = m.ChunkTiming(boundary_ms=0.5, denoise_ms=40.0, decode_ms=3.0, steps=4, runner_calls=(4,))


def chunk(index: int, frames: int = 4) -> m.ChunkReady:
    return m.ChunkReady(
        session_id="s",
        generation_chunk_index=index,
        num_frames=frames,
        first_frame_index=index * frames,
        media_start_seconds=0.0,
        width=8,
        height=8,
        started_event_ids=(),
        active_event_ids=(),
        completed_event_ids=(),
        timing=TIMING,
        payload=bytes([index]),
    )


DONE = m.SessionDone(session_id="s", chunks=2, frames=8, stopped=False, reason="completed", applied=())
FAILED = m.SessionFailed(session_id="s", code="pipeline_error", message="boom")


class Handle:
    """A session handle that records what the bench does with it."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.stopped = False

    async def interact(self, event_id: str, interaction: m.Interaction) -> None:
        self.sent.append(event_id)

    async def stop(self) -> None:
        self.stopped = True


def test_each_bench_has_a_handler_for_every_session_result():
    assert SessionRun("s", []).results.types == SESSION_RESULTS
    run = InteractionsRun(Handle(), BenchOptions(), random.Random(0), 0.04)
    assert run.results.types == SESSION_RESULTS


def test_bench_pp_counts_a_sessions_frames_until_it_is_done():
    payloads: list[bytes] = []
    run = SessionRun("s", payloads)
    queued = m.InteractionQueued(session_id="s", event_id="e", in_progress_chunk_index=0, expected_chunk_index=1)
    assert [run.results(message) for message in (chunk(0), queued, chunk(1, frames=5), DONE)] == [
        False,
        False,
        False,
        True,
    ]
    assert run.frames == 9 and payloads == [b"\x00", b"\x01"]


def test_bench_pp_fails_on_a_failed_session_naming_it():
    with pytest.raises(RuntimeError, match="session bench-3 did not complete: .*boom"):
        SessionRun("bench-3", []).results(FAILED)


async def test_bench_engine_measures_where_each_interaction_lands_and_ends_with_the_session():
    handle = Handle()
    run = InteractionsRun(handle, BenchOptions(interactions=2), random.Random(0), 0.0)
    assert not await run.results(chunk(0))
    await run.in_flight  # the interaction goes out at a random point of the chunk (here: at once)
    assert handle.sent == ["e1"]
    assert not await run.results(chunk(1))  # one interaction at a time: none more while e1 is out
    queued = m.InteractionQueued(session_id="s", event_id="e1", in_progress_chunk_index=1, expected_chunk_index=2)
    applied = m.InteractionApplied(
        session_id="s",
        event_id="e1",
        generation_chunk_index=2,
        first_frame_index=8,
        media_start_seconds=0.5,
        queued_to_applied_ms=12.0,
        transition_chunks=0,
    )
    assert not await run.results(queued)
    assert not await run.results(applied)
    assert run.lags == [1] and run.latencies == [12.0] and run.at_boundary == 0 and run.in_flight is None
    assert not handle.stopped  # one more to go
    superseded = m.InteractionSuperseded(session_id="s", event_id="e2", by_event_id="e3")
    with pytest.raises(RuntimeError, match="interaction e2 did not apply"):
        await run.results(superseded)
    assert await run.results(DONE)
    assert await run.results(FAILED)
