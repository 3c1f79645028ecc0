"""``EngineClient``: the API process's handle on the engine.

Lives in the API process's event loop (asyncio, no torch). It starts worker
rank 0 from a fork server (``forkserver`` start method) that has imported
the worker's modules once (``EngineConfig.worker_modules``: torch, and
diffusers for a model), so a worker, and every fresh one after a death, skips
those seconds of imports; the API process itself never imports them. It
waits for the worker's READY, forwards control messages over the RPC queue
(``rtvideo.engine.transport``) and demultiplexes results into one async stream per
session (``SessionHandle``).

Liveness, both ways:
- the client watches the worker's process sentinel in the event loop, so a
  worker that dies (killed, crashed, OOM) is noticed at once: every open
  session receives ``SessionFailed(code="worker_died")`` and calls raise
  ``EngineDeadError`` instead of hanging. A fresh worker (a fresh device
  context) is then started on fresh sockets, at most ``max_worker_restarts``
  times per ``worker_restart_window_s``, a start that fails counting as one;
  past that the engine stays dead. A fork server that dies takes its worker
  with it (``rtvideo.engine.client.spawned_worker``: the worker is killed, its sessions
  fail) and the next start makes a new fork server;
- the worker holds the read end of a pipe whose write end only this process
  has; when this process dies, however it dies, the worker sees EOF and exits;
- a worker that is alive but wedged (stopped, deadlocked, or one forward far
  past what its chunks have cost) is found by a heartbeat: the client probes
  the worker's loop every ``Heartbeat.interval_s`` and, once a probe has gone
  unanswered or a forward has run past its deadline (``rtvideo.engine.client.heartbeat``),
  kills the worker; its sessions get ``SessionFailed(code="worker_wedged")``
  and a fresh worker starts under the same restart budget. Health checks
  read what the heartbeat last learned (``heartbeat``), never waiting on the
  worker themselves.

A worker group started by a launcher (``EngineConfig.worker_listen``:
``torchrun ... -m rtvideo.workers.launch --api HOST:PORT``) is no child process: the
client binds the pipes on TCP and waits for its rank 0 to connect and say
``WorkerHello``, answers with the configuration (``AttachWorker``), then
takes its READY as from a spawned worker. Its exit is learned from its last
word (``WorkerExiting``) or found by the heartbeat (a group that dies without
a word looks wedged), and killing it is asking it to exit (``Terminate``);
``rtvideo.engine.client.launched_worker``. A "restart" is waiting, under the same budget,
for the group the launcher starts next.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from rtvideo.engine.client.errors import (
    EngineDeadError,
    EngineError,
    EngineRestartingError,
    EngineStartupError,
    SessionRejectedError,
    UnknownSessionError,
)
from rtvideo.engine.client.heartbeat import Heartbeat
from rtvideo.engine.client.launched_worker import LaunchedWorker
from rtvideo.engine.client.restart_budget import RestartBudget
from rtvideo.engine.client.session_handle import TERMINAL, SessionHandle
from rtvideo.engine.client.spawned_worker import SpawnedWorker, fork_server_pid
from rtvideo.engine.config import EngineConfig, config_to_wire
from rtvideo.engine.messages import (
    AttachWorker,
    ChunkReady,
    ControlMessage,
    Delivered,
    EngineDead,
    EngineStats,
    Interaction,
    Playback,
    Probe,
    ProbeReply,
    ResultMessage,
    SessionFailed,
    SessionRejected,
    SessionStarted,
    Shutdown,
    StartSession,
    StopSession,
    SubmitInput,
    SubmitInteraction,
    WorkerExiting,
    WorkerHello,
    WorkerReady,
    WorkerStartupFailed,
)
from rtvideo.engine.transport import Endpoints, decode_result, encode_control

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Death:
    """How the sessions of a worker the client killed itself are failed."""

    code: str
    reason: str


class WorkerState(Enum):
    """Where the client's worker is (``EngineClient.state``)."""

    STARTING = "starting"  # spawned, READY not yet received (the first start)
    UP = "up"  # said READY and has not exited
    RESTARTING = "restarting"  # died; a fresh one is starting (calls raise EngineRestartingError)
    DEAD = "dead"  # died and the restart budget is spent (calls raise EngineDeadError)
    CLOSING = "closing"  # shutdown() was called


