"""The ranks' figures, from the executor to ``EngineStats``: named
(``RankFigures``), never positions. The local executor joins the ring
runner's busy and wall seconds of each rank with the chunks its decode stage
decoded there; the loop reports them as they came, or, with one rank, its
own from its stats. In process: the loop over the stub's runner, the real
executor with stand-ins for the ring runner and the decode stage."""

from __future__ import annotations

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.loop import EngineLoop
from rtvideo.engine.messages import RankFigures
from rtvideo.workers.executor import LocalExecutor
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.unit.fakes import HeldExecutor, QuietStage


def loop_over(executor_figures: tuple[RankFigures, ...]) -> EngineLoop:
    config = EngineConfig()
    runner = ModelRunner(StubPipeline())
    control = ControlPlane(config, runner.describe, lambda message: None)
    executor = HeldExecutor(runner, figures=executor_figures)
    return EngineLoop(config, control, executor, lambda message: None, grouping=True, max_rows=1)


def test_the_loop_reports_the_ranks_figures_the_executor_gave():
    figures = (
        RankFigures(rank=0, busy_s=1.5, wall_s=2.0, decoded_chunks=3),
        RankFigures(rank=1, busy_s=1.25, wall_s=2.0, decoded_chunks=4),
    )
    assert loop_over(figures).engine_stats().ranks == figures


def test_with_one_rank_the_loop_reports_its_own_figures():
    loop = loop_over(())
    loop.stats.pipeline_s, loop.stats.busy_s = 0.75, 1.0
    assert loop.engine_stats().ranks == (RankFigures(rank=0, busy_s=0.75, wall_s=1.0, decoded_chunks=0),)


class RingFigures(ModelRunner):
    """A runner with the ring runner's ``rank_figures`` (every rank's seconds, no decodes)."""

    def rank_figures(self) -> tuple[RankFigures, ...]:
        return (RankFigures(rank=0, busy_s=0.5, wall_s=1.0), RankFigures(rank=1, busy_s=0.25, wall_s=1.0))


class CountingStage(QuietStage):
    """A decode stage that decoded 2 chunks on rank 0 and 5 on rank 1."""

    decodes = [2, 5]

    def __init__(self, sessions, done) -> None:
        pass

    def submit(self, session_id: str, chunk_index: int) -> None:
        pass


def test_the_executor_joins_each_ranks_seconds_with_the_chunks_decoded_there():
    executor = LocalExecutor(RingFigures(StubPipeline()), lambda sid: False, lambda: None, decode_stage=CountingStage)
    try:
        assert executor.rank_figures() == (
            RankFigures(rank=0, busy_s=0.5, wall_s=1.0, decoded_chunks=2),
            RankFigures(rank=1, busy_s=0.25, wall_s=1.0, decoded_chunks=5),
        )
    finally:
        executor.close()
    one = LocalExecutor(ModelRunner(StubPipeline()), lambda sid: False, lambda: None, threaded=False)
    assert one.rank_figures() == ()
