"""The worker heartbeat: when a worker counts as wedged, and why.

API process, pure Python (the clock is injectable). ``EngineClient`` probes
the worker's loop every ``interval_s`` and tells a ``Heartbeat`` what it sent
(``sent``), what came back (``answered``) and what each chunk cost
(``observe``); ``verdict`` then says whether the worker is wedged. The client
kills a wedged worker: its sessions fail with ``worker_wedged`` and a fresh
worker starts under the restart budget (``rtvideo.engine.client.engine_client``).

Two ways to be wedged, one knob (``floor_s``: ``EngineConfig.wedged_after_s``,
``rtvideo serve --worker-wedged-after-s``):

- **the loop is silent**: a probe has gone unanswered for ``floor_s``. The
  loop answers probes between its own short steps, also while a forward
  runs on the executor thread, so its silence says the process is stopped
  (SIGSTOP), deadlocked or starved, whatever a forward costs;
- **one forward has run too long**: the loop, answering, says a
  micro-step has been running (``ProbeReply.executing_s``, aged since) for
  longer than its deadline, ``max(floor_s, FACTOR × rows × slowest)``, where
  ``slowest`` is the costliest chunk measured so far (``ChunkReady.timing``:
  boundary + denoise + decode, so at least any one micro-step of it) among
  sessions as large as the largest open one or larger (sizes bucketed by
  pixel count, powers of two), and ``rows`` the rows a forward may carry
  (a chunk's timing is its share of a batched forward). While an open
  session's size has no measurement yet (a first forward may compile or
  allocate for minutes) the deadline is ``max(floor_s, unmeasured_s)``, the
  time a worker may take to start (``worker_startup_timeout_s``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from rtvideo.engine.messages import ProbeReply

FACTOR = 10.0  # a forward may run this many times the slowest chunk measured at its size
BUSY_S = 1.0  # a forward (or a silence) this long is reported "busy" on liveness


def size_bucket(width: int, height: int) -> int:
    """Sizes within a factor of two of pixels share a bucket (a bounded table)."""
    return max(1, width * height).bit_length()


class Heartbeat:
    """What the client knows of its worker's responsiveness; see the module."""

    def __init__(
        self,
        floor_s: float,
        unmeasured_s: float,
        rows: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.floor_s = floor_s
        self.unmeasured_s = unmeasured_s
        self.rows = rows
        self.clock = clock
        self.interval_s = min(1.0, floor_s / 5)  # a silence is seen within a fifth of the floor
        self._slowest: dict[int, float] = {}  # size bucket -> costliest chunk measured (kept across restarts)
        self._unanswered: dict[int, float] = {}  # probe id -> when it was sent
        self.last_reply: ProbeReply | None = None
        self._replied_at = 0.0

    # -- what the client tells it -------------------------------------------------

    def sent(self, probe_id: int) -> None:
        self._unanswered[probe_id] = self.clock()

    def answered(self, reply: ProbeReply) -> None:
        # The loop answers probes in order: every earlier one was answered or lost with a dead worker.
        for probe_id in [p for p in self._unanswered if p <= reply.probe_id]:
            del self._unanswered[probe_id]
        self.last_reply = reply
        self._replied_at = self.clock()

    def observe(self, width: int, height: int, compute_s: float) -> None:
        bucket = size_bucket(width, height)
        self._slowest[bucket] = max(self._slowest.get(bucket, 0.0), compute_s)

    def reset(self) -> None:
        """A worker died: nothing it was asked is outstanding any more. Chunk costs
        are kept: a fresh worker serves the same model."""
        self._unanswered.clear()
        self.last_reply = None

    # -- what it says ---------------------------------------------------------------

    def silent_s(self) -> float:
        """How long the oldest unanswered probe has waited (0: none waits)."""
        if not self._unanswered:
            return 0.0
        return self.clock() - min(self._unanswered.values())

    def executing_s(self) -> float:
        """How long the micro-step the loop last reported running has run by now (0: none)."""
        reply = self.last_reply
        if reply is None or reply.executing_s <= 0:
            return 0.0
        return reply.executing_s + (self.clock() - self._replied_at)

    def deadline(self, sizes: Iterable[tuple[int, int]]) -> tuple[float, str]:
        """How long one forward may run with sessions of ``sizes`` open, and why."""
        largest = max((size_bucket(w, h) for w, h in sizes), default=None)
        if largest is None:
            measured = list(self._slowest.values())
        else:
            measured = [s for bucket, s in self._slowest.items() if bucket >= largest]
        if largest is not None and not measured:
            return max(self.floor_s, self.unmeasured_s), "no chunk of this size measured yet"
        slowest = max(measured, default=0.0)
        derived = FACTOR * self.rows * slowest
        if derived <= self.floor_s:
            return self.floor_s, "the floor"
        rows = f" x {self.rows} rows" if self.rows > 1 else ""
        return derived, f"{FACTOR:g} x the slowest chunk measured, {slowest:.2f} s{rows}"

    def verdict(self, sizes: Iterable[tuple[int, int]]) -> str | None:
        """Why the worker is wedged now, or None while it is not."""
        silent = self.silent_s()
        if silent >= self.floor_s:
            return f"the worker's loop has answered no probe for {silent:.1f} s (deadline {self.floor_s:g} s)"
        if self.clock() - self._replied_at > 2 * self.interval_s:
            return None  # the loop's last answer is going stale: its silence decides, at the floor
        running = self.executing_s()
        limit, why = self.deadline(sizes)
        if running >= limit:
            return f"one forward has run for {running:.1f} s, past its deadline of {limit:.1f} s ({why})"
        return None

    def status(self, sizes: Iterable[tuple[int, int]]) -> tuple[str, str]:
        """``("wedged" | "busy" | "ok", reason)`` for liveness."""
        sizes = list(sizes)
        if (wedged := self.verdict(sizes)) is not None:
            return "wedged", wedged
        silent, running = self.silent_s(), self.executing_s()
        if running >= BUSY_S:
            return "busy", f"one forward has run for {running:.1f} s (deadline {self.deadline(sizes)[0]:.1f} s)"
        if silent >= BUSY_S:
            return "busy", f"the worker's loop has answered no probe for {silent:.1f} s"
        return "ok", ""
