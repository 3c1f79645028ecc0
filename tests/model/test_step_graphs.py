"""``StepGraphs``: which denoise forwards are captured, under which key, and
that a replay reads its inputs from static copies and hands back a copy.

On a CPU ``EagerReplay`` stands in for the CUDA capture (each replay runs the
captured function again over the same static buffers); the capture itself is
CUDA's. The pipeline's route through it: ``test_captured_step_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from rtvideo.workers.pipelines.step_graphs import EagerReplay, StepGraphs, StepKey


def key(*caches: int, held: int = 21) -> StepKey:
    caches = caches or (1,)
    rows = len(caches)
    return StepKey(
        caches,
        workspaces=tuple(7 + c for c in caches),
        held_frames=(held,) * rows,
        latent_shape=(rows, 16, 3, 4, 4),
        text_shape=(rows, 8, 4),
        dtype="fp32",
    )


def double(inputs):
    return inputs["latent"] * 2


def test_a_key_is_captured_on_its_second_use_then_replayed_with_new_inputs():
    graphs = StepGraphs(EagerReplay())
    outs = [graphs.run(key(), {"latent": torch.full((2,), float(i))}, double) for i in range(4)]
    assert [o.tolist() for o in outs] == [[0, 0], [2, 2], [4, 4], [6, 6]]
    figures = {"captures": 1, "replays": 3, "fallbacks": 1, "evictions": 0, "capture_failures": 0, "held": 1}
    assert graphs.figures() == figures


def test_a_replay_copies_its_inputs_and_its_output():
    graphs = StepGraphs(EagerReplay(), after_uses=1)
    latent = torch.ones(2)
    first = graphs.run(key(), {"latent": latent}, double)
    latent.fill_(5.0)  # the caller's tensor changing after the call does not reach the graph's copy
    second = graphs.run(key(), {"latent": torch.full((2,), 3.0)}, double)
    assert first.tolist() == [2, 2] and second.tolist() == [6, 6]


def test_graphs_are_bounded_least_recently_used_first_and_forgotten_with_their_cache():
    graphs = StepGraphs(EagerReplay(), most=2, after_uses=1)
    for cache in (1, 2, 1, 3):
        graphs.run(key(cache), {"latent": torch.ones(1)}, double)
    assert set(k.caches for k in graphs.graphs) == {(1,), (3,)} and graphs.evictions == 1
    graphs.forget(1)
    assert set(k.caches for k in graphs.graphs) == {(3,)}


def test_a_batch_graph_is_forgotten_with_any_of_its_rows_caches():
    graphs = StepGraphs(EagerReplay(), after_uses=1)
    for caches in ((1, 2), (2, 3), (3,)):
        graphs.run(key(*caches), {"latent": torch.ones(1)}, double)
    graphs.forget(2)
    assert list(graphs.graphs) == [key(3)]
    graphs.uses[key(3, 4)] += 1  # a batch seen once, not yet captured
    graphs.forget(4)
    assert not graphs.uses


def test_keys_differ_by_what_the_graph_bakes_in():
    graphs = StepGraphs(EagerReplay(), after_uses=1)
    for held in (3, 6, 6):
        graphs.run(key(held=held), {"latent": torch.ones(1)}, double)
    assert graphs.captures == 2 and graphs.replays == 3


def test_bad_bounds_and_a_cpu_capture_are_refused():
    from rtvideo.workers.pipelines.step_graphs import CudaGraphCapture

    with pytest.raises(ValueError, match="most"):
        StepGraphs(EagerReplay(), most=0)
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphCapture(torch.device("cpu"))
