"""Choosing the worker's CPU thread count from measured chunk times (``rtvideo.workers.cpu_threads``)."""

from __future__ import annotations

import pytest

from rtvideo.workers.cpu_threads import candidates, contenders_of, pick_threads


def test_candidates_are_one_the_powers_of_two_below_the_cores_and_the_cores():
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(6) == [1, 2, 4, 6]
    assert candidates(8) == [1, 2, 4, 8]
    assert candidates(0) == [1]  # os.cpu_count() may not know


def test_the_fastest_count_wins_and_fewer_threads_win_within_the_tolerance():
    # as measured on the 2-core machine: one thread 2.6x faster than two on the executor's thread
    assert pick_threads({1: [0.077, 0.071], 2: [0.193, 0.190]}) == 1
    assert pick_threads({1: [0.36], 2: [0.21]}) == 2  # two threads clearly faster
    assert pick_threads({1: [0.100], 2: [0.095], 4: [0.060]}) == 4
    assert pick_threads({1: [0.105], 2: [0.100]}) == 1  # within 10 %: fewer threads
    assert pick_threads({1: [0.112], 2: [0.100]}) == 2  # beyond it
    assert pick_threads({1: [0.5, 0.101], 2: [0.100]}) == 1  # each count by its best measurement
    assert pick_threads({1: [0.2], 2: [0.1]}, tolerance=1.5) == 1
    assert pick_threads({1: [], 2: [0.3]}) == 2  # a count not measured is not a choice


def test_no_measurement_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="no thread count was measured"):
        pick_threads({})
    with pytest.raises(ValueError, match="no thread count was measured"):
        pick_threads({1: [], 2: []})


def test_a_count_far_behind_after_a_round_is_not_measured_again():
    assert contenders_of({1: [0.07], 2: [0.19]}) == [1]
    assert contenders_of({1: [0.10], 2: [0.14], 4: [0.16]}) == [1, 2]
    assert contenders_of({1: [0.30, 0.10], 2: [0.12]}) == [1, 2]


def test_more_threads_than_cores_is_warned_of_naming_both():
    from rtvideo.workers.cpu_threads import oversubscribed, usable_cores

    assert oversubscribed(2, 2) is None and oversubscribed(1, 16) is None
    assert oversubscribed(64, 2).startswith("--cpu-threads 64 is more than the 2 cores this worker may run on")
    assert usable_cores() >= 1
