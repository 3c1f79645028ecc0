"""SLO control: how many session rows a micro-step may carry.

Policy only (loop thread of worker rank 0), after StreamDiffusionV2's
SLO-aware batching for temporal pipeline parallelism. A micro-step admits up
to ``rows`` session rows at the first pipeline rank; each row is one pass
(a denoise step, or the commit pass) of one chunk of one session, and each
pass crosses ``ranks`` ranks, one micro-step per rank. More rows serve more
sessions per micro-step but make the micro-step longer, and a session keeps
up with its viewer only while a micro-step stays within its budget
(``micro_step_budget``).

The controller is additive-increase / multiplicative-decrease on an
exponential moving average of the measured micro-step time:

- ``miss_streak`` observations in a row with the average over the budget
  halve the rows (never below ``min_rows``): a miss costs the viewer a stall,
  so back off fast;
- ``headroom_streak`` observations in a row with the average at most
  ``(1 - headroom) * budget`` while the limit was binding (the micro-step
  carried all the rows it was allowed) add one row (never above
  ``max_rows``): probe for throughput slowly, and only where someone would
  use it;
- anything else holds. After a change both streaks reset and the average
  restarts from the next observation, since the step time depends on rows.

A single spike does not change anything (the streak, and the average, absorb
it); a micro-step with no session target (``budget_s`` None) holds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

ACTIONS = ("hold", "decrease", "increase")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class SloTarget:
    """A session's service target."""

    fps: float  # playback frames per second it must be fed at (> 0)
    first_chunk_s: float | None  # time to its first chunk, None: no target

    def __post_init__(self) -> None:
        _positive("fps", self.fps)
        if self.first_chunk_s is not None:
            _positive("first_chunk_s", self.first_chunk_s)


def micro_step_budget(
    target: SloTarget,
    *,
    frames_per_chunk: int,
    first_chunk_frames: int,
    passes_per_chunk: int,
    ranks: int,
    chunks_in_flight: int = 1,
    first_chunk_pending: bool = False,
) -> float:
    """Seconds one micro-step may take so the session keeps up: a chunk's media
    time (frames / fps) divided by the micro-steps a chunk needs
    (``passes_per_chunk * ranks / chunks_in_flight``). The chunk is the first
    one (``first_chunk_frames``) while ``first_chunk_pending``, else a later one
    (``frames_per_chunk``). While the first chunk is pending and the target has
    ``first_chunk_s``, the tighter of that and ``first_chunk_s / (passes_per_chunk
    * ranks)``: the first chunk's latency is its own passes, however many chunks
    are in flight. ValueError naming the argument for any non-positive input."""
    _positive("fps", target.fps)
    if target.first_chunk_s is not None:
        _positive("first_chunk_s", target.first_chunk_s)
    counts = {
        "frames_per_chunk": frames_per_chunk,
        "first_chunk_frames": first_chunk_frames,
        "passes_per_chunk": passes_per_chunk,
        "ranks": ranks,
        "chunks_in_flight": chunks_in_flight,
    }
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    frames = first_chunk_frames if first_chunk_pending else frames_per_chunk
    steps_per_chunk = passes_per_chunk * ranks
    budget = (frames / target.fps) * chunks_in_flight / steps_per_chunk
    if first_chunk_pending and target.first_chunk_s is not None:
        budget = min(budget, target.first_chunk_s / steps_per_chunk)
    return budget


@dataclass(frozen=True)
class SloDecision:
    """What one observation decided."""

    rows: int  # rows per micro-step from now on
    action: str  # "hold", "decrease" or "increase"
    ema_s: float  # smoothed micro-step time the decision was taken on
    budget_s: float | None  # the budget it was compared with (None: no session had a target)
    reason: str  # one sentence, e.g. "micro-step 0.31 s over budget 0.25 s 2 times in a row: rows 4 -> 2"


