"""What ``session.done.replay`` and a job say about exactness, from the chunk
timings the engine reports: exact while every chunk sent ran alone (or batched
on a batch-invariant pipeline) and without stream batch."""

from __future__ import annotations

import asyncio

import numpy as np

from rtvideo.engine.messages import ChunkReady, ChunkTiming, SessionDone
from rtvideo.server.metrics import Metrics
from rtvideo.server.output import SessionOutput
from rtvideo.server.schemas import EffectiveConfig


def _output() -> SessionOutput:
    config = EffectiveConfig(
        model="stub", prompt="p", negative_prompt="", seed=0, width=4, height=4, fps=16.0, num_frames=None,
        num_chunks=None, first_chunk_frames=1, frames_per_chunk=1, num_inference_steps=1, format="raw",
        transition_chunks=0, prompt_change="soft", max_lead_seconds=None,
    )  # fmt: skip
    return SessionOutput("r", config, Metrics(lambda: True))


def _chunk(index: int, **timing) -> ChunkReady:
    return ChunkReady(
        session_id="s", generation_chunk_index=index, num_frames=1, first_frame_index=index,
        media_start_seconds=index / 16.0, width=4, height=4, started_event_ids=(), active_event_ids=(),
        completed_event_ids=(), payload=np.zeros(48, np.uint8).tobytes(),
        timing=ChunkTiming(boundary_ms=0, denoise_ms=0, decode_ms=0, steps=1, runner_calls=(index,), **timing),
    )  # fmt: skip


def _replay(output: SessionOutput, *chunks: ChunkReady) -> dict:
    for chunk in chunks:
        asyncio.run(output.chunk(chunk))
    return output.replay(
        SessionDone(session_id="s", chunks=len(chunks), frames=len(chunks), stopped=True, reason="stopped", applied=())
    )


def test_chunks_that_ran_alone_or_batch_invariant_replay_exactly():
    replay = _replay(_output(), _chunk(0), _chunk(1, batch_rows=3, batch_exact=True))
    assert replay["exact"] is True and "inexact_reason" not in replay


def test_a_chunk_batched_on_a_pipeline_that_is_not_batch_invariant_makes_the_replay_inexact():
    output = _output()
    replay = _replay(output, _chunk(0), _chunk(1, batch_rows=4, batch_exact=False), _chunk(2, batch_exact=False))
    assert replay["exact"] is False
    assert "chunk 1 ran in a forward batched with 3 other" in replay["inexact_reason"]
    assert output.inexact_reason == replay["inexact_reason"]  # what a job's video object says


def test_a_chunk_begun_with_its_predecessor_in_flight_makes_the_replay_inexact():
    replay = _replay(_output(), _chunk(0), _chunk(1, chunks_in_flight=2))
    assert replay["exact"] is False and "stream batch" in replay["inexact_reason"]
