"""Every engine configuration starts and serves: one rank or two, the decode in
line or on a stage of its own, exact or stream batch, and every placement of
the decodes over the ranks (``pp_decode``), each through real worker
processes over the tiny model.

Each configuration runs two sessions side by side: one of four chunks whose
prompt changes at chunk 2 (scheduled), and an open-ended one that gets a live
prompt once its first chunk is in and is stopped once the chunk the prompt
landed on is out. Where the configuration is exact (no stream batch) every
frame is bit for bit what one rank deciding everything in line makes; where
it is not, the first chunk still is, and the live prompt waited behind no
more chunks than the session may have in flight, as the answer says. Two
configurations of two ranks also take a video-to-video session's input
frames, against one rank.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest
import pytest_asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    ScheduledInteraction,
    SessionDone,
    StartSession,
    VideoInput,
)
from tests.conftest import PINNED_LIMITS
from tests.support import Collected, collect, read_until

SIZE = {"width": 32, "height": 32}
SHARED = pytest.mark.asyncio(loop_scope="module")


@dataclass(frozen=True)
class Mode:
    pp: int
    overlap_decode: bool
    stream_batch: bool = False
    pp_decode: str = "auto"

    @property
    def exact(self) -> bool:
        return not self.stream_batch

    @property
    def name(self) -> str:
        decode = "overlap" if self.overlap_decode else "inline"
        parts = [f"pp{self.pp}", decode] + (["stream-batch"] if self.stream_batch else [])
        return "-".join(parts + ([self.pp_decode] if self.pp > 1 and self.overlap_decode else []))

    def config(
        self, device: str = "cpu", rows: int = 2, transport: str = "auto", options: dict | None = None
    ) -> EngineConfig:
        """On ``device`` (every rank on it: ``cuda:0`` puts two ranks on one GPU),
        forwards of up to ``rows`` rows, the ring on ``transport``, with the
        pipeline's ``options`` besides."""
        return EngineConfig(
            pipeline=PipelineSpec("tiny", {"device": device, "warm_up_chunks": 1, **(options or {})}),
            pp=self.pp,
            overlap_decode=self.overlap_decode,
            stream_batch=self.stream_batch,
            pp_decode=self.pp_decode,
            pp_transport=transport,
            max_batch_rows=rows,
            max_sessions=4,
            startup_timeout_s=120,
            **PINNED_LIMITS,
        )


