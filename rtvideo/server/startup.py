"""A start that cannot succeed says why in one line.

API process, under ``rtvideo serve``. ``create_app``'s lifespan turns a start
that fails for a reason it can name (the worker could not start: a model
directory that does not load, a pipeline option refused; the job store could
not be had: a ``data_dir`` another server holds) into ``StartupFailed``, and
records its message as ``app.state.start_failure``. ``OneLineLifespan`` is
uvicorn's lifespan protocol, but such a failure ends the start with that one
line on stderr (``api ERROR rtvideo serve: <why>``), not starlette's
traceback and uvicorn's "Application startup failed"; the process then exits
non-zero as uvicorn makes it (3). The worker's own traceback is logged at
``--log-level debug`` only. Any other failure (a bug) is reported as uvicorn
reports it, with its traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn import Config
from uvicorn.lifespan.on import LifespanOn


class StartupFailed(Exception):
    """The server cannot start, for the reason its message says in one line."""


class OneLineLifespan(LifespanOn):
    """uvicorn's ``LifespanOn`` whose start, failed with ``StartupFailed``, logs
    ``failure()`` (what the application recorded; None: no such failure) as its
    one line. Built by uvicorn as ``config.lifespan_class(config)``: bind
    ``failure`` with ``functools.partial``."""

    def __init__(self, config: Config, failure: Callable[[], str | None]) -> None:
        super().__init__(config)
        self._failure = failure
        self._main: asyncio.Task | None = None
        self._aborted: str | None = None  # why the start was given up (``abort``)

    def abort(self, reason: str) -> None:
        """Give up a start still under way (an exit signal while the model loads):
        the application's start is cancelled, which stops its worker, and the
        start fails with ``reason`` as its one line. A no-op once it is over."""
        if self._main is not None and not self._main.done() and not self.startup_event.is_set():
            self._aborted = reason
            self._main.cancel()

    def _why(self) -> str | None:
        return self._aborted or self._failure()

    async def send(self, message: Any) -> None:
        if message["type"] == "lifespan.startup.failed" and self._why() is not None:
            message = {**message, "message": ""}  # starlette's traceback; the one line says it (startup)
        await super().send(message)

    async def startup(self) -> None:
        """uvicorn's ``LifespanOn.startup``, but a failure the application named is logged as that line alone."""
        self.logger.info("Waiting for application startup.")
        self._main = asyncio.get_running_loop().create_task(self.main())  # held: the loop keeps a weak reference
        await self.receive_queue.put({"type": "lifespan.startup"})
        await self.startup_event.wait()
        if self.startup_failed or (self.error_occurred and self.config.lifespan == "on"):
            failure = self._why()
            self.logger.error(f"rtvideo serve: {failure}" if failure else "Application startup failed. Exiting.")
            self.should_exit = True
        else:
            self.logger.info("Application startup complete.")
