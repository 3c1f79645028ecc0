"""When a decode lane's waiting chunks go: together, once a round of them has come.

Worker rank 0. A batched decode costs much less per chunk than decodes one by
one (tiny preset on a CPU, one thread: a split decode took 27.3 ms per chunk
alone and 19.0 ms in batches of four). But sessions' chunks commit at
different micro-steps (on a pipeline ring of two ranks, below, several
micro-steps apart). A lane that takes whatever waits the moment it is free
mostly decodes them one or two at a time, the Python overhead of each decode
paid again and again.

``RoundGather`` holds a lane's waiting chunks until one of:

- a full batch waits (``most`` chunks);
- a chunk of every session on the lane waits (no other is coming this round);
- the oldest waiting chunk has waited one micro-step less than its session
  took to make it (the micro-steps from its chunk before to it): holding it
  longer would hold it past its session's next chunk, so a round is never
  held longer than one of its chunks took to make, and a session that
  paused, is stopping or ran out of chunks holds the others that long at
  most (before a session has made two chunks: as many micro-steps as there
  are other sessions on the lane);
- the executor has no micro-step left to run (nothing more can come until the
  loop plans again).

On a ring of two ranks with one row per micro-step, four sessions' chunks of
a round come 3, 7 and 3 micro-steps apart (sessions run their chunks two at a
time), each session's 20 micro-steps apart: the round goes as one batch of
four. In paced real-time serving the executor idles between chunks, and
rounds go as they stand. The gather counts micro-steps, not time, so what it
does follows the plan, not the machine's speed. The executor calls
``step_done`` after each micro-step (its chunks submitted already); the
lane's thread asks ``ready`` with what waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


class RoundGather:
    def __init__(self, most: int) -> None:
        """``most``: the most chunks one batch takes."""
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self._most = most
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}  # sessions on the lane (seen, not yet forgotten) -> step of their last chunk
        self._period: dict[str, int] = {}  # -> micro-steps between their last two chunks
        self._steps = 0  # micro-steps done
        self._idle = False  # no micro-step was left to run after the last one
        self._recheck: Callable[[], None] = lambda: None

    def watch(self, recheck: Callable[[], None]) -> None:
        """``recheck``: tells the lane to ask ``ready`` again (``OrderedThread.recheck``)."""
        self._recheck = recheck

    def arrived(self, session_id: str) -> int:
        """A chunk of ``session_id`` is about to be queued; returns the step count
        to queue with it (``ready`` reads it as the item's last element)."""
        with self._lock:
            if session_id in self._last:
                self._period[session_id] = self._steps - self._last[session_id]
            self._last[session_id] = self._steps
            self._idle = False
            return self._steps

    def forget(self, session_id: str) -> None:
        """The session was released: none of its chunks is coming."""
        with self._lock:
            self._last.pop(session_id, None)
            self._period.pop(session_id, None)
        self._recheck()

    def step_done(self, idle: bool) -> None:
        """A micro-step ended; ``idle``: none is queued after it."""
        with self._lock:
            self._steps += 1
            self._idle = idle
        self._recheck()

    def ready(self, waiting: Sequence[tuple]) -> bool:
        """Whether ``waiting`` (items of session id first and the ``arrived``
        count last, oldest first; at least one) may go now."""
        with self._lock:
            if self._idle or len(waiting) >= self._most:
                return True
            others = len(self._last) - 1
            if len({item[0] for item in waiting}) > others:
                return True
            oldest, came = waiting[0][0], waiting[0][-1]
            period = self._period.get(oldest)
            return self._steps - came >= (others if period is None else period - 1)
