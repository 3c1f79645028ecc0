"""A thread that handles submitted items one at a time, in submission order.

Worker process. The executor runs micro-steps on one (``rtvideo.workers.executor``)
and the decode stage its decodes on another (``rtvideo.workers.decode_stage``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from rtvideo.workers.os_threads import lower_this_thread, name_this_thread

Item = TypeVar("Item")


class OrderedThread(Generic[Item]):
    def __init__(
        self,
        name: str,
        handle: Callable[[Item], bool],
        handle_all: Callable[[list[Item]], bool] | None = None,
        ready: Callable[[Sequence[Item]], bool] | None = None,
        nice: int = 0,
    ) -> None:
        """``handle`` runs on the thread for each item; returning False stops the
        thread (what was submitted after it is not handled). With
        ``handle_all``, that runs instead, with every item waiting when the
        thread turns to the queue, in submission order (one at least); with
        ``ready`` too, only once ``ready`` says the waiting items may go (it is
        asked with them, in order, whenever one is submitted and at
        ``recheck``; closing takes them regardless). ``nice``: steps of
        ``nice`` the thread runs below the process's priority (0: the same).
        The thread gives the kernel its name (``rtvideo.workers.os_threads``)."""
        if ready is not None and handle_all is None:
            raise ValueError("ready needs handle_all")
        self._handle = handle
        self._handle_all = handle_all
        self._ready = ready
        self._lock = threading.Condition()
        self._queue: deque[Item] = deque()
        self._closing = False
        self._nice = nice
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError(f"{self._thread.name} is closed")
            self._queue.append(item)
            self._lock.notify_all()

    def recheck(self) -> None:
        """Ask ``ready`` again: what it reads has changed."""
        with self._lock:
            self._lock.notify_all()

    @property
    def pending(self) -> int:
        """Items submitted and not yet taken."""
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """Handle what was submitted, then stop the thread."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()

    def _run(self) -> None:
        name_this_thread()
        lower_this_thread(self._nice)
        while True:
            with self._lock:
                self._lock.wait_for(self._may_take)
                if not self._queue:
                    return
                take = 1 if self._handle_all is None else len(self._queue)
                items = [self._queue.popleft() for _ in range(take)]
            if not (self._handle(items[0]) if self._handle_all is None else self._handle_all(items)):
                return

    def _may_take(self) -> bool:
        if self._closing:
            return True
        return bool(self._queue) and (self._ready is None or self._ready(self._queue))
