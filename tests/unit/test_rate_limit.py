"""``TokenBucket``: a burst, then the rate; what a refusal says; the clock given, never read."""

from __future__ import annotations

import pytest

from rtvideo.server.rate_limit import TokenBucket


def test_a_full_bucket_takes_a_burst_then_refuses_until_a_token_grows_back():
    bucket = TokenBucket(rate=20.0, burst=40, now=100.0)
    assert [bucket.take(100.0) for _ in range(40)] == [None] * 40
    wait = bucket.take(100.0)
    assert wait == pytest.approx(1 / 20)  # the next token, at 20 per second
    assert bucket.take(100.0 + wait / 2) == pytest.approx(wait / 2)  # a refusal takes nothing
    assert bucket.take(100.0 + wait) is None
    assert bucket.take(100.0 + wait) is not None


def test_at_the_rate_it_never_refuses_and_faster_it_lets_through_the_rate():
    bucket = TokenBucket(rate=10.0, burst=1, now=0.0)
    assert all(bucket.take(i / 10) is None for i in range(1000))  # 10 per second: all of them
    bucket = TokenBucket(rate=10.0, burst=5, now=0.0)
    taken = sum(bucket.take(i / 100) is None for i in range(1000))  # 100 per second for 10 s
    assert 5 + 99 <= taken <= 5 + 100  # the burst, then 10 per second


def test_an_idle_bucket_refills_to_its_burst_and_no_further():
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    for _ in range(3):
        bucket.take(0.0)
    assert bucket.take(0.0) is not None
    assert sum(bucket.take(3600.0) is None for _ in range(10)) == 3


def test_a_clock_that_steps_back_gives_nothing():
    bucket = TokenBucket(rate=1.0, burst=1, now=10.0)
    assert bucket.take(10.0) is None
    assert bucket.take(5.0) is not None  # no token from a step back
    assert bucket.take(10.5) == pytest.approx(0.5)


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="rate must be > 0"):
        TokenBucket(rate=0.0, burst=1, now=0.0)
    with pytest.raises(ValueError, match="burst must be >= 1"):
        TokenBucket(rate=1.0, burst=0, now=0.0)


def test_amounts_are_taken_whole_or_not_at_all_and_never_more_than_the_burst():
    bucket = TokenBucket(rate=100.0, burst=1000, now=0.0)  # a connection's text: a token a character
    assert bucket.take(0.0, 600) is None
    assert bucket.take(0.0, 500) == pytest.approx(1.0)  # 400 left: 100 more in a second
    assert bucket.take(0.0, 400) is None  # the refused amount took nothing
    assert bucket.take(0.5, 100) == pytest.approx(0.5)
    assert bucket.take(1.0, 100) is None
    with pytest.raises(ValueError, match="cannot take 1001 tokens from a bucket of 1000"):
        bucket.take(100.0, 1001)
