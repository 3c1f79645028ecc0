"""When a decode lane's waiting chunks go (``rtvideo.workers.decode_gather.RoundGather``),
on scripted arrivals and micro-steps; and the ordered thread that asks it
(``rtvideo.workers.ordered_thread.OrderedThread`` with ``ready``)."""

from __future__ import annotations

import threading

import pytest

from rtvideo.workers.decode_gather import RoundGather
from rtvideo.workers.ordered_thread import OrderedThread


class Lane:
    """What waits on a lane, as ``RankDecodeStage`` queues it: (session, chunk, arrived)."""

    def __init__(self, gather: RoundGather) -> None:
        self.gather = gather
        self.waiting: list[tuple[str, int, int]] = []
        self.chunk: dict[str, int] = {}

    def commit(self, *sessions: str) -> None:
        for sid in sessions:
            index = self.chunk[sid] = self.chunk.get(sid, -1) + 1
            self.waiting.append((sid, index, self.gather.arrived(sid)))

    def steps(self, count: int, idle: bool = False) -> None:
        for _ in range(count):
            self.gather.step_done(idle)

    def take(self) -> list[str] | None:
        """What goes now (and is gone from the lane), or None while it waits."""
        if not self.waiting or not self.gather.ready(self.waiting):
            return None
        taken, self.waiting = [item[0] for item in self.waiting], []
        return taken


def test_a_round_goes_once_every_session_on_the_lane_has_a_chunk_waiting():
    lane = Lane(RoundGather(most=4))
    lane.commit("a", "b", "c", "d")  # the first round, together
    assert lane.take() == ["a", "b", "c", "d"]
    # then as a two-rank ring makes them: 3, 7 and 3 micro-steps apart, each session every 20
    lane.steps(20)
    lane.commit("a")
    lane.steps(3)
    lane.commit("b")
    lane.steps(7)
    lane.commit("c")
    assert lane.take() is None  # 10 of a's 19 micro-steps of patience
    lane.steps(3)
    lane.commit("d")
    assert lane.take() == ["a", "b", "c", "d"]


def test_a_session_that_does_not_come_holds_the_round_one_micro_step_less_than_a_chunk_takes():
    lane = Lane(RoundGather(most=4))
    lane.commit("a", "b", "c")
    assert lane.take() == ["a", "b", "c"]
    lane.steps(20)
    lane.commit("a", "b")  # c paused
    lane.steps(18)
    assert lane.take() is None
    lane.steps(1)
    assert lane.take() == ["a", "b"]
    lane.gather.forget("c")  # released: the lane waits for it no more
    lane.steps(20)
    lane.commit("a")
    lane.steps(3)
    assert lane.take() is None
    lane.commit("b")
    assert lane.take() == ["a", "b"]


def test_before_a_session_has_a_period_it_waits_a_micro_step_per_other_session():
    lane = Lane(RoundGather(most=4))
    lane.commit("a")  # b and c are on the lane already
    lane.gather.arrived("b"), lane.gather.arrived("c")
    lane.steps(1)
    assert lane.take() is None
    lane.steps(1)
    assert lane.take() == ["a"]


def test_a_full_batch_or_an_idle_executor_sends_what_waits_at_once():
    lane = Lane(RoundGather(most=2))
    for sid in "abc":
        lane.gather.arrived(sid)
    lane.steps(20)
    lane.commit("a", "b")
    assert lane.take() == ["a", "b"]  # as many as a batch takes
    lane.steps(20)
    lane.commit("a")
    lane.steps(1)
    assert lane.take() is None
    lane.steps(1, idle=True)  # nothing left to run: nothing more can come until the loop plans again
    assert lane.take() == ["a"]
    lane.commit("b")  # a new chunk means the executor is running again
    assert lane.take() is None


def test_one_session_alone_never_waits():
    lane = Lane(RoundGather(most=4))
    lane.commit("a")
    assert lane.take() == ["a"]
    lane.steps(5)
    lane.commit("a")
    assert lane.take() == ["a"]


def test_most_must_be_positive():
    with pytest.raises(ValueError, match="most must be >= 1, got 0"):
        RoundGather(0)


def test_the_ordered_thread_takes_what_waits_once_ready_says_so_and_at_close():
    allowed = threading.Event()
    taken: list[list[int]] = []
    done = threading.Event()

    def handle_all(items: list[int]) -> bool:
        taken.append(items)
        done.set()
        return True

    thread = OrderedThread("gathering", lambda item: True, handle_all, lambda waiting: allowed.is_set())
    for item in (1, 2, 3):
        thread.submit(item)
    assert thread.pending == 3 and not taken
    allowed.set()
    thread.recheck()
    assert done.wait(10)
    assert taken == [[1, 2, 3]] and thread.pending == 0
    allowed.clear()
    done.clear()
    thread.submit(4)
    thread.close()  # closing takes what waits, ready or not
    assert taken == [[1, 2, 3], [4]]
    with pytest.raises(ValueError, match="ready needs handle_all"):
        OrderedThread("bad", lambda item: True, ready=lambda waiting: True)
