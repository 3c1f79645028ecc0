"""A worker process's log: timestamped lines that say which process wrote them.

Worker processes. ``configure(tag, level)`` is the one logging set-up of a
worker rank (``worker[rank]``) or a launcher's process before it is a rank
(``launch[rank]``): the format the API process's lines share (``rtvideo.server.logs``:
time, process, level, message) on stderr. The worker's own loggers
(``OWN_LOGGERS``) log at ``EngineConfig.log_level``; other libraries (torch,
diffusers and what they use) only their warnings and errors, as in the API
process, so ``debug`` is the server's detail and not every dependency's. It
may be called again once the configuration is known (a launched process learns
its level from the API process): the later call replaces the earlier.
"""

from __future__ import annotations

import logging

OWN_LOGGERS = ("rtvideo",)  # the package's loggers: rtvideo.workers.*, rtvideo.engine.*, rtvideo.worker, rtvideo.launch


def configure(tag: str, level: str = "info") -> None:
    """Log the worker's own lines at ``level`` and above (a ``logging`` level
    name, any case) and other libraries' warnings and errors, on stderr, each
    line ``time tag LEVEL message``."""
    fmt = f"%(asctime)s {tag} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.WARNING, format=fmt, force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
