"""The causal Wan pipeline (the ``tiny`` preset) declares every optional part it
implements, no more, and passes the check its build runs; the worker's
decisions follow the declaration, not what the object happens to have."""

from __future__ import annotations

import pytest

from rtvideo.engine.config import PipelineSpec
from rtvideo.workers.decode_stage import decode_batch_rows
from rtvideo.workers.parallel.rank_decode import can_split, can_spread
from rtvideo.workers.pipelines import build_pipeline
from rtvideo.workers.pipelines.capabilities import Capabilities, PipelineContractError, check_pipeline, device_type
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline
from tests.unit.test_pipeline_capabilities import implemented


@pytest.fixture(scope="module")
def tiny():
    return build_pipeline(PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 0}), 2)


def test_the_tiny_preset_declares_what_it_implements_and_passes(tiny):
    assert set(tiny.capabilities.declared()) == implemented(tiny)
    assert tiny.capabilities == Capabilities(
        commit_batch=True,
        decode_batch=True,
        rank_decode=True,
        rank_decode_batch=True,
        split_decode=True,
        split_decode_batch=True,
        pipeline_ranks=True,
        kv_window=True,
        synchronize=True,
        video_input=True,
        step_graphs=True,
    )
    assert device_type(tiny) == "cpu"
    assert can_spread(tiny) and can_split(tiny)  # the tiny VAE's decoder has stages to split between
    assert decode_batch_rows(tiny) >= 2


def test_a_pipeline_that_declares_less_is_not_asked_for_more(tiny, monkeypatch):
    monkeypatch.setattr(CausalWanPipeline, "capabilities", Capabilities())
    assert check_pipeline(tiny) is tiny  # declaring less than it has is allowed: those parts go unused
    assert decode_batch_rows(tiny) == 1 and not can_spread(tiny) and not can_split(tiny)


def test_a_declared_part_whose_method_is_gone_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "decode_fronts", None)
    with pytest.raises(PipelineContractError) as refused:
        check_pipeline(tiny)
    assert str(refused.value) == (
        "pipeline 'tiny' (rtvideo.workers.pipelines.causal_wan.CausalWanPipeline) declares split_decode_batch: "
        "it has no method decode_fronts(sessions, cleans, split)"
    )
