"""A worker process's log (``rtvideo.workers.process_log``): its own lines at the
configured level, other libraries' warnings only, every line tagged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys
from rtvideo.workers import process_log
process_log.configure("launch[1]")
logging.getLogger("rtvideo.launch").debug("not yet: info until the API process says")
process_log.configure("worker[1]", sys.argv[1])
logging.getLogger("rtvideo.workers.runner").debug("a traceback would follow")
logging.getLogger("rtvideo.engine.loop").info("a session opened")
logging.getLogger("rtvideo.worker").warning("a worker warning")
logging.getLogger("torch.distributed").info("a dependency's detail")
logging.getLogger("diffusers").warning("a dependency's warning")
"""


def lines_at(level: str) -> list[str]:
    """What a fresh process configured as a worker at ``level`` writes, past each line's date and time."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, check=True, cwd=ROOT)
    return [line.split(" ", 2)[2] for line in done.stderr.splitlines()]


def test_the_workers_own_lines_follow_the_level_and_other_libraries_say_only_warnings():
    assert lines_at("debug") == [
        "worker[1] DEBUG a traceback would follow",
        "worker[1] INFO a session opened",
        "worker[1] WARNING a worker warning",
        "worker[1] WARNING a dependency's warning",
    ]
    assert lines_at("warning") == ["worker[1] WARNING a worker warning", "worker[1] WARNING a dependency's warning"]
