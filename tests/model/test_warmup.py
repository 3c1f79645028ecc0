"""The worker's warm-up runs real chunks and leaves nothing behind."""

from __future__ import annotations

from tests.model.test_causal_wan import open_session, run_chunk
from workers.pipelines.causal_wan import build
from workers.pipelines.stub import StubPipeline
from workers.warmup import WARM_UP_SESSION, warm_up


def test_warm_up_runs_its_chunks_then_holds_nothing():
    warmed = build("tiny", device="cpu")
    assert warmed.warm_up_chunks == 2
    assert warm_up(warmed) > 0
    assert warmed.held_sessions() == ()
    assert warmed.encode_prompt("warm-up") is warmed._prompts["warm-up"]  # it did encode (and ran) a prompt


def test_a_session_after_warm_up_equals_one_on_a_cold_pipeline():
    warmed, cold = build("tiny", device="cpu"), build("tiny", device="cpu", warm_up_chunks=0)
    assert warm_up(cold) == 0.0
    warm_up(warmed)
    a, b = open_session(warmed, "a", seed=21), open_session(cold, "b", seed=21)
    assert [run_chunk(warmed, a)[0].payload for _ in range(3)] == [run_chunk(cold, b)[0].payload for _ in range(3)]


def test_the_stub_asks_for_no_warm_up():
    stub = StubPipeline()
    assert warm_up(stub) == 0.0 and WARM_UP_SESSION not in stub.held_sessions()
