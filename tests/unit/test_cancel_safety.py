"""Cancellation is never lost in the asyncio code (``server/``, ``engine/``, ``bench/``, ``cli/`` of ``rtvideo/``).

On Python 3.11, which the project supports, ``asyncio.wait_for`` returns the
result of an awaitable that completed in the same turn of the loop as a
cancel of the waiting task, and the cancel is gone: the task runs on. That
hung ``EngineClient.shutdown`` waiting for a heartbeat task that kept probing
(``tests/engine/test_lifecycle.py`` has the race). ``asyncio.timeout`` keeps
the cancel, so timeouts are written with it; and a task cancelled and then
awaited is awaited through ``asyncio.gather(..., return_exceptions=True)``,
not inside ``suppress(CancelledError)``, which would swallow a cancel of the
awaiting task as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def asyncio_sources() -> list[Path]:
    return sorted(
        p for package in ("server", "engine", "bench", "cli") for p in (ROOT / "rtvideo" / package).rglob("*.py")
    )


def calls(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if node.args and name.endswith("suppress"):
                name += "(" + ", ".join(ast.unparse(a) for a in node.args) + ")"
            found.append((node.lineno, name))
    return found


def offenders(matches) -> list[str]:
    """``path:line`` of every call in the asyncio code whose name ``matches``."""
    return [
        f"{path.relative_to(ROOT)}:{line}" for path in asyncio_sources() for line, name in calls(path) if matches(name)
    ]


def test_no_timeout_is_written_with_asyncio_wait_for():
    found = offenders(lambda name: name == "asyncio.wait_for")
    assert not found, f"asyncio.wait_for can lose a cancel on Python 3.11; use asyncio.timeout: {found}"


def test_no_cancel_is_suppressed():
    found = offenders(lambda name: "suppress(" in name and "CancelledError" in name)
    assert not found, f"suppress(CancelledError) also swallows a cancel of the awaiting task: {found}"
