"""The decode stage with ``batch`` rows (``rtvideo.workers.decode_stage``): the deferred
decodes waiting on a lane go through the VAE decoder together, in rounds of
one chunk per session, batches of at most ``batch`` chunks, each session's
chunks in order and bit for bit the frames each decodes alone; a stopping
session's chunk is cancelled, not decoded, and a batch that raises falls
back to one decode each. ``decode_batch_rows``: how many a pipeline batches."""

from __future__ import annotations

import threading

import pytest

from rtvideo.engine.messages import StartSession
from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
from rtvideo.workers.decode_stage import CPU_DECODE_ROWS, DecodeStage, batch_rounds, decode_batch_rows
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner
from tests.model.test_causal_wan import open_session, release, run_chunk

SESSIONS = ("da", "db", "dc")
SEEDS = {"blocker": 9, "da": 0, "db": 1, "dc": 2}


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu", max_batch_rows=4, warm_up_chunks=0)


@pytest.fixture(scope="module")
def alone(pipeline):
    """Each session's first two chunks, run and decoded alone."""
    frames = {}
    for sid in SESSIONS:
        state = open_session(pipeline, sid + "-alone", seed=SEEDS[sid], prompt=sid, num_inference_steps=1)
        frames[sid] = [run_chunk(pipeline, state)[0].payload for _ in range(2)]
        release(pipeline, state)
    return frames


def _committed_runner(pipeline, sessions, chunks: int) -> ModelRunner:
    """A runner that deferred its decodes, with ``chunks`` chunks of each of
    ``sessions`` (one step a chunk) committed and waiting for their decodes."""
    runner = ModelRunner(pipeline)
    runner.sessions.defer_decode = True
    for chunk in range(chunks):
        step = MicroStep(number=chunk + 1, ranks=[[StepRow(sid, chunk, 0, 1) for sid in sessions]])
        step.boundaries = [BoundaryTask(sid, chunk, None, 0) for sid in sessions]
        if chunk == 0:
            step.open = [
                StartSession(session_id=sid, prompt=sid, seed=SEEDS[sid], num_inference_steps=1) for sid in sessions
            ]
        result = runner.execute(step)
        assert sorted(result.decodes) == sorted((sid, chunk) for sid in sessions)
    return runner


def _blocked_lane(pipeline, runner, monkeypatch, batch_lengths: list[int], rows: int = 4):
    """A batching decode stage whose lane is busy with a blocker's decode until
    the returned gate is set, so that what is submitted meanwhile waits on it."""
    real_decode, real_batch = pipeline.decode, pipeline.decode_batch
    entered, gate = threading.Event(), threading.Event()

    def decode(session, index):
        if session.session_id == "blocker":
            entered.set()
            assert gate.wait(60)
        return real_decode(session, index)

    monkeypatch.setattr(pipeline, "decode", decode)
    monkeypatch.setattr(pipeline, "decode_batch", lambda s, i: batch_lengths.append(len(s)) or real_batch(s, i))
    done = []
    stage = DecodeStage(runner.sessions, done.append, batch=rows)
    stage.submit("blocker", 0)
    assert entered.wait(60)
    return stage, gate, done


def test_how_many_chunks_a_pipeline_decodes_in_one_batch(pipeline):
    assert decode_batch_rows(pipeline) == 4  # max_batch_rows on this CPU pipeline
    one_row = build("tiny", device="cpu", max_batch_rows=1, warm_up_chunks=0)
    assert decode_batch_rows(one_row) == CPU_DECODE_ROWS  # on a CPU, batches whatever rows a forward takes
    assert decode_batch_rows(StubPipeline(max_batch_rows=4)) == 1  # declares no decode_batch: each decodes alone
    with pytest.raises(ValueError, match="batch must be >= 1"):
        DecodeStage(ModelRunner(pipeline).sessions, print, batch=0)


