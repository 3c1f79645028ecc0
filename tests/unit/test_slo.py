"""SLO control (``rtvideo.engine.slo``): the micro-step budget worked out by hand, and
the rows controller driven by scripted timing traces. Times are chosen exact
in binary floating point, and most traces use ``alpha=1`` (the average is the
last step) or ``alpha=0.5`` so every average is exact too."""

from __future__ import annotations

import math

import pytest

from rtvideo.engine.slo import SloController, SloDecision, SloTarget, micro_step_budget


def run(ctrl: SloController, trace: list[tuple[float, float | None, int | None]]) -> list[tuple[str, int]]:
    """Feed (step_s, budget_s, rows_used) observations; rows_used None means
    "all the rows allowed"; returns (action, rows) per observation."""
    out = []
    for step_s, budget_s, used in trace:
        decision = ctrl.observe(step_s, budget_s, ctrl.rows if used is None else used)
        assert decision.rows == ctrl.rows
        out.append((decision.action, decision.rows))
    return out


# micro_step_budget

GEOMETRY = dict(frames_per_chunk=8, first_chunk_frames=4, passes_per_chunk=4, ranks=2)  # 8 micro-steps a chunk


def test_exact_mode_budget_is_a_chunks_media_time_over_its_micro_steps():
    # 8 frames at 16 fps = 0.5 s of media, over 4 passes * 2 ranks = 8 micro-steps.
    assert micro_step_budget(SloTarget(fps=16.0, first_chunk_s=None), **GEOMETRY) == 0.0625
    assert micro_step_budget(SloTarget(fps=32.0, first_chunk_s=None), **GEOMETRY) == 0.03125


def test_stream_batch_multiplies_the_budget_by_chunks_in_flight():
    target = SloTarget(fps=16.0, first_chunk_s=None)
    assert micro_step_budget(target, **GEOMETRY, chunks_in_flight=2) == 0.125
    assert micro_step_budget(target, **GEOMETRY, chunks_in_flight=4) == 0.25


def test_first_chunk_pending_takes_the_tighter_of_latency_and_keep_up():
    # Pending: the chunk is the first one, 4 frames = 0.25 s, so keep-up is 0.25 / 8 = 0.03125.
    loose = SloTarget(fps=16.0, first_chunk_s=1.0)  # 1.0 / 8 = 0.125: keep-up is tighter
    tight = SloTarget(fps=16.0, first_chunk_s=0.125)  # 0.125 / 8 = 0.015625: latency is tighter
    assert micro_step_budget(loose, **GEOMETRY, first_chunk_pending=True) == 0.03125
    assert micro_step_budget(tight, **GEOMETRY, first_chunk_pending=True) == 0.015625
    # Stream batch does not shorten the first chunk's own passes: 0.125 / 8, not / 4.
    assert micro_step_budget(tight, **GEOMETRY, chunks_in_flight=2, first_chunk_pending=True) == 0.015625
    # No latency target: keep-up only.
    none = SloTarget(fps=16.0, first_chunk_s=None)
    assert micro_step_budget(none, **GEOMETRY, first_chunk_pending=True) == 0.03125
    # Once the first chunk is out its latency target no longer applies.
    assert micro_step_budget(tight, **GEOMETRY) == 0.0625


@pytest.mark.parametrize(
    "name", ["frames_per_chunk", "first_chunk_frames", "passes_per_chunk", "ranks", "chunks_in_flight"]
)
@pytest.mark.parametrize("value", [0, -1])
def test_budget_refuses_a_non_positive_count_by_name(name, value):
    args = {**GEOMETRY, "chunks_in_flight": 1, name: value}
    with pytest.raises(ValueError, match=name):
        micro_step_budget(SloTarget(fps=16.0, first_chunk_s=None), **args)


@pytest.mark.parametrize(
    ("fps", "first_chunk_s", "name"),
    [
        (0.0, None, "fps"),
        (-16.0, None, "fps"),
        (math.nan, None, "fps"),
        (16.0, 0.0, "first_chunk_s"),
        (16.0, -1.0, "first_chunk_s"),
    ],
)
def test_target_refuses_a_non_positive_value_by_name(fps, first_chunk_s, name):
    with pytest.raises(ValueError, match=name):
        SloTarget(fps=fps, first_chunk_s=first_chunk_s)


# SloController


def test_rows_start_at_max_rows_or_initial_rows():
    assert SloController(4).rows == 4
    assert SloController(4, initial_rows=2).rows == 2


def test_a_steady_fast_trace_grows_rows_one_by_one_up_to_max_then_holds():
    ctrl = SloController(4, initial_rows=1)  # default alpha, headroom 0.25, headroom_streak 4
    actions = run(ctrl, [(0.5, 1.0, None)] * 16)
    grow = [("hold", 1)] * 3 + [("increase", 2)] + [("hold", 2)] * 3 + [("increase", 3)]
    grow += [("hold", 3)] * 3 + [("increase", 4)] + [("hold", 4)] * 4
    assert actions == grow
    assert ctrl.decisions == {"hold": 13, "increase": 3, "decrease": 0}


def test_a_single_spike_does_not_decrease():
    ctrl = SloController(4, alpha=0.5)
    # 0.875 is within budget, above headroom: hold. The spike takes the average to
    # 1.0625 (one miss), the next step back to 0.96875: the streak breaks.
    decisions = [ctrl.observe(s, 1.0, 4) for s in (0.875, 1.25, 0.875, 0.875)]
    assert [d.ema_s for d in decisions] == [0.875, 1.0625, 0.96875, 0.921875]
    assert [(d.action, d.rows) for d in decisions] == [("hold", 4)] * 4


