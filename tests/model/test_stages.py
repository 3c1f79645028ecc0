"""The pipeline stages on their own (``rtvideo.workers.pipelines.base``), for the stub
and the causal Wan pipeline (tiny preset, CPU): a forward or commit split into
two block ranges equals one range, chunk k decodes while chunk k+1 denoises
and the frames are the same, and a stage asked for a chunk that is not ready
for it refuses, through the runner too, failing that session only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtvideo.engine.messages import StartSession
from rtvideo.engine.plan import BoundaryTask, MicroStep, StepRow
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.base import BatchRow, ChunkOrderError, ChunkPipeline, Hidden, StepBatch
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.pipelines.wan_blocks import embed, head, run_blocks
from rtvideo.workers.runner import ModelRunner


@pytest.fixture(scope="module")
def wan():
    return build("tiny", device="cpu", warm_up_chunks=0)


@pytest.fixture(params=["stub", "wan"])
def pipeline(request, wan):
    return wan if request.param == "wan" else StubPipeline()


def _open(pipeline, sid: str, **fields):
    start = StartSession(session_id=sid, **{"prompt": "a red fox", **fields})
    return pipeline.open(start, pipeline.describe(start), pipeline.encode_prompt(start.prompt))


def _denoise(pipeline, state, chunk: int, steps) -> None:
    for step in steps:
        row = BatchRow(state.session_id, chunk, step)
        [prediction] = pipeline.forward(StepBatch((row,)), [state])
        pipeline.sampler_step(state, row, prediction)


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b)


def test_the_staged_transformer_computes_what_the_model_computes(wan):
    """Embed, the blocks, the head, as three calls: bit for bit the model's one call."""
    model = wan.transformer
    generator = torch.Generator().manual_seed(3)
    latent = torch.randn(2, 16, 3, 8, 8, generator=generator)
    timestep = torch.tensor([937.5, 625.0])
    text = torch.cat([wan.encode_prompt("a fox"), wan.encode_prompt("a whale")])
    with torch.no_grad():
        expected = model(latent, timestep, encoder_hidden_states=text, return_dict=False)[0]
        activations = embed(model, latent, timestep, text)
        middle = len(model.blocks) // 2
        activations = run_blocks(model, run_blocks(model, activations, range(middle)), range(middle, len(model.blocks)))
        got = head(model, activations)
    assert torch.equal(got, expected)


def test_two_block_ranges_make_the_prediction_of_one(pipeline):
    """Rows at different chunks, positions and steps: blocks [0, k) then [k, n),
    handing the hidden states on, predict what [0, n) predicts, bit for bit."""
    assert isinstance(pipeline, ChunkPipeline) and pipeline.supports_micro_step_execution and pipeline.num_blocks >= 2
    driver = ChunkDriver(pipeline)
    a, b = driver.open(
        StartSession(session_id="ranges-a", prompt="a fox", seed=1),
        StartSession(session_id="ranges-b", prompt="a whale", seed=2),
    )
    driver.run(["ranges-b"], chunks=2)
    pipeline.boundary(a, 0)
    pipeline.boundary(b, 2)
    _denoise(pipeline, b, 2, range(1))
    batch = StepBatch((BatchRow(a.session_id, 0, 0), BatchRow(b.session_id, 2, 1)))
    n = pipeline.num_blocks
    k = n // 2
    one = pipeline.forward(batch, [a, b])
    first = pipeline.forward(batch, [a, b], blocks=range(k))
    assert isinstance(first, Hidden) and first.blocks_done == k and first.rows == batch.rows
    two = pipeline.forward(batch, [a, b], blocks=range(k, n), hidden=first)
    assert len(one) == len(two) == 2 and all(_same(x, y) for x, y in zip(one, two, strict=True))

    with pytest.raises(ValueError, match="need the hidden states of the range ending there"):
        pipeline.forward(batch, [a, b], blocks=range(k, n))
    other = StepBatch(batch.rows[:1])
    with pytest.raises(ValueError, match="need the hidden states"):
        pipeline.forward(other, [a], blocks=range(k, n), hidden=first)
    with pytest.raises(ValueError, match="takes no hidden states"):
        pipeline.forward(batch, [a, b], blocks=range(k), hidden=first)
    with pytest.raises(ValueError, match="contiguous range"):
        pipeline.forward(batch, [a, b], blocks=range(0, n + 1))
    driver.release("ranges-a", "ranges-b")


