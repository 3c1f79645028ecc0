"""Several sessions' chunks in one denoise forward (batch rows) equal each
session's own forward bit for bit: every row keeps its cache, position, step
and prompt, and on a CPU the batched forward is batch-invariant (each row is
embedded on its own; the blocks and the head round the same at any batch
size), so a session's frames do not depend on who shared its forwards."""

from __future__ import annotations

import pytest
import torch

from rtvideo.engine.messages import StartSession
from rtvideo.workers.pipelines.base import BatchRow, StepBatch
from rtvideo.workers.pipelines.causal_wan import build
from tests.model.test_causal_wan import driver_for, open_session, release, run_chunk


@pytest.fixture(scope="module")
def pipeline():
    return build("tiny", device="cpu", max_batch_rows=4, warm_up_chunks=0)


def _advance(pipeline, state, chunks: int, steps: int):
    """Run ``chunks`` whole chunks, then prepare the next and run ``steps`` of its
    steps; returns (the session, the row of its next step)."""
    for _ in range(chunks):
        run_chunk(pipeline, state)
    pipeline.boundary(state, chunks)
    for step in range(steps):
        row = BatchRow(state.session_id, chunks, step)
        [prediction] = pipeline.forward(StepBatch((row,)), [state])
        pipeline.sampler_step(state, row, prediction)
    return state, BatchRow(state.session_id, chunks, steps)


def _forward(pipeline, advanced) -> list[torch.Tensor]:
    """One forward over the rows of ``advanced`` ((session, row) pairs)."""
    states, rows = zip(*advanced, strict=True)
    return pipeline.forward(StepBatch(rows), states)


def _alone(pipeline, advanced) -> list[torch.Tensor]:
    return [_forward(pipeline, [pair])[0] for pair in advanced]


def test_rows_at_different_positions_steps_and_prompts_equal_their_own_forwards(pipeline):
    advanced = [
        _advance(pipeline, open_session(pipeline, "fresh", seed=1, prompt="a fox"), chunks=0, steps=0),
        _advance(pipeline, open_session(pipeline, "two", seed=2, prompt="a whale"), chunks=2, steps=1),
        _advance(pipeline, open_session(pipeline, "rolled", seed=3, prompt="a storm"), chunks=8, steps=3),
        _advance(pipeline, open_session(pipeline, "also-two", seed=4, prompt="a boat"), chunks=2, steps=2),
    ]
    full = pipeline.sink_frames + pipeline.window_frames
    assert [s.kv.frames for s, _ in advanced] == [0, 6, full, 6]  # 8 chunks: the window has rolled
    batched = _forward(pipeline, advanced)
    for (state, _), together, alone in zip(advanced, batched, _alone(pipeline, advanced), strict=True):
        assert together.shape == alone.shape
        assert torch.equal(together, alone), state.session_id  # bit for bit: batch-invariant
    for state, _ in advanced:
        release(pipeline, state)


def test_rows_whose_caches_hold_as_many_frames_attend_in_one_call(pipeline, monkeypatch):
    from rtvideo.workers.pipelines import wan_attention

    advanced = [
        _advance(pipeline, open_session(pipeline, f"same{i}", seed=10 + i), chunks=1, steps=i) for i in range(3)
    ]
    calls = []
    real = wan_attention.dispatch_attention_fn
    monkeypatch.setattr(
        wan_attention, "dispatch_attention_fn", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k)
    )
    batched = _forward(pipeline, advanced)
    layers = len(pipeline.transformer.blocks)
    assert calls == [3] * layers  # one self-attention call per layer, three rows in it
    monkeypatch.setattr(wan_attention, "dispatch_attention_fn", real)
    for together, alone in zip(batched, _alone(pipeline, advanced), strict=True):
        assert torch.equal(together, alone)
    for state, _ in advanced:
        release(pipeline, state)


def test_rows_of_different_sizes_run_as_separate_forwards(pipeline):
    advanced = [
        _advance(pipeline, open_session(pipeline, "big", seed=5), chunks=1, steps=0),
        _advance(pipeline, open_session(pipeline, "small", seed=6, width=32, height=32), chunks=1, steps=0),
        _advance(pipeline, open_session(pipeline, "big2", seed=7), chunks=2, steps=1),
    ]
    batched = _forward(pipeline, advanced)
    assert [tuple(p.shape[-2:]) for p in batched] == [(8, 8), (4, 4), (8, 8)]
    for together, alone in zip(batched, _alone(pipeline, advanced), strict=True):
        assert torch.equal(together, alone)
    for state, _ in advanced:
        release(pipeline, state)


