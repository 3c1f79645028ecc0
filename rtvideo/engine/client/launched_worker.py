"""A worker group started by a launcher, as the API process sees it.

``EngineClient`` spawns its worker as a child process and watches that
process; a group started by ``torchrun`` (``rtvideo.workers.launch``), on this machine
or others, is no child of the API process. ``LaunchedWorker`` stands in for
the child process handle (``pid``, ``is_alive``, ``kill``, ``join``,
``exitcode``): what the client learns of the group comes over the RPC pipes
(``WorkerHello`` when its rank 0 connects, ``WorkerExiting`` as its last
word), and what it does to it goes over them (``Terminate``). A group that
dies without a word (a machine lost, SIGKILL) is found by the heartbeat, as a
wedged one is. Pure Python: it holds no socket of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from rtvideo.engine.messages import Terminate, WorkerHello


class LaunchedWorker:
    def __init__(self, send_terminate: Callable[[Terminate], None], on_exit: Callable[[], None]) -> None:
        """``send_terminate`` sends a control message without waiting (best effort:
        the group may be gone); ``on_exit`` is the client's handler of a worker exit,
        called once, whichever way the exit was learned."""
        self._send_terminate = send_terminate
        self._on_exit = on_exit
        self.hello: WorkerHello | None = None
        self.exitcode: int | None = None
        self.exit_reason: str | None = None
        self._exited = False

    @property
    def pid(self) -> int | None:
        """Rank 0's pid on its own machine (``hello.host``); None before it said hello."""
        return None if self.hello is None else self.hello.pid

    def describe(self) -> str:
        if self.hello is None:
            return "the launched worker group (not connected)"
        return f"the launched worker group (rank 0: pid {self.hello.pid} on {self.hello.host})"

    def is_alive(self) -> bool:
        """It connected (said hello) and has not exited."""
        return self.hello is not None and not self._exited

    def exited(self, code: int, reason: str) -> None:
        """Its rank 0 said it is exiting (``WorkerExiting``), or the client gave it up."""
        if self._exited:
            return
        self._exited = True
        self.exitcode, self.exit_reason = code, reason
        self._on_exit()

    def kill(self, reason: str = "killed by the API process") -> None:
        """Ask rank 0 to exit at once (``Terminate``: its control receiver ends the
        process whatever the loop is doing), and count it gone: the launcher
        replaces the group, which connects and says hello again."""
        self._send_terminate(Terminate(reason=reason))
        self.exited(-9, reason)

    def join(self, timeout: float | None = None) -> None:
        """Nothing to reap: the process is the launcher's child, not ours."""

    def close(self) -> None:
        """Nothing to release: the group holds no pipe or descriptor of ours."""