def test_an_in_budget_step_breaks_the_miss_streak():
    ctrl = SloController(4, alpha=1.0)
    assert run(ctrl, [(2.0, 1.0, None), (0.875, 1.0, None), (2.0, 1.0, None)]) == [("hold", 4)] * 3


def test_a_sustained_slowdown_halves_then_halves_again_never_below_min_rows():
    ctrl = SloController(8, min_rows=2, alpha=1.0)
    actions = run(ctrl, [(2.0, 1.0, None)] * 8)
    assert actions == [
        ("hold", 8),
        ("decrease", 4),
        ("hold", 4),
        ("decrease", 2),
        ("hold", 2),
        ("hold", 2),
        ("hold", 2),
        ("hold", 2),
    ]
    assert ctrl.decisions["decrease"] == 2


@pytest.mark.parametrize(("max_rows", "min_rows", "rows"), [(7, 1, [7, 3, 1]), (8, 3, [8, 4, 3])])
def test_halving_rounds_down_and_stops_at_min_rows(max_rows, min_rows, rows):
    ctrl = SloController(max_rows, min_rows=min_rows, alpha=1.0, miss_streak=1)
    assert [rows for _, rows in run(ctrl, [(2.0, 1.0, None)] * 3)] == rows[1:] + [min_rows]


def test_a_decrease_says_why():
    ctrl = SloController(4, alpha=1.0)
    ctrl.observe(0.3125, 0.25, 4)
    decision = ctrl.observe(0.3125, 0.25, 4)
    assert decision == SloDecision(
        rows=2,
        action="decrease",
        ema_s=0.3125,
        budget_s=0.25,
        reason="micro-step 0.312 s over budget 0.25 s 2 times in a row: rows 4 -> 2",
    )


def test_a_limit_nobody_reaches_never_grows():
    ctrl = SloController(4, initial_rows=2, alpha=1.0, headroom_streak=2)
    assert run(ctrl, [(0.25, 1.0, 1)] * 10) == [("hold", 2)] * 10
    # A step that does not fill its rows breaks the headroom streak.
    trace = [(0.25, 1.0, None), (0.25, 1.0, 0), (0.25, 1.0, None), (0.25, 1.0, None)]
    assert run(ctrl, trace) == [("hold", 2), ("hold", 2), ("hold", 2), ("increase", 3)]


def test_no_budget_holds_and_breaks_the_streaks():
    ctrl = SloController(4, alpha=1.0)
    decisions = [ctrl.observe(9.0, None, 4) for _ in range(5)]
    assert [(d.action, d.rows, d.budget_s) for d in decisions] == [("hold", 4, None)] * 5
    assert run(ctrl, [(2.0, 1.0, None), (2.0, None, None), (2.0, 1.0, None), (2.0, 1.0, None)]) == [
        ("hold", 4),
        ("hold", 4),
        ("hold", 4),
        ("decrease", 2),
    ]


def test_the_average_restarts_after_a_change_and_rows_recover():
    ctrl = SloController(4, alpha=0.5, headroom_streak=2)
    decisions = [ctrl.observe(s, 1.0, ctrl.rows) for s in (4.0, 4.0, 0.5, 0.5, 0.5, 0.5)]
    # Without the restart the step after the decrease would average 2.25 (a miss).
    assert [d.ema_s for d in decisions] == [4.0, 4.0, 0.5, 0.5, 0.5, 0.5]
    assert [(d.action, d.rows) for d in decisions] == [
        ("hold", 4),
        ("decrease", 2),
        ("hold", 2),
        ("increase", 3),
        ("hold", 3),
        ("increase", 4),
    ]
    assert ctrl.ema_s is None  # restarted after the last increase


def test_the_average_is_exponential_in_alpha():
    ctrl = SloController(4, alpha=0.5)
    assert [ctrl.observe(s, None, 4).ema_s for s in (1.0, 0.0, 0.0, 1.0)] == [1.0, 0.5, 0.25, 0.625]


def test_a_step_planned_under_a_larger_limit_counts_as_binding():
    ctrl = SloController(4, initial_rows=2, alpha=1.0, headroom_streak=1)
    assert ctrl.observe(0.25, 1.0, 4).action == "increase"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_rows=0), "max_rows"),
        (dict(max_rows=4, min_rows=0), "min_rows"),
        (dict(max_rows=4, min_rows=5), "min_rows"),
        (dict(max_rows=4, min_rows=2, initial_rows=1), "initial_rows"),
        (dict(max_rows=4, initial_rows=5), "initial_rows"),
        (dict(max_rows=4, alpha=0.0), "alpha"),
        (dict(max_rows=4, alpha=1.5), "alpha"),
        (dict(max_rows=4, miss_streak=0), "miss_streak"),
        (dict(max_rows=4, headroom_streak=0), "headroom_streak"),
        (dict(max_rows=4, headroom=-0.1), "headroom"),
        (dict(max_rows=4, headroom=1.0), "headroom"),
    ],
)
def test_the_controller_refuses_bad_settings_by_name(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        SloController(**kwargs)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-0.5, 1.0, 1), "step_s"),
        ((math.inf, 1.0, 1), "step_s"),
        ((math.nan, 1.0, 1), "step_s"),
        ((0.5, 0.0, 1), "budget_s"),
        ((0.5, -1.0, 1), "budget_s"),
        ((0.5, math.nan, 1), "budget_s"),
        ((0.5, 1.0, -1), "rows_used"),
    ],
)
def test_observe_refuses_bad_inputs_by_name_and_changes_nothing(args, name):
    ctrl = SloController(4)
    with pytest.raises(ValueError, match=f"^{name} "):
        ctrl.observe(*args)
    assert (ctrl.rows, ctrl.ema_s, sum(ctrl.decisions.values())) == (4, None, 0)
