"""What the engine's API side raises (``rtvideo.engine.client``): the worker did
not start, no worker takes work (dead, restarting, closing), the worker refused
a session, or a call named a session that is not open."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the client's errors."""


class EngineStartupError(EngineError):
    """The worker did not come up (it failed, died, or never said READY)."""


class EngineDeadError(EngineError):
    """No worker can take work: it died and the restart budget is spent, the
    client is shutting down, or (``EngineRestartingError``) a fresh worker is
    on its way."""


class EngineRestartingError(EngineDeadError):
    """The worker died and a fresh one is starting: retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionRejectedError(EngineError):
    """The worker refused a start; ``code`` says why (e.g. ``server_full``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class UnknownSessionError(EngineError):
    """No open session has this id on this client."""
