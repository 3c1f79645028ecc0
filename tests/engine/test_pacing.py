"""Pacing: generation stays within ``max_lead_seconds`` of the viewer's playhead."""

from __future__ import annotations

import time

import pytest

from engine.messages import ChunkReady, Interaction, InteractionApplied, SessionDone, StartSession
from tests.support import Collected, collect, read_until

CHUNK_S = 4 / 16.0  # the stub's 4 frames at 16 fps
BUDGET = 0.5


async def no_chunk_within(handle, seconds: float) -> None:
    """Assert the session stays held: nothing but non-chunk messages for ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await handle.next(left)
        except TimeoutError:
            return
        assert not isinstance(message, ChunkReady), f"chunk {message.generation_chunk_index} was not held back"


async def test_a_slow_viewer_holds_generation_within_one_chunk_of_the_budget(make_engine):
    engine = await make_engine(step_time_s=0.002, max_sessions=2)
    paced = await engine.start_session(StartSession(session_id="paced", prompt="p", max_lead_seconds=BUDGET))
    await engine.playback("paced", 0.0)  # the viewer sits at the start
    seen = Collected()
    chunks = [await read_until(paced, ChunkReady, seen) for _ in range(2)]
    assert chunks[-1].media_start_seconds + CHUNK_S == pytest.approx(BUDGET)

    # Held: others run meanwhile.
    other = await engine.start_session(StartSession(session_id="other", prompt="q", num_chunks=8))
    assert isinstance((await collect(other)).end, SessionDone)
    await no_chunk_within(paced, 0.4)

    # An interaction while held lands at the very next chunk, which starts when the viewer moves.
    await paced.interact("e", Interaction(prompt="now"))
    playhead = CHUNK_S
    await engine.playback("paced", playhead)
    applied = await read_until(paced, InteractionApplied, seen)
    nxt = await read_until(paced, ChunkReady, seen)
    assert applied.generation_chunk_index == nxt.generation_chunk_index == 2
    assert applied.media_start_seconds - playhead <= BUDGET + CHUNK_S  # visible within lead + one chunk
    assert nxt.media_start_seconds + CHUNK_S - playhead <= BUDGET + CHUNK_S  # the lead after it
    await no_chunk_within(paced, 0.4)
    await paced.stop()
    assert isinstance((await collect(paced)).end, SessionDone)


async def test_without_reports_generation_follows_real_time(make_engine):
    engine = await make_engine(step_time_s=0.001)
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", max_lead_seconds=BUDGET, num_chunks=8))
    started = time.monotonic()
    result = await collect(handle, timeout=10)
    elapsed = time.monotonic() - started
    # 8 chunks are 2 s of media; at most BUDGET ahead of real time, so it takes at least 2 - 0.5 - one chunk.
    assert elapsed >= 8 * CHUNK_S - BUDGET - CHUNK_S
    assert isinstance(result.end, SessionDone) and result.end.chunks == 8


async def test_a_viewer_that_keeps_up_holds_nothing_back(make_engine):
    engine = await make_engine(step_time_s=0.001)
    handle = await engine.start_session(
        StartSession(session_id="s", prompt="p", max_lead_seconds=BUDGET, num_chunks=20)
    )
    started = time.monotonic()
    seen = Collected()
    while True:
        message = await handle.next(10)
        seen.messages.append(message)
        if isinstance(message, ChunkReady):  # the viewer is always at the newest frame
            await engine.playback("s", message.media_start_seconds + CHUNK_S)
        if isinstance(message, SessionDone):
            break
    elapsed = time.monotonic() - started
    assert len(seen.chunks) == 20
    assert elapsed < 20 * CHUNK_S / 2, f"{elapsed:.2f} s for 5 s of media: something was held back"


async def test_pacing_off_runs_at_full_speed(make_engine):
    engine = await make_engine(step_time_s=0.001)
    started = time.monotonic()
    result = await collect(await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=20)))
    assert result.end.chunks == 20 and time.monotonic() - started < 20 * CHUNK_S / 2
