"""A worker whose decodes run on the decode stage and batch there (the path a
GPU takes: ``overlap_decode``, ``max_batch_rows`` > 1), over the tiny model
in real worker processes: sessions started together make exactly the frames
each makes alone, and one stopped mid-stream ends ``stopped`` while the
others run on."""

from __future__ import annotations

import asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import ChunkReady, SessionDone, StartSession
from tests.conftest import PINNED_LIMITS
from tests.support import Collected, collect, read_until

SIZE = {"width": 64, "height": 64}


def _start(sid: str, seed: int, chunks: int | None) -> StartSession:
    return StartSession(session_id=sid, prompt=f"prompt {sid}", seed=seed, num_chunks=chunks, **SIZE)


def _alone(start: StartSession) -> list[bytes]:
    """The session's chunks made in this process, alone, decoded in line."""
    from rtvideo.workers.chunk_driver import ChunkDriver
    from rtvideo.workers.pipelines.causal_wan import build

    driver = ChunkDriver(build("tiny", device="cpu", max_batch_rows=1, warm_up_chunks=0))
    driver.open(start)
    chunks = driver.run([start.session_id], chunks=start.num_chunks)[start.session_id]
    return [chunk.payload for chunk in chunks]


async def test_sessions_decoded_in_batches_on_the_decode_stage_make_their_own_frames_and_a_stop_ends_one():
    spec = PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 1})
    config = EngineConfig(
        pipeline=spec, overlap_decode=True, max_batch_rows=3, max_sessions=4, startup_timeout_s=120, **PINNED_LIMITS
    )
    engine = EngineClient(config)
    await engine.start()
    try:
        assert engine.ready.overlap_decode and engine.ready.max_batch_rows == 3
        starts = [_start(f"lane{i}", 20 + i, 4) for i in range(3)]
        handles = [await engine.start_session(start) for start in starts]
        stopped = await engine.start_session(_start("stopped", 30, None))
        seen = Collected()
        await read_until(stopped, ChunkReady, seen, timeout=120)
        await stopped.stop()
        results = await asyncio.gather(*(collect(handle, timeout=120) for handle in handles))
        ended = await collect(stopped, seen, timeout=120)
    finally:
        await engine.shutdown()
    assert isinstance(ended.end, SessionDone) and ended.end.reason == "stopped"
    for start, result in zip(starts, results, strict=True):
        assert isinstance(result.end, SessionDone) and result.end.reason == "completed"
        assert [chunk.generation_chunk_index for chunk in result.chunks] == [0, 1, 2, 3]
        assert [chunk.payload for chunk in result.chunks] == _alone(start), start.session_id
