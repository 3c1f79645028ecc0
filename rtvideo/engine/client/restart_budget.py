"""``RestartBudget``: how many fresh workers the client may start after deaths.

At most ``max_restarts`` starts are tried within any ``window_s`` seconds, a
start that fails counting as one; ``max_restarts`` 0 turns restarts off. The
clock is ``time.monotonic``, read at each call (a test may pass its own)."""

from __future__ import annotations

import time
from collections.abc import Callable


class RestartBudget:
    """The restarts tried, and whether one more is allowed now."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._tried: list[float] = []  # when each start within the window was tried, failed ones too

    def _recent(self) -> list[float]:
        now = self._clock()
        self._tried = [t for t in self._tried if now - t < self.window_s]
        return self._tried

    def allows(self) -> bool:
        """One more start may be tried now."""
        return len(self._recent()) < self.max_restarts

    def spend(self) -> int:
        """Count a start being tried; returns the starts tried within the window, this one included."""
        self._recent().append(self._clock())
        return len(self._tried)

    @property
    def left(self) -> int:
        """Starts the budget still allows now."""
        return max(0, self.max_restarts - len(self._recent()))

    def spent_reason(self) -> str:
        """Why no restart is tried, for the reason the engine is dead."""
        if self.max_restarts == 0:
            return "restarts are off (max_worker_restarts is 0)"
        return (
            f"the restart budget is spent ({self.max_restarts} restarts tried in "
            f"the last {self.window_s:g} s, max_worker_restarts)"
        )
