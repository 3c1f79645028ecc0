"""Stream batch through real worker processes: the tiny model's blocks on two
ranks over gloo, a session's next chunk entering the ring while the chunk
before it is still being denoised (``EngineConfig.stream_batch``), against the
exact output of one rank."""

from __future__ import annotations

import numpy as np

from rtvideo.engine.messages import InteractionApplied, SessionDone
from tests.engine.test_pipeline_parallel import interact_once, payloads, run_sessions, start_engine, start_of


def frames(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, np.uint8).astype(np.int16)


async def test_stream_batch_runs_ahead_in_order_differs_only_after_chunk_0_and_lands_interactions_where_it_says():
    """Chunk 0 has nothing before it: bit for bit the exact one. Every later
    chunk attended to the chunk before it part-denoised, so it differs, by a
    bounded amount (``bench pp`` measures it). An interaction lands where its
    applied answer says, behind the chunk still under way, and says how many
    were."""
    start = start_of("a", 7, 6)
    streamed = await start_engine(2, stream_batch=True)
    try:
        got = (await run_sessions(streamed, [start]))["a"]
        interacted = await interact_once(streamed, start_of("s", 3, None))
        probe = await streamed.probe()
    finally:
        await streamed.shutdown()
    exact_engine = await start_engine(1)
    try:
        exact = (await run_sessions(exact_engine, [start]))["a"]
    finally:
        await exact_engine.shutdown()
    assert isinstance(got.end, SessionDone) and got.end.reason == "completed"
    assert [c.generation_chunk_index for c in got.chunks] == list(range(6))
    assert [c.first_frame_index for c in got.chunks] == [c.first_frame_index for c in exact.chunks]
    ours, theirs = payloads(got), payloads(exact)
    assert ours[0] == theirs[0]
    differences = [float(np.abs(frames(a) - frames(b)).mean()) for a, b in zip(ours[1:], theirs[1:], strict=True)]
    assert all(d > 0 for d in differences), differences
    assert max(differences) < 64, differences  # levels of 255: the same picture, not another one
    assert probe.runner_sessions == probe.pipeline_sessions == ()

    assert [c.generation_chunk_index for c in interacted.chunks] == list(range(len(interacted.chunks)))
    (applied,) = interacted.of(InteractionApplied)
    chunk = next(c for c in interacted.chunks if c.generation_chunk_index == applied.generation_chunk_index)
    assert "e1" in chunk.started_event_ids and applied.first_frame_index == chunk.first_frame_index
    # The chunk before it was still under way when it began (2), unless the session had been held for its
    # decodes (a loaded machine), when it began alone (1); it reports which, as its chunk does.
    assert applied.chunks_in_flight == chunk.timing.chunks_in_flight in (1, 2)
    assert max(c.timing.chunks_in_flight for c in got.chunks + interacted.chunks) == 2  # stream batch ran ahead
