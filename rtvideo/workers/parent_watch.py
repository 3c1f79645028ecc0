"""``ParentWatch``: a worker that is still building its pipeline ends when the
API process that spawned it is gone.

Once the worker serves, its control receiver watches the liveness pipe (the
read end of a pipe whose write end only the API process holds: EOF means it
is gone, however it died). Building, warming up and calibrating come first and
can take minutes for a real model; without a watch then, an API process killed
meanwhile left the worker loading a model for nobody until it was done. This
thread watches the same pipe for that time, and exits the process at EOF (its
pipeline ranks follow it: they watch rank 0 the same way). It is started
after the ranks this worker forks itself, which must be forked while it runs
one thread, and stopped before the receiver takes the pipe over."""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

POLL_S = 0.2
EXIT_CODE = 3


class ParentWatch:
    def __init__(self, parent_alive: Connection) -> None:
        self._pipe = parent_alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="parent-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._pipe.poll(POLL_S):  # nothing is ever written: readable means EOF
                if self._stop.is_set():
                    return
                log.warning("the API process is gone; the worker exits before it was ready")
                logging.shutdown()
                os._exit(EXIT_CODE)

    def stop(self) -> None:
        """The receiver watches the pipe from now on."""
        self._stop.set()
        self._thread.join()