class SloController:
    """Rows per micro-step, additive increase / multiplicative decrease on the
    smoothed micro-step time against the tightest budget of the sessions served."""

    def __init__(
        self,
        max_rows: int,
        *,
        min_rows: int = 1,
        initial_rows: int | None = None,
        alpha: float = 0.3,
        miss_streak: int = 2,
        headroom: float = 0.25,
        headroom_streak: int = 4,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows!r}")
        if not 1 <= min_rows <= max_rows:
            raise ValueError(f"min_rows must be within [1, max_rows={max_rows}], got {min_rows!r}")
        if initial_rows is not None and not min_rows <= initial_rows <= max_rows:
            raise ValueError(f"initial_rows must be within [min_rows, max_rows], got {initial_rows!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if miss_streak < 1:
            raise ValueError(f"miss_streak must be >= 1, got {miss_streak!r}")
        if headroom_streak < 1:
            raise ValueError(f"headroom_streak must be >= 1, got {headroom_streak!r}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
        self.max_rows = max_rows
        self.min_rows = min_rows
        self.alpha = alpha
        self.miss_streak = miss_streak
        self.headroom = headroom
        self.headroom_streak = headroom_streak
        self.rows = max_rows if initial_rows is None else initial_rows
        self.ema_s: float | None = None  # None until the first observation at the current rows
        self.decisions: Counter[str] = Counter(dict.fromkeys(ACTIONS, 0))
        self._misses = 0
        self._fits = 0

    def observe(self, step_s: float, budget_s: float | None, rows_used: int) -> SloDecision:
        """One finished micro-step: its wall time, the tightest budget of the
        sessions it served (None: no session has a target -> hold, rows
        unchanged), and how many rows it actually carried. A step that carried
        at least ``rows`` counts as binding (one planned under a larger limit
        before a decrease does too)."""
        if not (math.isfinite(step_s) and step_s >= 0):
            raise ValueError(f"step_s must be a finite number >= 0, got {step_s!r}")
        if budget_s is not None:
            _positive("budget_s", budget_s)
        if rows_used < 0:
            raise ValueError(f"rows_used must be >= 0, got {rows_used!r}")
        ema = step_s if self.ema_s is None else self.alpha * step_s + (1 - self.alpha) * self.ema_s
        self.ema_s = ema
        rows = self.rows
        if budget_s is None:
            self._misses = self._fits = 0
            return self._decide("hold", rows, ema, None, f"micro-step {ema:.3g} s, no session has a target: hold")
        if ema > budget_s:
            self._misses += 1
            self._fits = 0
            over = f"micro-step {ema:.3g} s over budget {budget_s:.3g} s"
            if self._misses < self.miss_streak:
                reason = f"{over} {self._misses} of {self.miss_streak} times: hold"
                return self._decide("hold", rows, ema, budget_s, reason)
            if rows <= self.min_rows:
                return self._decide("hold", rows, ema, budget_s, f"{over}, rows already at min_rows {rows}: hold")
            new = max(self.min_rows, rows // 2)
            reason = f"{over} {self._misses} times in a row: rows {rows} -> {new}"
            return self._decide("decrease", new, ema, budget_s, reason)
        self._misses = 0
        limit = (1 - self.headroom) * budget_s
        if ema > limit:
            self._fits = 0
            reason = f"micro-step {ema:.3g} s within budget {budget_s:.3g} s, above headroom {limit:.3g} s: hold"
            return self._decide("hold", rows, ema, budget_s, reason)
        if rows_used < rows:
            self._fits = 0
            reason = f"micro-step {ema:.3g} s has headroom but carried {rows_used} of {rows} rows: hold"
            return self._decide("hold", rows, ema, budget_s, reason)
        self._fits += 1
        under = f"micro-step {ema:.3g} s under {limit:.3g} s (budget {budget_s:.3g} s)"
        if self._fits < self.headroom_streak:
            reason = f"{under} {self._fits} of {self.headroom_streak} times: hold"
            return self._decide("hold", rows, ema, budget_s, reason)
        if rows >= self.max_rows:
            return self._decide("hold", rows, ema, budget_s, f"{under}, rows already at max_rows {rows}: hold")
        reason = f"{under} {self._fits} times in a row: rows {rows} -> {rows + 1}"
        return self._decide("increase", rows + 1, ema, budget_s, reason)

    def _decide(self, action: str, rows: int, ema: float, budget_s: float | None, reason: str) -> SloDecision:
        if rows != self.rows:
            self.rows = rows
            self.ema_s = None
            self._misses = self._fits = 0
        self.decisions[action] += 1
        return SloDecision(rows=rows, action=action, ema_s=ema, budget_s=budget_s, reason=reason)
