"""The worker's warm-up runs real chunks and leaves nothing behind."""

from __future__ import annotations

from rtvideo.engine.messages import StartSession
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.warmup import WARM_UP_SESSION, warm_up
from tests.model.test_causal_wan import open_session, run_chunk


def _count_warm_up(warmed) -> tuple[list, list, list]:
    """Run ``warm_up`` counting: text encoder calls, transformer passes (each pass
    runs the first block once over all its rows: that block's input shape, rows
    first; rows are embedded one by one) and decoder calls (rows, first chunk)."""
    encoded, forwards, decoded = [], [], []
    warmed.text_encoder.register_forward_hook(lambda module, args, out: encoded.append(args[0].shape))
    first_block = warmed.transformer.blocks[0]
    first_block.register_forward_hook(lambda module, args, out: forwards.append(tuple(args[0].shape)))
    decode = warmed.decoder.decode
    warmed.decoder.decode = lambda latents, cache, first: (
        decoded.append((latents.shape[0], first)) or decode(latents, cache, first)
    )
    assert warm_up(warmed) > 0
    return encoded, forwards, decoded


def test_warm_up_runs_its_chunks_then_holds_nothing():
    """Counted while ``warm_up`` runs, nothing called after it: one prompt
    encoded (left in the prompt cache), every forward of its chunks (each
    chunk: its denoise steps, then the commit) at the default size, first of
    ``max_batch_rows`` sessions in lockstep (each denoise step one forward of
    all their rows, then one commit pass of them all), then of one session
    alone, each
    chunk decoded (the lockstep sessions' chunks in one batch, so that the
    memory peak is a batched decode's too); then its sessions released, roped keys included."""
    warmed = build("tiny", device="cpu")
    assert warmed.warm_up_chunks == 2 and warmed.max_batch_rows == 4 and not warmed._prompts

    encoded, forwards, decoded = _count_warm_up(warmed)

    assert list(warmed._prompts) == ["warm-up"] and len(encoded) == 1
    steps = warmed.describe(StartSession(session_id="x", prompt="x")).num_inference_steps
    one, four = (1, 48, 24), (4, 48, 24)  # 64x64: 8x8 latents, 3 frames of 4x4 patches; 2 heads x 12
    alone = [one] * (steps + 1)
    batched = [four] * (steps + 1)  # the commit too: one pass of four rows
    assert forwards == batched * warmed.warm_up_chunks + alone * warmed.warm_up_chunks
    assert decoded == [(4, True), (4, False), (1, True), (1, False)]  # each stream's first chunk, then a cached one
    assert warmed.held_sessions() == () and not warmed.context.roped.entries


def test_a_pipeline_of_one_row_a_forward_warms_one_session():
    warmed = build("tiny", device="cpu", max_batch_rows=1)
    _, forwards, decoded = _count_warm_up(warmed)
    steps = warmed.describe(StartSession(session_id="x", prompt="x")).num_inference_steps
    assert forwards == [(1, 48, 24)] * (warmed.warm_up_chunks * (steps + 1))
    assert decoded == [(1, True), (1, False)] and warmed.held_sessions() == ()


def test_a_session_after_warm_up_equals_one_on_a_cold_pipeline():
    warmed, cold = build("tiny", device="cpu"), build("tiny", device="cpu", warm_up_chunks=0)
    assert warm_up(cold) == 0.0
    warm_up(warmed)
    a, b = open_session(warmed, "a", seed=21), open_session(cold, "b", seed=21)
    assert [run_chunk(warmed, a)[0].payload for _ in range(3)] == [run_chunk(cold, b)[0].payload for _ in range(3)]


def test_the_stub_asks_for_no_warm_up():
    stub = StubPipeline()
    assert warm_up(stub) == 0.0 and WARM_UP_SESSION not in stub.held_sessions()


def test_with_captured_steps_the_session_alone_runs_until_its_graphs_are_captured():
    """``cuda_graphs`` (here its eager mode): the session alone runs
    ``capture_chunks`` chunks, past the window's filling, so both its graphs
    are captured; its cache is kept for the next session of the default size
    (``tests/model/test_captured_step_graphs.py`` follows that session)."""
    warmed = build("tiny", device="cpu", cuda_graphs="eager", max_batch_rows=1, sink_frames=3, window_frames=3)
    _, forwards, decoded = _count_warm_up(warmed)
    steps = warmed.describe(StartSession(session_id="x", prompt="x")).num_inference_steps
    assert warmed.capture_chunks == 4 > warmed.warm_up_chunks  # 3 + 3 frames fill in two chunks of 3
    rehearsals = warmed.step_graphs.captures  # each capture rehearses its forward once (capture_rules)
    assert len(forwards) == warmed.capture_chunks * (steps + 1) + rehearsals
    assert len(decoded) == warmed.capture_chunks
    assert warmed.step_graphs.captures == 2 and warmed.held_sessions() == ()
    assert warmed.graph_figures()["kept_caches"] == 1