class EngineClient:
    """The API process's handle on worker rank 0: its lifecycle (``state``),
    the control messages sent to it, and its results routed by type (probe
    replies to their waiters, everything else to its session's stream).
    ``ready`` is the READY of the latest worker that came up; it describes the
    served model, which a restart does not change, so it is set for good once
    ``start`` returned."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready: WorkerReady | None = None
        self.state = WorkerState.STARTING
        self.stats: EngineStats | None = None  # the worker's latest scheduling figures (metrics)
        self._routes: dict[type, Any] = {
            ProbeReply: self._on_probe_reply,
            EngineDead: self._on_engine_dead,
            EngineStats: self._on_stats,
            ChunkReady: self._on_chunk,
            WorkerExiting: self._on_worker_exiting,
            WorkerHello: self._on_late_hello,
        }
        self._startup_s = 0.0  # how long the latest worker took from spawn to READY
        self.heartbeat = Heartbeat(config.wedged_after_s, config.startup_timeout_s, config.max_batch_rows)
        self._heartbeat_task: asyncio.Task | None = None
        self._killed: Death | None = None  # set when the heartbeat kills a wedged worker, until its death is handled
        self._sizes: dict[str, tuple[int, int]] = {}  # open sessions' width and height (heartbeat deadlines)
        self._sessions: dict[str, asyncio.Queue] = {}
        self._state_bytes: dict[str, int] = {}  # open sessions' device memory (geometry.state_bytes)
        self._probes: dict[int, asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()  # stops of abandoned starts, under way
        self._probe_ids = itertools.count(1)
        self._dead_reason: str | None = None
        self._process: SpawnedWorker | LaunchedWorker | None = None
        self._exited = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self._death_task: asyncio.Task | None = None
        self._context: zmq.asyncio.Context | None = None
        self._control: zmq.asyncio.Socket | None = None  # the pipes of the latest worker (_bind)
        self._results: zmq.asyncio.Socket | None = None
        self._directory: str | None = None  # the private directory of their ipc endpoints
        self._budget = RestartBudget(config.max_worker_restarts, config.worker_restart_window_s)
        self._no_restart: str | None = None  # why a worker lost now is not replaced (no_more_restarts)
        self.restarts = 0  # workers restarted after a death that said READY

    # ------------------------------------------------------------------
    # lifecycle
    # ------------------------------------------------------------------

    async def start(self) -> WorkerReady:
        """Spawn the worker (or, with ``worker_listen``, wait for a launched group to
        connect) and wait for READY; ``EngineStartupError`` otherwise."""
        self._context = zmq.asyncio.Context()
        try:
            if self.config.worker_listen is not None:
                self._bind()  # a launched group's pipes: kept across its restarts
            await self._spawn()
        except BaseException:
            self._close_sockets()
            raise
        self._pump_task = asyncio.create_task(self._pump(), name="engine-results")
        self._heartbeat_task = asyncio.create_task(self._beat(), name="engine-heartbeat")
        return self.ready

    def _bind(self) -> None:
        """Bind the pipes for the next worker: on fresh ``ipc://`` endpoints for a
        spawned worker (each one has its own, so nothing an earlier worker sent or
        was sent can reach it), on ``worker_listen`` for a launched group."""
        if self.config.worker_listen is not None:
            endpoints, self._directory = Endpoints.tcp(self.config.worker_listen), None
        else:
            endpoints, self._directory = Endpoints.fresh()
        self._endpoints = endpoints
        self._control = self._context.socket(zmq.PUSH)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.setsockopt(zmq.SNDHWM, 100_000)
        self._results = self._context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        try:
            self._control.bind(endpoints.control)
            self._results.bind(endpoints.results)
        except BaseException:
            self._unbind()
            raise

    def _unbind(self) -> None:
        """Close the latest worker's pipes: what it sent and was not read, and what
        it was sent and did not read, is dropped with them (LINGER 0), and a send
        still waiting for it ends (``_transmit``)."""
        for socket in (self._control, self._results):
            if socket is not None:
                socket.close()
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    async def _spawn(self) -> None:
        """Start a worker process on pipes of its own and wait for its READY; on
        ``EngineStartupError`` it is stopped and its pipes are closed."""
        if self.config.worker_listen is not None:
            await self._await_launched()
            return
        self._bind()
        self._process = SpawnedWorker(self.config, self._endpoints, self._on_worker_exit)
        self._exited = asyncio.Event()
        began = time.monotonic()
        try:
            try:  # in a thread: the first start waits for the fork server's imports (seconds)
                await asyncio.to_thread(self._process.start)
            except (OSError, EOFError) as error:
                raise EngineStartupError(f"the fork server could not start a worker: {error!r}") from error
            self._process.watch()
            try:
                self.ready = await self._handshake()
            except BaseException as error:
                if isinstance(error, asyncio.CancelledError):  # the start was given up: nothing to wait for
                    self._process.kill()
                await self._stop_process()
                raise
        except BaseException:
            self._process.close()
            self._unbind()
            raise
        self._startup_s = time.monotonic() - began
        if self.state in (WorkerState.STARTING, WorkerState.RESTARTING):
            self.state = WorkerState.UP

    async def _await_launched(self) -> None:
        """Wait for a launched worker group's rank 0 to connect and say READY."""
        self._process = LaunchedWorker(self._send_nowait, self._on_worker_exit)
        self._exited = asyncio.Event()
        began = time.monotonic()
        log.info("waiting for a launched worker group on %s", self.config.worker_listen)
        self.ready = await self._handshake()
        self._startup_s = time.monotonic() - began
        self.state = WorkerState.UP
        log.info("%s is ready", self._process.describe())

    async def _handshake(self) -> WorkerReady:
        """READY within ``startup_timeout_s``. A launched group says hello first and
        is answered with the configuration; what a group gone before it sent after
        that group's last word is passed over."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        launched = isinstance(self._process, LaunchedWorker)
        while True:
            message = await self._next_before(deadline)
            if isinstance(message, WorkerHello) and launched:
                self._process.hello = message
                await self._transmit(AttachWorker(config=config_to_wire(self.config)))
            elif isinstance(message, WorkerStartupFailed):
                raise EngineStartupError(f"worker could not start: {message.error}")
            elif isinstance(message, WorkerReady):
                return message
            elif isinstance(message, WorkerExiting) and launched and self._process.hello is not None:
                raise EngineStartupError(f"the launched worker exited with code {message.code}: {message.reason}")
            elif not launched:
                raise EngineStartupError(f"worker sent {type(message).__name__} before READY")

    async def _next_before(self, deadline: float) -> ResultMessage:
        receive = asyncio.ensure_future(self._results.recv())
        exited = asyncio.ensure_future(self._exited.wait())
        timeout = max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait({receive, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        exited.cancel()
        if receive not in done:
            receive.cancel()
            if self._exited.is_set():
                if isinstance(self._process, SpawnedWorker):
                    raise EngineStartupError(f"{self._process.describe_exit()} before it was ready")
                raise EngineStartupError(f"worker exited with code {self._process.exitcode} before it was ready")
            within = f"within {self.config.startup_timeout_s:g} s"
            if isinstance(self._process, LaunchedWorker) and self._process.hello is None:
                raise EngineStartupError(f"no launched worker group connected to {self.config.worker_listen} {within}")
            raise EngineStartupError(f"worker sent no READY {within}")
        try:
            return decode_result(receive.result())
        except msgspec.DecodeError as error:  # a worker of another version, or a describe gone wrong
            raise EngineStartupError(f"the worker sent a message the API process cannot read: {error}") from None

    async def shutdown(self) -> None:
        """End every session (``SessionDone(reason="shutdown")``) and stop the worker.
        Idempotent; kills the worker if it does not exit within ``shutdown_timeout_s``."""
        if self.state is WorkerState.CLOSING or self._process is None:
            return
        self.state = WorkerState.CLOSING
        if self._death_task is not None and not self._death_task.done():
            # A death being handled drains the dead worker's results and closes its pipes (and may be starting
            # a new worker): let it finish first, so that nothing here reads a socket it closes under us; a
            # worker it started is then shut down as any other.
            await asyncio.gather(asyncio.shield(self._death_task), return_exceptions=True)
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            # Not suppress(CancelledError), which would swallow a cancel of shutdown itself.
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        if self._dead_reason is None and self._process.is_alive():
            with contextlib.suppress(EngineError, zmq.ZMQError):
                await self._transmit(Shutdown())
        await self._stop_process()
        if self._pump_task is not None:
            self._pump_task.cancel()
            await asyncio.gather(self._pump_task, return_exceptions=True)
        await self._drain_results()
        self._fail_all("engine_shutdown", "the engine shut down")
        self._close_sockets()

    async def _stop_process(self) -> None:
        process = self._process
        if isinstance(process, LaunchedWorker) and not process.is_alive():
            return  # nothing connected, or it is gone: nothing of ours to wait for
        try:
            async with asyncio.timeout(self.config.shutdown_timeout_s):
                await self._exited.wait()
        except TimeoutError:  # workers ignore SIGTERM (they follow their parent): kill it
            log.warning("worker %s did not exit in time; killing it", process.pid)
            process.kill()
            async with asyncio.timeout(5.0):
                await self._exited.wait()
        process.join(timeout=1.0)

    def _close_sockets(self) -> None:
        if self._process is not None:
            self._process.close()
        self._unbind()
        self._context.term()

    def no_more_restarts(self, why: str) -> None:
        """A worker that dies from now on is not replaced (the server is draining:
        a fresh worker would load its model only to be shut down); ``why`` ends
        the reason the engine is then dead."""
        self._no_restart = why

    def _restart_allowed(self) -> bool:
        return self._no_restart is None and self._budget.allows()

    def _on_worker_exit(self) -> None:
        self._exited.set()
        if self.state is WorkerState.UP:  # a death during a handshake is the handshake's to report
            # Decided now, so no call in between sees the wrong state (or a reason-less one).
            self.state = WorkerState.RESTARTING if self._restart_allowed() else WorkerState.DEAD
            if self._killed is not None:
                self._dead_reason = self._killed.reason
            self._death_task = asyncio.create_task(self._on_worker_death())

    async def _on_worker_death(self) -> None:
        self._process.join(timeout=1.0)  # it has exited: reap it
        if self._pump_task is not None:
            self._pump_task.cancel()
            await asyncio.gather(self._pump_task, return_exceptions=True)
        await self._drain_results()  # what the worker sent before it died
        if isinstance(self._process, LaunchedWorker):
            code = self._process.exitcode
            default = f"{self._process.describe()} exited (code {code}: {self._process.exit_reason})"
        else:
            default = self._process.describe_exit()
        death = self._killed or Death(code="worker_died", reason=self._dead_reason or default)
        self._killed = None
        self._dead_reason = death.reason
        log.error("%s", death.reason)
        self._fail_all(death.code, death.reason)
        self.heartbeat.reset()
        if isinstance(self._process, SpawnedWorker):  # its pipes die with it (a launched group's are kept)
            self._process.close()
            self._unbind()
        if self.state is WorkerState.RESTARTING:
            await self._restart(death.reason)
        elif self.state is WorkerState.DEAD:
            why = self._no_restart or self._budget.spent_reason()
            self._dead_reason = f"{death.reason}; {why}"
            log.error("the engine is dead: %s", why)

    async def settled(self) -> None:
        """Return once a worker death in progress has been handled: its sessions
        failed and the restart, if allowed, finished (or failed). A worker that
        said its engine is dead (``EngineDead``) is dying: its exit is waited for."""
        if self.state is WorkerState.UP and self._dead_reason is not None:
            await self._exited.wait()
        if self._death_task is not None:
            await asyncio.shield(self._death_task)

    @property
    def restarts_left(self) -> int:
        """Restarts the budget still allows now: ``max_worker_restarts`` less those
        tried, failed or not, in the last ``worker_restart_window_s``."""
        return self._budget.left

    async def _restart(self, reason: str) -> None:
        """Fresh workers (a fresh device context each) on fresh pipes, until one
        says READY; the sessions of the dead one have already failed. Each start
        tried uses one unit of the restart budget, and one that fails ends the
        engine only when that budget is spent."""
        while self.state is WorkerState.RESTARTING:
            tried = self._budget.spend()
            log.warning("restarting the worker (%d in the last %g s)", tried, self._budget.window_s)
            try:
                await self._spawn()
            except EngineStartupError as error:
                log.error("restarting the worker failed: %s", error)
                if self._restart_allowed():
                    continue
                why = self._no_restart or self._budget.spent_reason()
                self._dead_reason = f"{reason}; restarting it failed: {error}; {why}"
                log.error("the engine is dead: %s", self._dead_reason)
                if self.state is WorkerState.RESTARTING:
                    self.state = WorkerState.DEAD
                return
            self.restarts += 1
            self._dead_reason = None
            self._pump_task = asyncio.create_task(self._pump(), name="engine-results")
            log.warning("worker restarted (pid %s)", self._process.pid)
            return

    # ------------------------------------------------------------------
    # heartbeat
    # ------------------------------------------------------------------

    async def _beat(self) -> None:
        """Probe the worker's loop every ``heartbeat.interval_s``; kill a worker the
        heartbeat finds wedged (its death is then handled like any other)."""
        while True:
            # Not while starting, restarting, dead, closing or being killed: nothing to watch.
            if self.state is WorkerState.UP and not self._exited.is_set() and self._killed is None:
                if (reason := self.heartbeat.verdict(self._sizes.values())) is not None:
                    self._kill_wedged(reason)
                else:
                    probe_id = next(self._probe_ids)
                    self.heartbeat.sent(probe_id)
                    with contextlib.suppress(EngineError, zmq.ZMQError):
                        await self._transmit(Probe(probe_id=probe_id))
            await asyncio.sleep(self.heartbeat.interval_s)  # the heartbeat's own period

    def _kill_wedged(self, reason: str) -> None:
        pid = self._process.pid
        self._killed = Death(code="worker_wedged", reason=f"worker process {pid} is wedged: {reason}; it was killed")
        log.error("worker process %s is wedged: %s; killing it", pid, reason)
        self._process.kill()  # SIGKILL reaches a stopped process too; the sentinel reports the exit
        # (a launched group is asked to exit, and counted gone at once: LaunchedWorker.kill)

    # ------------------------------------------------------------------
    # results
    # ------------------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            self._route(decode_result(await self._results.recv()))

    async def _drain_results(self) -> None:
        if self._results is None or self._results.closed:
            return
        while await self._results.poll(timeout=100):
            self._route(decode_result(await self._results.recv()))

    def _route(self, message: ResultMessage) -> None:
        """Dispatch one result by type: probe replies and engine deaths here,
        everything else to its session's stream."""
        self._routes.get(type(message), self._to_session)(message)

    def _on_probe_reply(self, reply: ProbeReply) -> None:
        self.heartbeat.answered(reply)
        future = self._probes.pop(reply.probe_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _on_chunk(self, chunk: ChunkReady) -> None:
        t = chunk.timing
        self.heartbeat.observe(chunk.width, chunk.height, (t.boundary_ms + t.denoise_ms + t.decode_ms) / 1000)
        self._to_session(chunk)

    def _on_stats(self, stats: EngineStats) -> None:
        self.stats = stats

    def _on_engine_dead(self, dead: EngineDead) -> None:
        """The worker's engine cannot go on: its sessions fail now, not once its
        teardown is over and the process exit is seen (which then restarts it)."""
        self._dead_reason = f"engine dead: {dead.reason}"
        self._fail_all("worker_died", self._dead_reason)

    def _on_worker_exiting(self, exiting: WorkerExiting) -> None:
        """A launched group's last word: its exit, as a sentinel tells a spawned one's."""
        if isinstance(self._process, LaunchedWorker):
            self._process.exited(exiting.code, exiting.reason)

    def _on_late_hello(self, hello: WorkerHello) -> None:
        """A second group connected while one is up: it gets no configuration, so
        it serves nothing; said once in the log."""
        log.warning("a launched worker (pid %s on %s) connected while one is serving; ignored", hello.pid, hello.host)

    def _send_nowait(self, message: ControlMessage) -> None:
        """Send without waiting for a peer (best effort: ``Terminate`` to a group that may be gone)."""
        try:
            sent = self._control.send(encode_control(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())

    def _stop_unread(self, session_id: str) -> None:
        """Stop, from a task of its own, a session whose start was abandoned (the
        caller that asked for it was cancelled): its stop must not wait on that caller."""
        task = asyncio.create_task(self._stop_quietly(session_id), name=f"stop-unread-{session_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stop_quietly(self, session_id: str) -> None:
        with contextlib.suppress(EngineError, zmq.ZMQError):
            await self._send(StopSession(session_id=session_id, reason="cancelled"))

    def _to_session(self, message: ResultMessage) -> None:
        """A session's result onto its stream. Its terminal result also closes it
        here, as it arrives: the client's open sessions are the worker's, whether
        or not anyone reads the stream to its end (a caller that stops reading
        leaves nothing behind)."""
        session_id = getattr(message, "session_id", None)
        queue = self._sessions.get(session_id)
        if queue is not None:
            queue.put_nowait(message)
            if isinstance(message, TERMINAL):
                self._forget(session_id)

    def _fail_all(self, code: str, reason: str) -> None:
        """Every open session's stream ends with ``SessionFailed``, once: a failed
        session is forgotten here (a later death or result finds nothing of it)."""
        for session_id, queue in list(self._sessions.items()):
            queue.put_nowait(SessionFailed(session_id=session_id, code=code, message=reason))
            self._forget(session_id)
        for future in self._probes.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._probes.clear()

    def _forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._state_bytes.pop(session_id, None)
        self._sizes.pop(session_id, None)

    # ------------------------------------------------------------------
    # control
    # ------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """A worker is up and takes work."""
        return self.state is WorkerState.UP and self._dead_reason is None and not self._exited.is_set()

    @property
    def restarting(self) -> bool:
        """A worker died and a fresh one is starting."""
        return self.state is WorkerState.RESTARTING

    @property
    def dead_reason(self) -> str | None:
        """Why no worker takes work (also while restarting: why the last one died); None while up."""
        return self._dead_reason

    @property
    def retry_after_s(self) -> float:
        """A fair wait before retrying while a restart is under way: the latest startup's duration."""
        return max(1.0, self._startup_s)

    def loop_silent_s(self) -> float:
        """How long the worker's loop has left a probe unanswered (0 when none is waiting).

        The loop answers probes while a forward runs too, so this stays near 0
        unless the worker is stopped, deadlocked or starved."""
        return self.heartbeat.silent_s()

    def responsiveness(self) -> tuple[str, str]:
        """``("ok" | "busy" | "wedged", reason)`` from what the heartbeat last
        learned (no round trip to the worker): for liveness while a worker is up."""
        return self.heartbeat.status(self._sizes.values())

    def unavailable(self) -> EngineDeadError | None:
        """Why a call would be refused now (``EngineRestartingError`` while a fresh
        worker is on its way), or None when a worker is up."""
        restarting = self.state is WorkerState.RESTARTING
        # A worker that said its engine is dead (EngineDead) is exiting: a restart follows its exit
        # where the budget allows one, so callers wait it out as they would the restart itself.
        dying = self.state is WorkerState.UP and self._dead_reason is not None and self._restart_allowed()
        if restarting or dying:
            return EngineRestartingError(
                f"the worker is restarting ({self._dead_reason or 'it died'}); retry in {self.retry_after_s:.0f} s",
                self.retry_after_s,
            )
        if self._dead_reason is not None:
            return EngineDeadError(self._dead_reason)
        if self.state is not WorkerState.UP or self._exited.is_set():
            return EngineDeadError("the engine is not running")
        return None

    @property
    def worker_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def fork_server_pid(self) -> int | None:
        """The pid of the fork server the spawned workers come from (None with a
        launched group, and before the first worker)."""
        return None if self.config.worker_listen is not None else fork_server_pid()

    def open_sessions(self) -> tuple[str, ...]:
        return tuple(self._sessions)

    def held_state_bytes(self) -> int:
        """Device memory the open sessions' state holds, as the worker accounts it."""
        return sum(self._state_bytes.values())

    async def _send(self, message: ControlMessage) -> None:
        if (error := self.unavailable()) is not None:
            raise error
        await self._transmit(message)

    async def _transmit(self, message: ControlMessage) -> None:
        """Send to the latest worker. A send that waits for its end of the pipe and
        sees that worker die raises ``EngineDeadError`` (``EngineRestartingError``
        while a fresh one starts): the pipe is closed, and the message never reaches
        the next worker."""
        control = self._control
        try:  # blocks only until the worker's end of the pipe is connected
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await control.send(encode_control(message))
        except TimeoutError:
            raise EngineDeadError(f"the worker accepted no control message within {SEND_TIMEOUT_S:g} s") from None
        except asyncio.CancelledError:
            if not control.closed or asyncio.current_task().cancelling():
                raise  # a cancel of this task, not the end of the pipe
            raise self.unavailable() or EngineDeadError("the worker exited before it took the message") from None

    async def start_session(self, start: StartSession) -> SessionHandle:
        """Open a session; ``SessionRejectedError`` if the worker refuses it."""
        if start.session_id in self._sessions:
            raise SessionRejectedError("duplicate_session", f"session {start.session_id!r} is already open")
        queue: asyncio.Queue = asyncio.Queue()
        self._sessions[start.session_id] = queue
        try:
            await self._send(start)
            first = await queue.get()
        except BaseException:
            # Cancelled, or the pipe failed, after the start may have reached the
            # worker: it is told to end the session (idempotent, a no-op for one it
            # never opened), or it would run a session whose results nobody takes.
            if self._sessions.get(start.session_id) is queue:
                self._forget(start.session_id)
                if self.alive:
                    self._stop_unread(start.session_id)
            raise
        if isinstance(first, SessionStarted):
            if self._sessions.get(start.session_id) is queue:  # not ended already (its end arrived with it)
                self._state_bytes[start.session_id] = first.geometry.state_bytes
                self._sizes[start.session_id] = (first.geometry.width, first.geometry.height)
            return SessionHandle(self, first, queue)
        if self._sessions.get(start.session_id) is queue:
            self._forget(start.session_id)
        if isinstance(first, SessionRejected):
            raise SessionRejectedError(first.code, first.message)
        raise EngineDeadError(getattr(first, "message", "the session failed to start"))

    async def interact(self, session_id: str, event_id: str, interaction: Interaction) -> None:
        """Send an interaction; its acknowledgement arrives on the session's stream."""
        if session_id not in self._sessions:
            raise UnknownSessionError(f"no open session {session_id!r}")
        await self._send(SubmitInteraction(session_id=session_id, event_id=event_id, interaction=interaction))

    async def send_input(self, session_id: str, chunk_index: int, frames: Any) -> None:
        """Send one chunk's input frames to the worker (``SubmitInput``): ``frames``
        a numpy array, uint8 ``[F, H, W, 3]`` (RGB, row-major). ``ValueError`` here
        for an array that is not uint8 ``[F, H, W, 3]``; what the worker refuses
        (a count or size not the session's, a chunk out of order, a session opened
        without an input) fails the session, ``SessionFailed(invalid_input)`` on its
        stream naming the fault. A chunk whose frames do not come within
        ``input_timeout_s`` of being due fails it with ``input_timeout``."""
        if session_id not in self._sessions:
            raise UnknownSessionError(f"no open session {session_id!r}")
        shape = tuple(getattr(frames, "shape", ()))
        dtype = str(getattr(frames, "dtype", type(frames).__name__))
        if dtype != "uint8" or len(shape) != 4 or shape[3] != 3:
            raise ValueError(f"input frames must be uint8 [frames, height, width, 3], got {dtype} {list(shape)}")
        count, height, width, _ = shape
        data = frames.tobytes()  # C order whatever the array's strides: row-major RGB
        await self._send(
            SubmitInput(
                session_id=session_id, chunk_index=chunk_index, count=count, height=height, width=width, frames=data
            )
        )

    async def delivered(self, session_id: str, media_seconds: float) -> None:
        """Tell the worker the session's media up to ``media_seconds`` was written
        to its client's socket (transport backpressure for pacing). A no-op for a
        session already gone: its end may have arrived before its last chunks were read."""
        if session_id in self._sessions:
            await self._send(Delivered(session_id=session_id, media_seconds=media_seconds))

    async def playback(self, session_id: str, position_seconds: float) -> None:
        """The client's playhead (pacing); a no-op for a session already gone, as ``delivered``."""
        if session_id in self._sessions:
            await self._send(Playback(session_id=session_id, position_seconds=position_seconds))

    async def stop(self, session_id: str, reason: str = "stopped") -> None:
        """End a session; idempotent, and a no-op for a session already gone."""
        if session_id in self._sessions and self.alive:
            await self._send(StopSession(session_id=session_id, reason=reason))

    async def probe(self, timeout: float = 10.0) -> ProbeReply:
        probe_id = next(self._probe_ids)
        future = asyncio.get_running_loop().create_future()
        self._probes[probe_id] = future
        try:
            await self._send(Probe(probe_id=probe_id))
            self.heartbeat.sent(probe_id)
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._probes.pop(probe_id, None)
