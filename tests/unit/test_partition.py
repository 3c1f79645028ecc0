"""Splitting the transformer's blocks over pipeline ranks by measured cost."""

from __future__ import annotations

import itertools

import pytest

from rtvideo.workers.parallel.partition import StageCosts, pace, rank_seconds, split_blocks, split_decoder


def brute_force(costs: StageCosts, ranks: int) -> float:
    """The best pace over every contiguous split (a reference for small cases)."""
    n = len(costs.blocks)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        bounds = (0, *cuts, n)
        split = [range(a, b) for a, b in itertools.pairwise(bounds)]
        best = min(best, pace(costs, split))
    return best


def test_equal_blocks_split_evenly():
    split = split_blocks(StageCosts((1.0,) * 30), 3)
    assert split == [range(0, 10), range(10, 20), range(20, 30)]


def test_the_first_ranks_extra_work_gives_it_fewer_blocks():
    # 30 equal blocks of 1 ms; rank 0 also embeds, steps the sampler and crosses boundaries (6 ms a pass).
    split = split_blocks(StageCosts((1.0,) * 30, first_extra=6.0), 2)
    assert split == [range(0, 12), range(12, 30)]
    assert pace(StageCosts((1.0,) * 30, first_extra=6.0), split) == 18.0


def test_the_last_ranks_head_and_decode_are_counted_too():
    split = split_blocks(StageCosts((1.0,) * 8, last_extra=4.0), 2)
    assert split == [range(0, 6), range(6, 8)]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_split_is_as_fast_as_the_best_contiguous_split(seed, ranks):
    import random

    rng = random.Random(seed)
    costs = StageCosts(
        tuple(rng.uniform(0.1, 3.0) for _ in range(rng.randint(ranks, 9))),
        first_extra=rng.uniform(0, 4),
        last_extra=rng.uniform(0, 4),
    )
    split = split_blocks(costs, ranks)
    assert [r.start for r in split][0] == 0 and split[-1].stop == len(costs.blocks)
    assert all(len(r) >= 1 for r in split)
    assert all(a.stop == b.start for a, b in itertools.pairwise(split))
    assert pace(costs, split) == pytest.approx(brute_force(costs, ranks))


def test_more_ranks_than_blocks_is_refused_naming_both():
    with pytest.raises(ValueError, match="2 transformer blocks: it cannot be split over 3 pipeline ranks"):
        split_blocks(StageCosts((1.0, 1.0)), 3)


def test_each_ranks_seconds_count_its_blocks_and_its_edge_work():
    costs = StageCosts((1.0, 2.0, 3.0), first_extra=0.5, last_extra=0.25)
    assert rank_seconds(costs, [range(0, 2), range(2, 3)]) == [3.5, 3.25]
    assert pace(costs, [range(0, 1), range(1, 3)]) == 5.25


def test_the_decoder_changes_rank_where_the_busier_rank_is_least_busy():
    stages = [10.0, 10.0, 15.0, 20.0, 25.0, 5.0]  # the late stages cost most, as the tiny preset's do
    assert split_decoder(stages, front_rank=0.0, back_rank=0.0) == 3  # 35 | 50 beats 55 | 30 and 20 | 65
    assert split_decoder(stages, front_rank=16.0, back_rank=10.0) == 3  # 51 | 60 beats 71 | 40
    assert split_decoder(stages, front_rank=100.0, back_rank=0.0) == 1  # the front rank is full already
    assert split_decoder(stages, front_rank=0.0, back_rank=100.0) == 5
    assert split_decoder([1.0, 1.0], 0.0, 0.0) == 1  # a tie: fewer stages in front (rank 0 also plans)
    with pytest.raises(ValueError, match="a decoder of 1 stages cannot be split"):
        split_decoder([1.0], 0.0, 0.0)