def test_sessions_stepped_in_lockstep_make_the_frames_they_make_alone(pipeline):
    """Whole chunks through batched forwards, as the runner steps them, equal the
    same sessions run one by one, byte for byte."""
    import numpy as np

    specs = [("p", 41, "a fox"), ("q", 42, "a whale"), ("r", 43, "a storm")]
    alone = {}
    for sid, seed, prompt in specs:
        state = open_session(pipeline, sid, seed=seed, prompt=prompt)
        alone[sid] = [np.frombuffer(run_chunk(pipeline, state)[0].payload, np.uint8) for _ in range(3)]
        release(pipeline, state)
    driver = driver_for(pipeline)
    assert driver.max_rows >= len(specs)  # every session's row in each forward
    widths = []
    real = pipeline.forward
    pipeline.forward = lambda batch, sessions: widths.append(len(sessions)) or real(batch, sessions)
    try:
        driver.open(*(StartSession(session_id=sid + "-b", seed=seed, prompt=prompt) for sid, seed, prompt in specs))
        made = driver.run([sid + "-b" for sid, _, _ in specs], chunks=3)
    finally:
        del pipeline.forward
    assert widths == [3] * 12  # 3 chunks of 4 steps, all three sessions in each forward
    for sid, _, _ in specs:
        together = [np.frombuffer(out.payload, np.uint8) for out in made[sid + "-b"]]
        for a, b in zip(alone[sid], together, strict=True):
            assert np.array_equal(a, b)
    driver.release(*(sid + "-b" for sid, _, _ in specs))


def test_a_commit_forward_carries_one_row(pipeline):
    a, b = open_session(pipeline, "c1"), open_session(pipeline, "c2")
    latent = torch.zeros((2, *a.latent_shape[1:]))
    text = torch.cat([a.prompt.target, b.prompt.target])
    with pytest.raises(ValueError, match="one row"):
        pipeline._run((a.kv, b.kv), latent, [0.0, 0.0], text, commit=True)
    release(pipeline, a)
    release(pipeline, b)


def test_the_runner_steps_three_sessions_through_shared_forwards(pipeline):
    """The worker's real runner over the real pipeline: four micro-steps of three
    sessions, one forward of three rows each, and the chunks each session makes alone."""
    import numpy as np

    from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
    from rtvideo.workers.runner import ModelRunner

    runner = ModelRunner(pipeline)
    starts = [StartSession(session_id=f"run{i}", prompt=f"prompt {i}", seed=50 + i) for i in range(3)]
    widths = []
    real = pipeline.forward

    def counting(batch, states):
        widths.append(len(states))
        return real(batch, states)

    pipeline.forward = counting
    try:
        results = []
        for step in range(4):
            micro = MicroStep(number=step + 1, ranks=[[StepRow(s.session_id, 0, step, 4) for s in starts]])
            if step == 0:
                micro.open = starts
                micro.boundaries = [BoundaryTask(s.session_id, 0, None, 0) for s in starts]
            results.append(runner.execute(micro))
    finally:
        del pipeline.forward
    assert widths == [3, 3, 3, 3]
    for start in starts:
        rows = [result.rows[start.session_id, 0] for result in results]
        assert all(row.error is None and row.stepped for row in rows)
        assert all(row.batch_rows == 3 and row.batch_exact for row in rows)  # batched, and batch-invariant
        assert [row.chunk is not None for row in rows] == [False, False, False, True]
        row = rows[-1]
        state = open_session(pipeline, start.session_id + "-alone", prompt=start.prompt, seed=start.seed)
        alone = np.frombuffer(run_chunk(pipeline, state)[0].payload, np.uint8).astype(int)
        together = np.frombuffer(row.chunk.payload, np.uint8).astype(int)
        assert np.array_equal(alone, together)
        release(pipeline, state)
    runner.execute(MicroStep(number=5, release=[s.session_id for s in starts]))
    ids = {s.session_id for s in starts}
    held_by_runner, held_by_pipeline = runner.held_sessions()
    assert not ids & set(held_by_runner) and not ids & set(held_by_pipeline)


def test_a_chunk_batched_on_a_pipeline_that_is_not_batch_invariant_is_reported_inexact(pipeline, monkeypatch):
    """The runner reports each row's forward width, and ``batch_exact`` false only
    where the pipeline does not claim batch invariance (a GPU, where the matrix
    products' kernels depend on the batch's shape)."""
    from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
    from rtvideo.workers.runner import ModelRunner

    assert pipeline.batch_invariant  # on a CPU: measured, and tested bit for bit above
    monkeypatch.setattr(pipeline, "batch_invariant", False)
    runner = ModelRunner(pipeline)
    starts = [StartSession(session_id=f"inexact{i}", prompt="p", seed=i, num_inference_steps=1) for i in range(2)]
    micro = MicroStep(number=1, open=starts, ranks=[[StepRow(s.session_id, 0, 0, 1) for s in starts]])
    micro.boundaries = [BoundaryTask(s.session_id, 0, None, 0) for s in starts]
    batched = runner.execute(micro)
    assert [(r.batch_rows, r.batch_exact) for r in batched.rows.values()] == [(2, False), (2, False)]
    alone = runner.execute(
        MicroStep(number=2, boundaries=[BoundaryTask("inexact0", 1, None, 0)], ranks=[[StepRow("inexact0", 1, 0, 1)]])
    )
    assert (alone.rows["inexact0", 1].batch_rows, alone.rows["inexact0", 1].batch_exact) == (1, True)
    runner.execute(MicroStep(number=3, release=[s.session_id for s in starts]))


