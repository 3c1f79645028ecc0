"""When the heartbeat calls a worker wedged: the loop's silence against the
floor, and one forward against a deadline derived from measured chunks."""

from __future__ import annotations

from rtvideo.engine.client.heartbeat import FACTOR, Heartbeat
from rtvideo.engine.messages import ProbeReply


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reply(probe_id: int, executing_s: float = 0.0) -> ProbeReply:
    return ProbeReply(
        probe_id=probe_id,
        sessions=(),
        runner_sessions=(),
        pipeline_sessions=(),
        iterations=0,
        busy_s=0.0,
        pipeline_s=0.0,
        steps=0,
        chunks=0,
        executing_s=executing_s,
    )


def beat(floor_s: float = 10.0, unmeasured_s: float = 300.0, rows: int = 1) -> tuple[Heartbeat, Clock]:
    clock = Clock()
    return Heartbeat(floor_s, unmeasured_s, rows, clock=clock), clock


def test_a_silent_loop_is_wedged_at_the_floor_whatever_a_chunk_costs():
    heartbeat, clock = beat()
    heartbeat.observe(64, 64, 30.0)  # slow chunks do not stretch a silence
    heartbeat.sent(1)
    clock.now += 9.9
    assert heartbeat.verdict([(64, 64)]) is None
    assert heartbeat.status([(64, 64)])[0] == "busy"
    heartbeat.sent(2)  # a later probe does not restart the count
    clock.now += 0.1
    assert "answered no probe for 10.0 s (deadline 10 s)" in heartbeat.verdict([(64, 64)])
    heartbeat.answered(reply(2))  # answering the later one answers both
    assert heartbeat.verdict([(64, 64)]) is None and heartbeat.status([])[0] == "ok"


def test_a_forward_runs_up_to_ten_times_the_slowest_chunk_of_its_size_or_larger():
    heartbeat, clock = beat(floor_s=1.0)
    heartbeat.observe(64, 64, 0.25)
    heartbeat.observe(64, 64, 0.5)  # the slowest counts
    heartbeat.observe(16, 16, 9.0)  # smaller sessions say nothing of larger ones
    assert heartbeat.deadline([(64, 64)]) == (FACTOR * 0.5, "10 x the slowest chunk measured, 0.50 s")
    assert heartbeat.deadline([(60, 60)])[0] == FACTOR * 0.5  # same size bucket (within 2x of pixels)
    heartbeat.sent(1)
    heartbeat.answered(reply(1, executing_s=4.9))
    assert heartbeat.verdict([(64, 64)]) is None
    clock.now += 0.1  # aged since the answer, while the loop keeps answering
    heartbeat.sent(2)
    heartbeat.answered(reply(2, executing_s=5.0))
    assert "one forward has run for 5.0 s, past its deadline of 5.0 s" in heartbeat.verdict([(64, 64)])


def test_an_unmeasured_size_gets_the_startup_timeout_and_a_fast_one_the_floor():
    heartbeat, _ = beat(floor_s=10.0, unmeasured_s=300.0)
    assert heartbeat.deadline([(64, 64)]) == (300.0, "no chunk of this size measured yet")
    heartbeat.observe(64, 64, 0.1)
    assert heartbeat.deadline([(64, 64)]) == (10.0, "the floor")  # 10 x 0.1 s is under the floor
    assert heartbeat.deadline([(64, 64), (1280, 1280)])[0] == 300.0  # the largest open session decides
    heartbeat.observe(1280, 1280, 20.0)
    assert heartbeat.deadline([(64, 64)])[0] == 200.0  # a larger size measured bounds a smaller one
    assert heartbeat.deadline([])[0] == 200.0  # nothing open: the slowest measured


def test_batched_rows_stretch_the_deadline_and_a_restart_keeps_the_measurements():
    heartbeat, _ = beat(floor_s=1.0, rows=4)
    heartbeat.observe(64, 64, 0.5)  # a chunk's share of a batched forward
    assert heartbeat.deadline([(64, 64)]) == (20.0, "10 x the slowest chunk measured, 0.50 s x 4 rows")
    heartbeat.sent(1)
    heartbeat.reset()  # the worker died: nothing is outstanding; the model is the same
    assert heartbeat.silent_s() == 0.0 and heartbeat.last_reply is None
    assert heartbeat.deadline([(64, 64)])[0] == 20.0


def test_a_stale_answer_leaves_the_verdict_to_the_silence():
    heartbeat, clock = beat(floor_s=10.0)
    heartbeat.observe(64, 64, 0.1)
    heartbeat.sent(1)
    heartbeat.answered(reply(1, executing_s=9.0))
    heartbeat.sent(2)
    clock.now += 5.0  # no answer since: a stopped process, not a long forward
    assert heartbeat.executing_s() == 14.0
    assert heartbeat.verdict([(64, 64)]) is None
    clock.now += 5.0
    assert "answered no probe" in heartbeat.verdict([(64, 64)])
