"""Several sessions' commit passes in one forward (``commit_batch``) leave every
session's KV cache bit for bit as its own commit does, all or nothing, and
the runner commits (and decodes) the chunks that end together that way,
falling back to one call each when the batch raises."""

from __future__ import annotations

import pytest
import torch

from rtvideo.engine.messages import StartSession
from rtvideo.workers.pipelines import causal_wan
from rtvideo.workers.pipelines.base import Abandoned, abandon_when
from rtvideo.workers.pipelines.causal_wan import build
from tests.model.test_batched_rows import denoised
from tests.model.test_causal_wan import driver_for, open_session, release, run_chunk


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu", max_batch_rows=4, warm_up_chunks=0)


def _pairs(pipeline, name: str, specs):
    """Per spec (chunks before, size), two sessions opened and advanced alike, the
    chunk after those denoised: one to commit in a batch, one alone."""
    pairs = []
    for i, (chunks, size) in enumerate(specs):
        pair = []
        for side in "ba":
            state = open_session(
                pipeline, f"{name}{i}-{side}", seed=80 + i, prompt=f"prompt {i}", width=size, height=size
            )
            for _ in range(chunks):
                run_chunk(pipeline, state)
            denoised(pipeline, state, chunks)
            pair.append(state)
        pairs.append((tuple(pair), chunks))
    return pairs


def _same_cache(a, b) -> bool:
    if a.frames != b.frames or a.committed_frames != b.committed_frames:
        return False
    return all(torch.equal(x, y) for layer in a.layers for x, y in zip(a.read(layer), b.read(layer), strict=True))


def _release(pipeline, pairs) -> None:
    for pair, _ in pairs:
        for state in pair:
            release(pipeline, state)


def test_chunks_committed_in_one_pass_leave_each_cache_as_its_own_commit(pipeline, monkeypatch):
    """Sessions at their first chunk, a few chunks in, past a rolled window, and
    of another size: one pass per latent shape, and every cache, record and
    kept latent equal to the session's own commit's, bit for bit (on a CPU the
    blocks are batch-invariant)."""
    pairs = _pairs(pipeline, "cb", [(0, 64), (2, 64), (8, 64), (1, 32)])
    passes = []
    real = causal_wan.run_blocks
    monkeypatch.setattr(causal_wan, "run_blocks", lambda m, a, b: passes.append(a.latent_shape[0]) or real(m, a, b))
    pipeline.commit_batch([pair[0] for pair, _ in pairs], [index for _, index in pairs])
    assert sorted(passes) == [1, 3]  # one pass of three 64x64 rows, one of the 32x32 row
    monkeypatch.setattr(causal_wan, "run_blocks", real)
    for (batched, alone), index in pairs:
        pipeline.commit(alone, index)
        assert batched.chunks[index].committed
        assert _same_cache(batched.kv, alone.kv), batched.session_id
        kept = zip(batched.cached_chunks, alone.cached_chunks, strict=True)
        assert all(torch.equal(x, y) for x, y in kept)
    full = pipeline.sink_frames + pipeline.window_frames
    assert [pair[0].kv.frames for pair, _ in pairs] == [3, 9, full, 6]
    driver = driver_for(pipeline)
    for (batched, alone), index in pairs:  # the same frames, and the same next chunk from either cache
        assert pipeline.decode(batched, index).payload == pipeline.decode(alone, index).payload
        for state in (batched, alone):
            driver.next_chunk[state.session_id] = index + 1
        assert run_chunk(pipeline, batched)[0].payload == run_chunk(pipeline, alone)[0].payload
    _release(pipeline, pairs)


def test_a_batched_commit_that_fails_or_is_abandoned_changes_no_cache(pipeline, monkeypatch):
    """All or nothing: a batch that raises in its second pass, or is abandoned
    between blocks, leaves every cache (frames, version, contents) and record
    as they were, and the same batch then commits what each commit alone does."""
    pairs = _pairs(pipeline, "cf", [(1, 64), (1, 64), (0, 32)])
    states = [pair[0] for pair, _ in pairs]
    indices = [index for _, index in pairs]
    before = [(s.kv.frames, s.kv.version, [t.clone() for t in s.kv.read(0)]) for s in states]
    real, calls = causal_wan.run_blocks, []

    def second_pass_raises(model, activations, blocks):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(model, activations, blocks)

    monkeypatch.setattr(causal_wan, "run_blocks", second_pass_raises)
    with pytest.raises(RuntimeError, match="injected"):
        pipeline.commit_batch(states, indices)
    monkeypatch.setattr(causal_wan, "run_blocks", real)
    with pytest.raises(Abandoned), abandon_when(lambda: True):
        pipeline.commit_batch(states, indices)
    for state, index, (frames, version, layer0) in zip(states, indices, before, strict=True):
        assert (state.kv.frames, state.kv.version) == (frames, version)
        assert all(torch.equal(a, b) for a, b in zip(state.kv.read(0), layer0, strict=True))
        assert not state.chunks[index].committed
    pipeline.commit_batch(states, indices)
    for (batched, alone), index in pairs:
        pipeline.commit(alone, index)
        assert _same_cache(batched.kv, alone.kv)
    with pytest.raises(ValueError, match="one chunk of each session"):
        pipeline.commit_batch([states[0], states[0]], [2, 2])
    _release(pipeline, pairs)


@pytest.mark.parametrize("stage", ["commit", "decode"])
def test_the_runner_batches_chunks_ending_together_and_a_failing_one_fails_alone(pipeline, monkeypatch, stage):
    """Rows whose chunks a forward finishes together commit through one
    ``commit_batch`` and decode through one ``decode_batch``; when the batch
    raises, each runs alone, and only the session whose own call fails fails."""
    from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
    from rtvideo.workers.runner import ModelRunner

    runner = ModelRunner(pipeline)
    starts = [StartSession(session_id=f"{stage}{i}", prompt="p", seed=i, num_inference_steps=1) for i in range(3)]
    batches = []
    real_batch = getattr(pipeline, f"{stage}_batch")
    monkeypatch.setattr(pipeline, f"{stage}_batch", lambda s, i: batches.append(len(s)) or real_batch(s, i))

    def micro(number: int, chunk: int) -> MicroStep:
        step = MicroStep(number=number, ranks=[[StepRow(s.session_id, chunk, 0, 1) for s in starts]])
        step.boundaries = [BoundaryTask(s.session_id, chunk, None, 0) for s in starts]
        return step

    first = micro(1, 0)
    first.open = starts
    result = runner.execute(first)
    assert batches == [3]
    assert all(row.committed and row.chunk is not None and row.error is None for row in result.rows.values())

    def broken_batch(sessions, indices):
        raise RuntimeError("batch broke")

    real_alone, failing = getattr(pipeline, stage), starts[1].session_id

    def alone(session, index, *rest):
        if session.session_id == failing:
            raise RuntimeError(f"{failing}'s {stage} broke")
        return real_alone(session, index, *rest)

    monkeypatch.setattr(pipeline, f"{stage}_batch", broken_batch)
    monkeypatch.setattr(pipeline, stage, alone)
    result = runner.execute(micro(2, 1))
    rows = {sid: row for (sid, _), row in result.rows.items()}
    for ok in (starts[0].session_id, starts[2].session_id):
        assert rows[ok].committed and rows[ok].chunk is not None and rows[ok].error is None
    assert rows[failing].chunk is None and f"{failing}'s {stage} broke" in rows[failing].error
    assert rows[failing].committed == (stage == "decode")
    assert failing not in runner.states  # failed and released; the others go on
    runner.execute(MicroStep(number=3, release=[starts[0].session_id, starts[2].session_id]))