def test_a_commit_in_two_block_ranges_writes_what_one_writes(pipeline):
    """Two identical sessions' chunk 0, committed in one range and in two: the
    same cache, and the same next chunk."""
    one, two = _open(pipeline, "commit-one", seed=4), _open(pipeline, "commit-two", seed=4)
    steps = one.geometry.num_inference_steps
    for state in (one, two):
        pipeline.boundary(state, 0)
        _denoise(pipeline, state, 0, range(steps))
    n = pipeline.num_blocks
    assert pipeline.commit(one, 0) is None
    hidden = pipeline.commit(two, 0, blocks=range(n // 2))
    assert isinstance(hidden, Hidden) and not two.chunks[0].committed  # half the blocks: not yet
    with pytest.raises(ValueError, match="need the hidden states"):
        pipeline.commit(two, 0, blocks=range(n // 2, n))
    assert pipeline.commit(two, 0, blocks=range(n // 2, n), hidden=hidden) is None
    assert one.chunks[0].committed and two.chunks[0].committed
    if hasattr(one, "kv"):
        assert one.kv.frames == two.kv.frames == 3
        for layer in range(n):
            assert all(_same(x, y) for x, y in zip(one.kv.read(layer), two.kv.read(layer), strict=True))
    frames = [[pipeline.decode(state, 0).payload] for state in (one, two)]
    for state, made in zip((one, two), frames, strict=True):
        pipeline.boundary(state, 1)
        _denoise(pipeline, state, 1, range(steps))
        pipeline.commit(state, 1)
        made.append(pipeline.decode(state, 1).payload)
        pipeline.release(state)
    assert frames[0] == frames[1]


def test_chunk_k_decodes_while_chunk_k_plus_1_denoises(pipeline):
    """Temporal overlap within one session: once chunk k is committed, chunk
    k+1's boundary and denoise steps may run before chunk k is decoded (two
    chunks in flight at different noise levels). The frames are bit for bit
    those of the chunks run one after the other (the worker's runner)."""
    driver = ChunkDriver(pipeline)
    driver.open(StartSession(session_id="in-order", prompt="a red fox", seed=6, num_inference_steps=3))
    expected = [out.payload for out in driver.run(["in-order"], chunks=3)["in-order"]]
    driver.release("in-order")

    state = _open(pipeline, "overlapped", seed=6, num_inference_steps=3)
    pipeline.boundary(state, 0)
    _denoise(pipeline, state, 0, range(3))
    pipeline.commit(state, 0)
    made = []
    for k in range(2):
        pipeline.boundary(state, k + 1)
        _denoise(pipeline, state, k + 1, range(1))  # chunk k+1 one step in, chunk k committed, not decoded
        in_flight = {index: (chunk.at_step, chunk.committed) for index, chunk in state.chunks.items()}
        assert in_flight == {k: (3, True), k + 1: (1, False)}
        made.append(pipeline.decode(state, k).payload)
        _denoise(pipeline, state, k + 1, range(1, 3))
        pipeline.commit(state, k + 1)
    made.append(pipeline.decode(state, 2).payload)
    assert not state.chunks
    assert made == expected
    pipeline.release(state)


def test_a_stage_refuses_a_chunk_that_is_not_ready_for_it(pipeline):
    state = _open(pipeline, "refusals", seed=8, num_inference_steps=2)

    def refused(match: str, call, *args) -> None:
        with pytest.raises(ChunkOrderError, match=match):
            call(*args)

    def step(chunk: int, at: int) -> StepBatch:
        return StepBatch((BatchRow(state.session_id, chunk, at),))

    refused("chunk 0 was not prepared", pipeline.forward, step(0, 0), [state])
    refused("cannot commit chunk 0: it is not prepared", pipeline.commit, state, 0)
    pipeline.boundary(state, 0)
    refused("chunk 0 is already prepared", pipeline.boundary, state, 0)
    refused("chunk 1 cannot be prepared before chunk 0 is committed", pipeline.boundary, state, 1)
    refused("chunk 0 is at step 0, but the row asks for step 1", pipeline.forward, step(0, 1), [state])
    [prediction] = pipeline.forward(step(0, 0), [state])
    refused(
        "chunk 0 is at step 0, but the row asks for step 1",
        pipeline.sampler_step,
        state,
        step(0, 1).rows[0],
        prediction,
    )
    refused("cannot commit chunk 0: it is not denoised", pipeline.commit, state, 0)
    _denoise(pipeline, state, 0, range(2))
    refused("chunk 0 is denoised, but the row asks for step 0", pipeline.forward, step(0, 0), [state])
    refused("cannot decode chunk 0: it is not committed", pipeline.decode, state, 0)
    pipeline.commit(state, 0)
    refused("cannot commit chunk 0: it is already committed", pipeline.commit, state, 0)
    pipeline.boundary(state, 1)
    _denoise(pipeline, state, 1, range(2))
    pipeline.commit(state, 1)
    refused("chunk 1 cannot be decoded before chunk 0", pipeline.decode, state, 1)
    pipeline.decode(state, 0)
    pipeline.decode(state, 1)
    refused("cannot decode chunk 1: it is not prepared", pipeline.decode, state, 1)
    pipeline.release(state)


def test_the_runner_fails_only_the_session_whose_row_its_state_cannot_take():
    """The plan is the one record of progress: a row whose chunk was never
    prepared, or at a step its chunk is not at, fails its own session (the
    pipeline refuses it), and the other rows of the forward go on."""
    runner = ModelRunner(StubPipeline())
    starts = [StartSession(session_id=sid, prompt="p") for sid in ("good", "no-boundary", "skips")]
    first = MicroStep(
        number=1,
        open=starts,
        boundaries=[BoundaryTask("good", 0, None, 0), BoundaryTask("skips", 0, None, 0)],
        ranks=[[StepRow("good", 0, 0, 4), StepRow("no-boundary", 0, 0, 4), StepRow("skips", 0, 0, 4)]],
    )
    result = runner.execute(first)
    assert result.rows["good", 0].stepped and result.rows["good", 0].error is None
    assert result.rows["no-boundary", 0].error == (
        "forward failed: ChunkOrderError: session no-boundary: chunk 0 was not prepared (no boundary)"
    )
    skipped = runner.execute(MicroStep(number=2, ranks=[[StepRow("good", 0, 1, 4), StepRow("skips", 0, 2, 4)]]))
    assert skipped.rows["good", 0].stepped and skipped.rows["skips", 0].error == (
        "forward failed: ChunkOrderError: session skips: chunk 0 is at step 1, but the row asks for step 2"
    )
    assert runner.held_sessions() == (("good",), ("good",))


def test_the_driver_raises_what_the_pipeline_raised_and_releases_the_session():
    driver = ChunkDriver(StubPipeline(fail_prompt="doomed", fail_chunk=1))
    driver.open(StartSession(session_id="doomed", prompt="doomed"))
    assert driver.run_chunk("doomed").num_frames == 4
    with pytest.raises(RuntimeError, match="^stub pipeline: injected failure at chunk 1$"):
        driver.run_chunk("doomed")
    assert driver.runner.held_sessions() == ((), ())
