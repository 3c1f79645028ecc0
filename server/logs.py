"""The API process's log: one format for the server's own lines and uvicorn's.

API process. ``logging_config(level)`` is the ``logging.config.dictConfig``
schema that ``rtvideo serve`` hands uvicorn as its ``log_config`` (uvicorn
applies it before anything logs). Every line is timestamped and tagged
``api``, as the workers' lines are tagged ``worker[rank]`` (``workers.process_log``),
so one stream read by an operator, or by ``journalctl``, says which process
wrote what and when. The server's own loggers (``server.*``, ``engine.*``:
sessions that end, fail, resume or are abandoned, draining, worker restarts)
log at ``level``; other libraries only their warnings and errors, so ``debug``
is the server's detail and not every dependency's. uvicorn's access log keeps
its own fields (client, request line, status) after the same prefix, on
stdout as uvicorn writes it.
"""

from __future__ import annotations

from engine.config import LOG_LEVELS

PREFIX = "%(asctime)s api %(levelname)s"
OWN_LOGGERS = ("server", "engine")


def logging_config(level: str) -> dict:
    """The dictConfig for an API process logging at ``level`` (one of
    ``engine.config.LOG_LEVELS``; ``ValueError`` naming it otherwise)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {"format": f"{PREFIX} %(message)s"},
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": f'{PREFIX} %(client_addr)s - "%(request_line)s" %(status_code)s',
                "use_colors": False,
            },
        },
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"},
            "access": {"class": "logging.StreamHandler", "formatter": "access", "stream": "ext://sys.stdout"},
        },
        "root": {"handlers": ["default"], "level": "WARNING"},
        "loggers": {
            **{name: {"level": upper} for name in OWN_LOGGERS},
            "uvicorn": {"handlers": ["default"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": ["access"], "level": upper, "propagate": False},
        },
    }