def test_batch_rounds_keep_each_sessions_order_and_the_bound():
    items = [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("d", 0), ("a", 2), ("b", 1)]
    assert batch_rounds(items, 4) == [[("a", 0), ("b", 0), ("c", 0), ("d", 0)], [("a", 1), ("b", 1)], [("a", 2)]]
    assert batch_rounds(items, 2) == [
        [("a", 0), ("b", 0)],
        [("c", 0), ("d", 0)],
        [("a", 1), ("b", 1)],
        [("a", 2)],
    ]
    assert batch_rounds(items, 1) == [[item] for item in sorted(items, key=lambda i: (i[1], "abcd".index(i[0])))]


def test_decodes_waiting_on_a_lane_decode_in_rounds_of_one_batch(pipeline, alone, monkeypatch):
    runner = _committed_runner(pipeline, ["blocker", *SESSIONS], chunks=2)
    batches: list[int] = []
    stage, gate, done = _blocked_lane(pipeline, runner, monkeypatch, batches)
    for chunk in (0, 1):
        for sid in SESSIONS:
            stage.submit(sid, chunk)
    gate.set()
    stage.close()
    assert batches == [3, 3]  # chunk 0 of the three, then chunk 1 of the three: each one decoder batch
    by_session = {}
    for result in done:
        assert result.error is None and not result.cancelled
        by_session.setdefault(result.session_id, []).append(result)
    for sid in SESSIONS:
        assert [r.chunk_index for r in by_session[sid]] == [0, 1]  # in order
        assert [r.chunk.payload for r in by_session[sid]] == alone[sid]  # bit for bit its own decodes
    assert stage.decodes == [7]  # the blocker's first chunk, then the three sessions' two
    runner.execute(MicroStep(number=9, release=["blocker", *SESSIONS]))


def test_a_lane_batches_no_more_chunks_than_its_bound(pipeline, alone, monkeypatch):
    runner = _committed_runner(pipeline, ["blocker", *SESSIONS], chunks=1)
    batches: list[int] = []
    stage, gate, done = _blocked_lane(pipeline, runner, monkeypatch, batches, rows=2)
    for sid in SESSIONS:
        stage.submit(sid, 0)
    gate.set()
    stage.close()
    assert batches == [2]  # da and db as one batch; dc decodes alone after them
    results = {r.session_id: r for r in done if r.session_id != "blocker"}
    for sid in SESSIONS:
        assert results[sid].error is None and results[sid].chunk.payload == alone[sid][0]
    runner.execute(MicroStep(number=9, release=["blocker", *SESSIONS]))


def test_a_stopping_session_is_cancelled_and_a_failing_batch_falls_back(pipeline, alone, monkeypatch):
    runner = _committed_runner(pipeline, ["blocker", *SESSIONS], chunks=2)
    runner.sessions.is_stopping = lambda sid: sid == "dc"
    batches: list[int] = []
    stage, gate, done = _blocked_lane(pipeline, runner, monkeypatch, batches)
    for sid in SESSIONS:
        stage.submit(sid, 0)
    real_batch = pipeline.decode_batch
    broken = []

    def breaks_once(sessions, indices):
        if not broken:
            broken.append(len(sessions))
            raise RuntimeError("injected")
        return real_batch(sessions, indices)

    monkeypatch.setattr(pipeline, "decode_batch", breaks_once)
    gate.set()
    stage.close()
    assert broken == [2]  # da and db together; dc is stopping, so not decoded
    results = {r.session_id: r for r in done if r.session_id != "blocker"}
    assert results["dc"].cancelled and results["dc"].chunk is None
    for sid in ("da", "db"):  # the batch raised: each decoded alone, the same frames
        assert results[sid].error is None and results[sid].chunk.payload == alone[sid][0]
    held, _ = runner.held_sessions()
    assert set(held) == {"blocker", *SESSIONS}  # nothing released here: the engine does that
    runner.execute(MicroStep(number=9, release=["blocker", *SESSIONS]))
