"""The worker's CPU thread count, measured on the tiny preset through the worker's own path."""

from __future__ import annotations

import threading

import pytest
import torch

from rtvideo.workers.cpu_threads import MAX_CHUNK_S, measure_cpu_threads
from rtvideo.workers.pipelines.causal_wan import build


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu", max_batch_rows=1)


def _threads_a_new_thread_takes() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_each_count_is_measured_on_real_chunks_and_the_fastest_kept(pipeline):
    """On two cores: one and two threads each run real chunks on a thread of
    their own (a count far behind after the first round is not measured
    again); the count kept is one of them, no faster than the other by its
    best time beyond the tolerance; nothing is left open, and torch's thread
    count, for this thread and for threads started later, is as it was."""
    before = torch.get_num_threads(), _threads_a_new_thread_takes()
    chosen, seconds = measure_cpu_threads(pipeline, warm_chunk_s=0.1, cores=2)
    assert set(seconds) == {1, 2} and all(1 <= len(times) <= 2 for times in seconds.values())
    assert all(s > 0 for times in seconds.values() for s in times)
    best = {count: min(times) for count, times in seconds.items()}
    assert chosen in (1, 2) and best[chosen] <= 1.1 * min(best.values())
    assert pipeline.held_sessions() == ()
    assert (torch.get_num_threads(), _threads_a_new_thread_takes()) == before


def test_nothing_is_measured_with_one_core_or_for_a_slow_model(pipeline):
    assert measure_cpu_threads(pipeline, warm_chunk_s=0.1, cores=1) == (1, {})
    assert measure_cpu_threads(pipeline, warm_chunk_s=MAX_CHUNK_S + 1, cores=2) == (None, {})


def test_a_pipeline_error_on_the_measuring_thread_reaches_the_caller(pipeline, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("decoder out of order")

    monkeypatch.setattr(pipeline, "decode", fail)
    with pytest.raises(RuntimeError, match="decoder out of order"):
        measure_cpu_threads(pipeline, warm_chunk_s=0.1, cores=2)
    monkeypatch.undo()
    assert pipeline.held_sessions() == ()


def test_a_worker_measures_only_what_it_warmed_up(monkeypatch):
    """The worker's choice (``rtvideo.workers.main._cpu_threads``): a pipeline that runs
    no warm-up (a chunk would take minutes: a model directory on a CPU) is not
    measured either, and keeps torch's default; a count given is kept, and so
    is ``OMP_NUM_THREADS``'s; with ranks, the cores shared out; a pipeline
    that warmed up is measured."""
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.workers import cpu_threads
    from rtvideo.workers.main import _cpu_threads
    from rtvideo.workers.parallel.group import rank_threads

    measured = []
    monkeypatch.setattr(cpu_threads, "measure_cpu_threads", lambda pipeline, s: measured.append(s) or (1, {}))
    config = EngineConfig(pipeline=PipelineSpec("tiny"))
    cold = build("tiny", device="cpu", max_batch_rows=1, warm_up_chunks=0)
    assert _cpu_threads(config, cold, 0.0) == torch.get_num_threads() and measured == []
    assert _cpu_threads(EngineConfig(pipeline=PipelineSpec("tiny"), cpu_threads=3), cold, 0.0) == 3
    assert _cpu_threads(EngineConfig(pipeline=PipelineSpec("tiny"), pp=2), cold, 0.0) == rank_threads(2)
    warm = build("tiny", device="cpu", max_batch_rows=1, warm_up_chunks=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's count is kept
    assert _cpu_threads(config, warm, 0.4) == torch.get_num_threads() and measured == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        assert _cpu_threads(config, warm, 0.4) == 1 and measured == [0.2]  # the warm-up's seconds per chunk
    finally:
        torch.set_num_threads(before)