def denoised(pipeline, state, index: int) -> None:
    """Prepare and denoise chunk ``index`` of ``state``, leaving it uncommitted."""
    pipeline.boundary(state, index)
    for step in range(len(state.timesteps)):
        row = BatchRow(state.session_id, index, step)
        [prediction] = pipeline.forward(StepBatch((row,)), [state])
        pipeline.sampler_step(state, row, prediction)


def _committed(pipeline, state, index: int) -> None:
    """Denoise and commit chunk ``index`` of ``state``, leaving it undecoded."""
    denoised(pipeline, state, index)
    pipeline.commit(state, index)


def _twins(pipeline, name: str, count: int):
    """``count`` pairs of sessions, each pair opened alike (one to decode in a
    batch, one alone)."""
    return [
        tuple(open_session(pipeline, f"{name}{i}-{side}", seed=70 + i, prompt=f"prompt {i}") for side in "ba")
        for i in range(count)
    ]


def test_chunks_decoded_in_one_batch_are_the_frames_each_session_decodes_alone(pipeline, monkeypatch):
    """``decode_batch`` over sessions whose decoders are at the same point runs
    one decoder batch, and each session's frames are bit for bit its own decode
    (on a CPU every decoder kernel is batch-invariant). A stream at its first
    chunk is a batch of its own (its decoder cache is still empty)."""
    pairs = _twins(pipeline, "dec", 4)
    widths = []
    real = pipeline.decoder.decode_rows
    monkeypatch.setattr(
        pipeline.decoder, "decode_rows", lambda latents, *a, **k: widths.append(len(latents)) or real(latents, *a, **k)
    )
    for state, twin in pairs[:3]:
        _committed(pipeline, state, 0)
        _committed(pipeline, twin, 0)
    batched = pipeline.decode_batch([s for s, _ in pairs[:3]], [0, 0, 0])
    alone = [pipeline.decode(twin, 0) for _, twin in pairs[:3]]
    assert widths == [3]  # one batch of three (decode, alone, does not go through decode_rows)
    for together, own in zip(batched, alone, strict=True):
        assert together.payload == own.payload
    widths.clear()
    for state, twin in pairs[:3]:  # chunk 1 of three streams, chunk 0 of a fourth
        _committed(pipeline, state, 1)
        _committed(pipeline, twin, 1)
    fresh, fresh_twin = pairs[3]
    _committed(pipeline, fresh, 0)
    _committed(pipeline, fresh_twin, 0)
    batched = pipeline.decode_batch([pairs[0][0], fresh, pairs[1][0], pairs[2][0]], [1, 0, 1, 1])
    assert widths == [3, 1]
    alone = [pipeline.decode(pairs[0][1], 1), pipeline.decode(fresh_twin, 0)]
    alone += [pipeline.decode(pairs[i][1], 1) for i in (1, 2)]
    assert [b.num_frames for b in batched] == [12, 9, 12, 12]
    for together, own in zip(batched, alone, strict=True):
        assert together.payload == own.payload
    for pair in pairs:
        for state in pair:
            release(pipeline, state)


def test_a_batched_decode_that_fails_or_is_abandoned_changes_no_session(pipeline, monkeypatch):
    """All or nothing: a batch that raises in its second group, or is abandoned
    part-way, leaves every session's decoder cache and chunk record as they
    were, so each chunk then decodes to the frames it would have made."""
    from rtvideo.workers.pipelines.base import Abandoned, abandon_when

    pairs = _twins(pipeline, "fail", 3)
    for state, twin in pairs:
        for index in (0, 1):
            _committed(pipeline, twin, index)
        _committed(pipeline, state, 0)
    first = [pipeline.decode(twin, 0) for _, twin in pairs[:2]]
    pipeline.decode_batch([state for state, _ in pairs[:2]], [0, 0])  # two streams past their first chunk
    for state, _ in pairs[:2]:
        _committed(pipeline, state, 1)
    states = [state for state, _ in pairs]  # and the third at its first: two groups
    before = [list(state.vae_cache) for state in states]
    real, calls = pipeline.decoder.decode_rows, []

    def second_group_raises(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.decoder, "decode_rows", second_group_raises)
    with pytest.raises(RuntimeError, match="injected"):
        pipeline.decode_batch(states, [1, 1, 0])
    monkeypatch.setattr(pipeline.decoder, "decode_rows", real)
    with pytest.raises(Abandoned), abandon_when(lambda: True):
        pipeline.decode_batch(states, [1, 1, 0])
    for state, cache in zip(states, before, strict=True):
        assert all(a is b for a, b in zip(state.vae_cache, cache, strict=True))
        assert state.chunks  # the records stay
    outputs = pipeline.decode_batch(states, [1, 1, 0])
    alone = [pipeline.decode(pairs[i][1], 1) for i in (0, 1)] + [pipeline.decode(pairs[2][1], 0)]
    assert [b.payload for b in outputs] == [a.payload for a in alone]
    assert all(f.num_frames == 9 for f in first)
    for pair in pairs:
        for state in pair:
            release(pipeline, state)
