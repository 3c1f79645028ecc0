"""A worker process's log: timestamped lines that say which process wrote them.

Worker processes. ``configure(tag, level)`` is the one logging set-up of a
worker rank (``worker[rank]``) or a launcher's process before it is a rank
(``launch[rank]``): the format the API process's lines share (``server.logs``:
time, process, level, message) on stderr, at ``EngineConfig.log_level``. It
may be called again once the configuration is known (a launched process learns
its level from the API process): the later call replaces the earlier.
"""

from __future__ import annotations

import logging


def configure(tag: str, level: str = "info") -> None:
    """Log ``level`` and above (a ``logging`` level name, any case) on stderr,
    each line ``time tag LEVEL message``."""
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {tag} %(levelname)s %(message)s", force=True)
