"""Work bounded per session and per server, through real workers: the largest
frame the worker measured it serves in real time and the CPU memory budget it
advertises and enforces, and admission by chunk cost."""

from __future__ import annotations

import math

import pytest

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import SessionRejectedError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import ChunkReady, StartSession
from tests.support import Collected, collect, read_until


@pytest.fixture
async def tiny():
    """Start workers over the tiny causal Wan model on the CPU; shut them down after."""
    clients: list[EngineClient] = []

    async def factory(**config) -> EngineClient:
        client = EngineClient(
            EngineConfig(pipeline=PipelineSpec("tiny", {"device": "cpu"}), startup_timeout_s=120, **config)
        )
        await client.start()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.shutdown()


async def test_a_cpu_worker_derives_its_largest_realtime_frame_and_a_memory_budget(tiny):
    engine = await tiny()
    ready = engine.ready
    limits = ready.limits
    # The costs it measured at start: the default 64x64, then larger frames (or, on a
    # machine so loaded that the default missed real time, 32x32 for the slope).
    costs = ready.chunk_costs
    pixels = [cost.pixels for cost in costs]
    assert all(cost.step_s > 0 and cost.chunk_s > 0 for cost in costs)
    # video to video: a chunk's input frames through the encoder, measured at the default, scaled by area
    assert all(cost.encode_s > 0 for cost in costs)
    assert all(math.isclose(c.encode_s / c.pixels, costs[0].encode_s / costs[0].pixels) for c in costs)
    assert limits.max_pixels_derived and 64 * 64 <= limits.max_pixels <= 1280 * 1280
    if pixels[0] == 32 * 32:
        assert pixels == [32 * 32, 64 * 64] and limits.max_pixels == 64 * 64
    else:
        assert pixels[0] == 64 * 64 and len(pixels) >= 2 and pixels[1] > pixels[0]
    assert ready.session_memory_bytes is not None and ready.session_memory_bytes > 0  # a CPU: host memory

    side = math.isqrt(limits.max_pixels) // 16 * 16 + 16  # the smallest square past the bound
    if side <= 1280:
        with pytest.raises(SessionRejectedError) as refused:
            await engine.start_session(StartSession(session_id="big", prompt="p", width=side, height=side))
        assert refused.value.code == "invalid_request"
        assert f"width x height: {side}x{side} is {side * side} pixels" in refused.value.message
    handle = await engine.start_session(StartSession(session_id="default", prompt="p", num_chunks=1))
    assert isinstance((await collect(handle)).messages[0], ChunkReady)


async def test_a_configured_frame_area_overrides_the_derived_one(tiny):
    engine = await tiny(max_pixels=48 * 48, max_realtime_load=None)
    assert engine.ready.chunk_costs == ()  # nothing would use a measurement: none was made
    assert (engine.ready.limits.max_pixels, engine.ready.limits.max_pixels_derived) == (48 * 48, False)
    with pytest.raises(
        SessionRejectedError, match=r"64x64 is 4096 pixels; this server takes at most 2304 \(max_pixels\)"
    ):
        await engine.start_session(StartSession(session_id="default", prompt="p"))
    small = await engine.start_session(StartSession(session_id="small", prompt="p", width=48, height=48, num_chunks=1))
    await collect(small)


async def test_a_configured_frame_area_pins_the_bound_and_no_larger_frame_is_measured(tiny):
    """With admission by chunk cost on (so calibration runs) and every frame in real
    time (so a derived bound would be larger than the default), ``max_pixels`` is the
    bound, and calibration measures only what admission needs: nothing larger."""
    engine = await tiny(max_pixels=80 * 80, max_realtime_load=1e6)
    assert [cost.pixels for cost in engine.ready.chunk_costs] == [32 * 32, 64 * 64]
    assert (engine.ready.limits.max_pixels, engine.ready.limits.max_pixels_derived) == (80 * 80, False)
    with pytest.raises(SessionRejectedError, match=r"96x96 is 9216 pixels; this server takes at most 6400"):
        await engine.start_session(StartSession(session_id="big", prompt="p", width=96, height=96))
    handle = await engine.start_session(StartSession(session_id="ok", prompt="p", width=80, height=80, num_chunks=1))
    assert isinstance((await collect(handle)).messages[0], ChunkReady)


async def test_a_realtime_session_is_refused_when_the_chunks_measured_would_break_the_others_deadlines(make_engine):
    """Stub chunks of 4 frames at 16 fps play 0.25 s and here take 4 x 0.05 s: a paced
    session needs 0.8 of the worker, so a second one would need 1.6."""
    engine = await make_engine(max_sessions=8, step_time_s=0.05, max_realtime_load=0.9)
    first = await engine.start_session(StartSession(session_id="a", prompt="p", max_lead_seconds=30.0))
    collected = Collected()
    while (await read_until(first, ChunkReady, collected)).generation_chunk_index < 1:
        pass  # chunk 1 measured: the worker's cost model has it
    with pytest.raises(SessionRejectedError) as refused:
        await engine.start_session(StartSession(session_id="b", prompt="p", max_lead_seconds=30.0))
    assert refused.value.code == "server_full" and "max_realtime_load" in refused.value.message
    with pytest.raises(SessionRejectedError, match="server full"):  # a job takes a turn between a's chunks
        await engine.start_session(StartSession(session_id="job", prompt="p", num_chunks=2))
    await engine.stop(first.session_id)
    await collect(first, collected)
    job = await engine.start_session(StartSession(session_id="job", prompt="p", num_chunks=2))  # alone now
    await collect(job)
