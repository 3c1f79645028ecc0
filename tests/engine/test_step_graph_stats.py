"""The captured steps' counts reach the engine's figures and the metrics.

A worker whose pipeline goes through captured chunk steps (``cuda_graphs:
"eager"``: the CPU's stand-in for the CUDA capture, the same keys and
counts) reports its captures, replays and eager first uses in
``EngineStats.step_graphs`` after each micro-step, and the server's
collector exports them as ``rtvideo_step_graph_*``; a pipeline without them
(the stub) reports none, and no series is exported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import SessionDone, StartSession
from rtvideo.server.metrics import EngineStatsCollector
from tests.conftest import PINNED_LIMITS
from tests.support import collect


def exported(stats) -> str:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats))
    return generate_latest(registry).decode()


async def test_a_worker_reports_its_captured_steps_and_the_metrics_export_them():
    # a window of one chunk besides the sink: full from chunk 2, whose steps capture (4 steps, a commit each chunk)
    options = {"device": "cpu", "warm_up_chunks": 0, "cuda_graphs": "eager", "window_frames": 3}
    engine = EngineClient(EngineConfig(pipeline=PipelineSpec("tiny", options), startup_timeout_s=120, **PINNED_LIMITS))
    await engine.start()
    try:
        start = StartSession(session_id="g", prompt="a fox", seed=1, num_chunks=5, width=32, height=32)
        result = await collect(await engine.start_session(start), timeout=120)
        await engine.probe()  # answered after the figures the loop sent once the work ran out
        stats = engine.stats
    finally:
        await engine.shutdown()
    assert isinstance(result.end, SessionDone) and len(result.chunks) == 5
    graphs = stats.step_graphs
    # chunk 2: the denoise key's first use eager, its second captured; the commit key's first use eager;
    # chunk 3 captures the commit; then 4 + 1 replays a chunk (3 in chunk 2, 5 in chunks 3 and 4)
    assert (graphs["captures"], graphs["fallbacks"], graphs["replays"], graphs["held"]) == (2, 2, 13, 2), graphs
    assert graphs["capture_failures"] == 0  # each capture was rehearsed under the rules and passed
    text = exported(stats)
    assert "rtvideo_step_graph_captures_total 2.0" in text
    assert "rtvideo_step_graph_replays_total 13.0" in text
    assert "rtvideo_step_graph_fallbacks_total 2.0" in text
    assert "rtvideo_step_graphs_held 2.0" in text
    assert "rtvideo_step_graph_capture_failures_total 0.0" in text


async def test_a_pipeline_without_captured_steps_reports_none(make_engine):
    engine = await make_engine(step_time_s=0.0)
    result = await collect(await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=2)))
    await engine.probe()
    assert isinstance(result.end, SessionDone)
    assert engine.stats.step_graphs == {}
    text = exported(engine.stats)
    samples = [line.split(" ")[0] for line in text.splitlines() if not line.startswith("#")]
    assert "rtvideo_micro_steps_total" in samples
    assert not [name for name in samples if name.startswith("rtvideo_step_graph")], samples
