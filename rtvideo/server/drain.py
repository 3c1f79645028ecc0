"""Graceful drain: SIGTERM lets running sessions finish, then the server exits 0.

API process. On the first SIGTERM (or SIGINT) the server keeps listening but
refuses new work — a new realtime session gets ``error{code:
"shutting_down"}`` and close 1013, a new job HTTP 503, ``/health`` turns 503
so load balancers stop routing here — and waits up to ``shutdown_grace_s``
for the open sessions and jobs to end by themselves. At the deadline the
rest are stopped with reason ``shutdown`` (clients get ``session.done``
saying so), then uvicorn stops and the lifespan shuts the workers down. A
session counts as ended once its realtime clients were sent its end, so the
exit never cuts off a final ``session.done``. A second signal skips the wait
(a second Ctrl+C also uvicorn's wait for connections to close); either way the
lifespan still shuts the workers down, quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineDeadError, UnknownSessionError

log = logging.getLogger(__name__)


class Drainer:
    def __init__(self, engine: EngineClient, capacity: asyncio.Condition, grace_s: float) -> None:
        self.engine = engine
        self.capacity = capacity  # notified whenever a session ends
        self.grace_s = grace_s
        self.draining = False
        self.delivering = 0
        """Realtime connections that attached to a session and have not yet
        written their last event and close: a session is over for the drain
        only once its clients have heard so, not when the engine says it ended
        (the exit would close the sockets with the final ``session.done``
        still queued). Each connection counts itself (``rtvideo.server.realtime``) and
        notifies ``capacity`` when it is done."""

    async def drain(self) -> None:
        self.draining = True
        self.engine.no_more_restarts("the server is shutting down")  # a worker lost now is not replaced
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.grace_s
        log.info("draining: %d sessions open, %g s grace", len(self.engine.open_sessions()), self.grace_s)
        await self._wait_for_sessions(deadline)
        left = self.engine.open_sessions()
        if left:
            log.info("grace period over: ending %d sessions", len(left))
            for session_id in left:
                with contextlib.suppress(EngineDeadError, UnknownSessionError):
                    await self.engine.stop(session_id, "shutdown")
            await self._wait_for_sessions(loop.time() + 10.0)
        log.info(
            "drained in %.1f s: %d sessions open, %d connections delivering; stopping",
            loop.time() - began,
            len(self.engine.open_sessions()),
            self.delivering,
        )

    async def _wait_for_sessions(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        async with self.capacity:
            while (self.engine.open_sessions() or self.delivering) and loop.time() < deadline:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        await self.capacity.wait()


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains (``drain``) before it stops listening."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler: hand over to the loop, never re-raise the signal
        # afterwards (uvicorn would, and the process would not exit 0).
        if not self.started and self._loop is not None:  # still starting: nothing to drain, the start is given up
            self.should_exit = True
            self._loop.call_soon_threadsafe(self._abort_start, sig)
            return
        if self._draining or self._loop is None:
            if self._draining and not self.should_exit:
                self._loop.call_soon_threadsafe(log.info, "a second signal: stopping now, without waiting")
            self.should_exit = True
            self.force_exit = self.force_exit or (self._draining and sig == signal.SIGINT)
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _abort_start(self, sig: int) -> None:
        """The lifespan's start, if it can be given up (``OneLineLifespan.abort``),
        is: a model that loads for minutes does not hold an exit signal that long."""
        abort = getattr(getattr(self, "lifespan", None), "abort", None)
        if abort is not None:
            abort(f"stopped by {signal.Signals(sig).name} before the server was ready")

    def _start_drain(self) -> None:
        # The loop keeps only a weak reference to a task: hold this one until it is done.
        self._drain_task = self._loop.create_task(self._drain_then_exit(), name="drain")

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown; after a forced exit (Ctrl+C while draining) the drain
        is cancelled and the lifespan shut down all the same, so the workers stop
        and the app's lifespan is not left to be cancelled (a ``CancelledError``
        traceback) when the loop closes."""
        await super().shutdown(sockets)
        if self.force_exit:
            if self._drain_task is not None:
                self._drain_task.cancel()
            await self.lifespan.shutdown()

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:
            log.exception("drain failed; stopping now")
        finally:
            self.should_exit = True
