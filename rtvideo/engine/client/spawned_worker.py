"""Worker rank 0 as a child of the fork server, as the API process sees it.

``EngineClient`` starts its worker from a fork server (``forkserver`` start
method) that has imported the worker's modules once. The worker is the fork
server's child, not the API process's: the fork server reaps it and reports
its exit status through the process's sentinel. So the sentinel also fires
when the fork server itself dies (killed, OOM) while the worker runs on,
orphaned; ``multiprocessing`` then calls the worker exited with code 255.

``SpawnedWorker`` stands in for the ``Process`` handle (``pid``,
``is_alive``, ``kill``, ``join``, ``exitcode``, as ``LaunchedWorker`` does
for a launched group) and tells the two apart with a pidfd of the worker,
which says whether the process itself has exited, whoever its parent is. A
worker whose fork server died is killed (through the pidfd: the pid cannot
have been reused) and counted exited once it and the fork server are both
gone, so the next start finds the fork server dead and ``multiprocessing``
starts a fresh one. ``on_exit`` is called once, when the worker has exited,
whichever way that was learned. Pure Python: no torch, no sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
from collections.abc import Callable
from typing import Any

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.transport import Endpoints

FORK_SERVER_SETUP = "rtvideo.workers.fork_server"
"""The fork server's first import: it ignores SIGTERM, following its parent (the
API process) as the workers do. Named, never imported here: the API process
imports nothing of the workers."""


def worker_context(config: EngineConfig) -> Any:
    """The start method of worker rank 0: ``forkserver``, preloading what a worker
    of ``config`` imports. The fork server is one per API process, started with
    the first worker (and again by the first start after it died); it imports
    those modules and nothing else (no device is touched, no thread started),
    and each worker is a fork of it, so it starts with them imported and shares
    nothing with this process but what ``Process`` passes (the config, the
    endpoints, the liveness pipe). Its environment is this process's when it
    started: what a worker needs is in its config, not in environment variables."""
    context = multiprocessing.get_context("forkserver")
    preload = [FORK_SERVER_SETUP, *config.worker_modules]
    context.set_forkserver_preload(preload)  # no effect once the server runs
    return context


def fork_server_pid() -> int | None:
    """The pid of this process's fork server (``multiprocessing``'s own record);
    None before the first worker started it."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def _bootstrap(entry: str, *args: Any) -> None:
    """Child-side trampoline: import the worker entry point by name and run it."""
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exited); None where the platform has
    none or the process is already gone."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_exited(pidfd: int) -> bool:
    poller = select.poll()  # not select.select: a server's descriptors may number past 1024
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class SpawnedWorker:
    """One spawned worker rank 0, started once; a restart is a new one."""

    def __init__(self, config: EngineConfig, endpoints: Endpoints, on_exit: Callable[[], None]) -> None:
        """A worker of ``config`` on ``endpoints``, not started yet; ``on_exit`` is
        the client's handler of its exit, called once in the event loop."""
        context = worker_context(config)
        self._reader, self._parent_alive = context.Pipe(duplex=False)  # the liveness pipe: the worker reads
        self._process = context.Process(
            target=_bootstrap,
            args=(config.worker_entry, config, endpoints, self._reader, 0),
            name="rtvideo-worker-0",
            # A worker that starts pipeline ranks of its own cannot be daemonic; it
            # exits with this process either way (the liveness pipe, and shutdown).
            daemon=config.pp == 1,
        )
        self._on_exit = on_exit
        self._pidfd: int | None = None  # the worker's
        self._server_pid: int | None = None  # the fork server that forked it
        self._server_pidfd: int | None = None
        self._waiting: set[int] = set()  # pidfds whose exit is awaited before on_exit
        self.fork_server_lost: int | None = None
        """The pid of the fork server that died under this worker (then the worker was killed)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        """Fork the worker (blocking: the first start waits for the fork server's
        imports; call it in a thread). ``OSError`` or ``EOFError``: the fork server
        could not start it."""
        try:
            self._process.start()
        finally:
            self._reader.close()
        self._pidfd = _pidfd(self._process.pid)
        self._server_pid = fork_server_pid()
        self._server_pidfd = None if self._server_pid is None else _pidfd(self._server_pid)  # our child

    def watch(self) -> None:
        """Call ``on_exit`` once the worker has exited (in the running event loop)."""
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_sentinel)

    def _on_sentinel(self) -> None:
        """The fork server said the worker exited, or the fork server is gone."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._process.sentinel)
        if self._pidfd is None or _has_exited(self._pidfd):
            self._exited()
            return
        # The fork server died; the worker runs on without it. It is killed, and its
        # exit, with the fork server's, is awaited.
        self.fork_server_lost = self._server_pid
        self.kill()
        self._waiting = {fd for fd in (self._pidfd, self._server_pidfd) if fd is not None}
        for fd in self._waiting:
            loop.add_reader(fd, self._on_pidfd, fd)

    def _on_pidfd(self, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        self._waiting.discard(fd)
        if not self._waiting:
            self._exited()

    def _exited(self) -> None:
        self._process.join(timeout=1.0)  # reads the fork server's word (255 without one)
        self._close_pidfds()
        self._on_exit()

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: the signal); None while it runs, or when its fork
        server died and could not say (the worker was killed then)."""
        return None if self.fork_server_lost is not None else self._process.exitcode

    def describe_exit(self) -> str:
        """How the worker ended, for the reason its sessions failed."""
        if self.fork_server_lost is not None:
            return (
                f"the worker fork server (pid {self.fork_server_lost}) died, and worker process {self.pid}, "
                "which it had started, was killed with it"
            )
        return f"worker process {self.pid} died (exit code {self.exitcode})"

    def is_alive(self) -> bool:
        if self._pidfd is not None:
            return not _has_exited(self._pidfd)
        return self._process.is_alive()

    def kill(self) -> None:
        """SIGKILL (it reaches a stopped process too); the exit is reported as any other."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # already reaped
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        else:
            self._process.kill()

    def join(self, timeout: float | None = None) -> None:
        self._process.join(timeout)

    def close(self) -> None:
        """Stop watching and close the liveness pipe (a worker still running then
        sees its parent gone and exits)."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError):  # never started: no sentinel
            loop.remove_reader(self._process.sentinel)
        for fd in self._waiting:
            loop.remove_reader(fd)
        self._waiting = set()
        self._close_pidfds()
        self._parent_alive.close()

    def _close_pidfds(self) -> None:
        for fd in (self._pidfd, self._server_pidfd):
            if fd is not None:
                os.close(fd)
        self._pidfd = self._server_pidfd = None
