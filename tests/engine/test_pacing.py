"""Pacing: generation stays within ``max_lead_seconds`` of the viewer's playhead.

"Held" is proved by synchronisation, not by waiting to see nothing: a session
at its budget with a reported playhead can only be freed by a new report, and
``assert_held`` shows, with two probes, that a full loop iteration after the
last chunk found nothing to run. ``barrier`` is an interaction the worker's
control plane refuses at once: its answer comes back behind everything the
worker sent the session before, and behind every control message sent before
it (a playback report included)."""

from __future__ import annotations

import itertools
import time

import pytest

from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    InteractionRejected,
    SessionDone,
    StartSession,
)
from tests.support import Collected, collect, make_gate, read_until, wait_reached

CHUNK_S = 4 / 16.0  # the stub's 4 frames at 16 fps
BUDGET = 0.5
_barriers = itertools.count()


async def barrier(handle, seen: Collected) -> None:
    """Read the session's stream up to the answer to a blank-prompt interaction:
    the worker has handled every control message sent before it, and everything
    it sent the session before is in ``seen``."""
    event_id = f"barrier-{next(_barriers)}"
    await handle.interact(event_id, Interaction(prompt=" "))
    while (await read_until(handle, InteractionRejected, seen)).event_id != event_id:
        pass


async def assert_held(engine) -> None:
    """The loop ran no plan in the iteration that answered the first probe (the
    second probe is drained in a later iteration): nothing was runnable then."""
    first = await engine.probe()
    second = await engine.probe()
    assert second.iterations == first.iterations, "the loop ran a plan: a held session was not held"
    assert second.chunks == first.chunks


async def test_a_slow_viewer_holds_generation_within_one_chunk_of_the_budget(make_engine):
    gate = make_gate(chunk=0, step=0, prompt="p")
    engine = await make_engine(step_time_s=0.002, max_sessions=2, gates=[gate])
    paced = await engine.start_session(StartSession(session_id="paced", prompt="p", max_lead_seconds=BUDGET))
    seen = Collected()
    await wait_reached(gate)  # chunk 0 is being denoised
    await engine.playback("paced", 0.0)  # the viewer sits at the start
    await barrier(paced, seen)  # the worker has the report before chunk 0 ends
    gate.release.set()
    chunks = [await read_until(paced, ChunkReady, seen) for _ in range(2)]
    assert chunks[-1].media_start_seconds + CHUNK_S == pytest.approx(BUDGET)
    await assert_held(engine)

    # Held: others run meanwhile (round-robin would have given it a turn between
    # any two of theirs), and it is still held after.
    other = await engine.start_session(StartSession(session_id="other", prompt="q", num_chunks=8))
    assert isinstance((await collect(other)).end, SessionDone)
    await assert_held(engine)
    await barrier(paced, seen)
    assert [c.generation_chunk_index for c in seen.chunks] == [0, 1]

    # An interaction while held lands at the very next chunk, which starts when
    # the viewer moves; a move of one chunk frees exactly one chunk.
    await paced.interact("e", Interaction(prompt="now"))
    playhead = CHUNK_S
    await engine.playback("paced", playhead)
    applied = await read_until(paced, InteractionApplied, seen)
    nxt = await read_until(paced, ChunkReady, seen)
    assert applied.generation_chunk_index == nxt.generation_chunk_index == 2
    assert applied.media_start_seconds - playhead <= BUDGET + CHUNK_S  # visible within lead + one chunk
    assert nxt.media_start_seconds + CHUNK_S - playhead <= BUDGET + CHUNK_S  # the lead after it
    await assert_held(engine)
    await barrier(paced, seen)
    assert [c.generation_chunk_index for c in seen.chunks] == [0, 1, 2]

    # A move of two chunks frees exactly two.
    await engine.playback("paced", playhead + 2 * CHUNK_S)
    for index in (3, 4):
        assert (await read_until(paced, ChunkReady, seen)).generation_chunk_index == index
    await assert_held(engine)
    await barrier(paced, seen)
    assert [c.generation_chunk_index for c in seen.chunks] == [0, 1, 2, 3, 4]
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