REFERENCE = Mode(pp=1, overlap_decode=False)
MODES = [
    REFERENCE,
    Mode(pp=1, overlap_decode=True),
    Mode(pp=2, overlap_decode=False),
    Mode(pp=2, overlap_decode=False, stream_batch=True),
    *(
        Mode(pp=2, overlap_decode=True, stream_batch=batch, pp_decode=decode)
        for decode in ("first", "spread", "split")
        for batch in (False, True)
    ),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference():
    engine = EngineClient(REFERENCE.config())
    await engine.start()
    yield engine
    await engine.shutdown()


def scheduled_start(sid: str) -> StartSession:
    change = ScheduledInteraction(at_chunk=2, event_id="s1", interaction=Interaction(prompt="a storm"))
    return StartSession(session_id=sid, prompt="a calm sea", seed=11, num_chunks=4, scheduled=(change,), **SIZE)


def live_start(sid: str, chunks: int | None = None, at_chunk: int | None = None) -> StartSession:
    """The open-ended session (``chunks`` None), or its replay: ``chunks`` long
    with the live prompt scheduled where it landed."""
    scheduled = ()
    if at_chunk is not None:
        scheduled = (ScheduledInteraction(at_chunk=at_chunk, event_id="e1", interaction=Interaction(prompt="a fire")),)
    return StartSession(session_id=sid, prompt="a forest", seed=12, num_chunks=chunks, scheduled=scheduled, **SIZE)


async def run_live(engine: EngineClient, sid: str) -> tuple[Collected, InteractionApplied]:
    handle = await engine.start_session(live_start(sid))
    seen = Collected()
    await read_until(handle, ChunkReady, seen, timeout=120)
    await handle.interact("e1", Interaction(prompt="a fire"))
    applied = await read_until(handle, InteractionApplied, seen, timeout=120)
    while not any(c.generation_chunk_index >= applied.generation_chunk_index for c in seen.chunks):
        await read_until(handle, ChunkReady, seen, timeout=120)
    await handle.stop()
    return await collect(handle, seen, timeout=120), applied


async def run_scheduled(engine: EngineClient, start: StartSession) -> Collected:
    return await collect(await engine.start_session(start), timeout=120)


def payloads(result: Collected) -> list[bytes]:
    return [chunk.payload for chunk in result.chunks]


@SHARED
@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
async def test_every_configuration_serves_two_sessions_with_an_interaction(mode: Mode, reference: EngineClient):
    await check_mode(mode, mode.config(), reference, same=mode == REFERENCE)


SPEED_OPTIONS = {  # pipeline options that change the frames: each checked against one rank in line with it too
    "commit-from-last-step": (Mode(pp=1, overlap_decode=True), {"commit_from_last_step": True}),
    "tiny-decoder": (Mode(pp=2, overlap_decode=True, pp_decode="split"), {"tiny_decoder": "random", "decoder": "tiny"}),
    # captured denoise steps, replayed eagerly on the CPU (the static-buffer path CUDA replays): a one-chunk
    # window is full from chunk 1 on, so both sessions' later chunks go through their graphs.
    "captured-steps": (Mode(pp=1, overlap_decode=True), {"cuda_graphs": "eager", "window_frames": 3}),
    # one attention kernel called directly on both ranks, while the decode stage's thread runs the VAE's own
    # attention: no process-wide kernel switch may reach it
    "attention-math": (Mode(pp=2, overlap_decode=True), {"attention": "math"}),
    # the blocks' elementwise groups compiled (inductor's C++ on the CPU) in each worker process
    "fused-elementwise": (Mode(pp=1, overlap_decode=True), {"fused_elementwise": True}),
}
REFERENCE_OPTIONS = {"captured-steps": {"window_frames": 3}}  # what the reference shares (else the same options)


@pytest.mark.parametrize("name", SPEED_OPTIONS)
async def test_a_speed_option_through_the_workers_makes_what_one_rank_in_line_makes_with_it(name: str):
    """The options a server may be started with for speed, through real worker
    processes: the last step's keys committed (decoded on the decode stage, two
    sessions' commits batched), the tiny decoder (the decoder split over
    two ranks: the tiny one decodes whole in front), captured denoise steps
    (against eager forwards), one attention kernel (two ranks, decodes
    overlapped) and the fused elementwise groups. Each against one rank deciding everything in line
    with the same option (captured steps: without them): bit for bit."""
    mode, options = SPEED_OPTIONS[name]
    reference = EngineClient(REFERENCE.config(options=REFERENCE_OPTIONS.get(name, options)))
    await reference.start()
    try:
        await check_mode(mode, mode.config(options=options), reference)
    finally:
        await reference.shutdown()


async def check_mode(mode: Mode, config: EngineConfig, reference: EngineClient, same: bool = False) -> None:
    """Run the two sessions on an engine of ``config`` (``same``: on ``reference``
    itself) and check them against ``reference``, an engine of ``REFERENCE``."""
    engine = reference if same else EngineClient(config)
    if engine is not reference:
        await engine.start()
    try:
        scheduled, (live, applied) = await asyncio.gather(
            run_scheduled(engine, scheduled_start(f"{mode.name}-a")), run_live(engine, f"{mode.name}-b")
        )
    finally:
        if engine is not reference:
            await engine.shutdown()

    for result in (scheduled, live):
        assert isinstance(result.end, SessionDone), result.end
        indices = [chunk.generation_chunk_index for chunk in result.chunks]
        assert indices == list(range(len(indices))), indices
    assert [c.generation_chunk_index for c in scheduled.chunks] == [0, 1, 2, 3]
    assert [a.at_chunk for a in scheduled.end.applied] == [2]
    landed = applied.generation_chunk_index
    assert landed >= 1
    assert "e1" in live.chunks[landed].active_event_ids

    expected = await run_scheduled(reference, scheduled_start(f"{mode.name}-a-ref"))
    replay = await run_scheduled(reference, live_start(f"{mode.name}-b-ref", len(live.chunks), landed))
    if mode.exact:
        assert applied.chunks_in_flight == 1
        assert payloads(scheduled) == payloads(expected)
        assert payloads(live) == payloads(replay)
    else:
        lookahead = config.lookahead("soft")
        assert 1 <= applied.chunks_in_flight <= lookahead
        assert live.chunks[landed].timing.chunks_in_flight == applied.chunks_in_flight
        assert payloads(scheduled)[0] == payloads(expected)[0]
        assert payloads(live)[0] == payloads(replay)[0]


INPUT_MODES = [  # the placements test_pp_video_input.py does not start: decodes on rank 0's lanes, and stream batch
    Mode(pp=2, overlap_decode=True, pp_decode="first"),
    Mode(pp=2, overlap_decode=True, stream_batch=True, pp_decode="spread"),
]


async def run_input(engine: EngineClient, sid: str, chunks: int = 3) -> Collected:
    """A video-to-video session (strength 0.85: two steps of four), every chunk's
    frames sent at once (random, the same for every run)."""
    given = VideoInput(strength=0.85, format="raw", fps=16.0, **SIZE)
    handle = await engine.start_session(
        StartSession(session_id=sid, prompt="a river", seed=13, input=given, num_chunks=chunks)
    )
    g = handle.geometry
    for index in range(chunks):
        count = g.first_chunk_frames if index == 0 else g.frames_per_chunk
        frames = np.random.default_rng([13, index]).integers(0, 256, (count, g.height, g.width, 3), dtype=np.uint8)
        await handle.send_input(index, frames)
    return await collect(handle, timeout=120)


@SHARED
@pytest.mark.parametrize("mode", INPUT_MODES, ids=lambda mode: mode.name)
async def test_a_configuration_takes_an_input_as_one_rank_does(mode: Mode, reference: EngineClient):
    """Exact: every chunk one rank's; stream batch: the first."""
    engine = EngineClient(mode.config())
    await engine.start()
    try:
        got = await run_input(engine, f"{mode.name}-v")
    finally:
        await engine.shutdown()
    expected = await run_input(reference, f"{mode.name}-v-ref")
    for result in (got, expected):
        assert isinstance(result.end, SessionDone) and result.end.reason == "completed", result.end
        assert [c.generation_chunk_index for c in result.chunks] == [0, 1, 2]
    if mode.exact:
        assert payloads(got) == payloads(expected)
    else:
        assert payloads(got)[0] == payloads(expected)[0]
