"""How much host memory sessions may hold on a CPU worker.

Worker process, pure Python (no torch). On a CPU a session's state (its KV
cache, VAE feature cache, latents) lives in host memory, so the budget the
control plane admits sessions against comes from what the host can give:

    budget = available - transient - margin

- ``available``: the kernel's ``MemAvailable`` (``/proc/meminfo``: free memory
  plus what it can reclaim without swapping), and, inside a container with a
  memory limit, no more than that limit less the cgroup's usage (cgroup v2
  ``memory.max`` / ``memory.current``, or v1 ``memory.limit_in_bytes`` /
  ``memory.usage_in_bytes``). The cgroup's usage counts page cache too, so
  this errs on the low side.
- ``transient``: the worker's peak resident memory so far less its resident
  memory now, read after the warm-up and the calibration ran chunks: what a
  forward needs beyond the sessions' state while it runs (the model's build
  is in that peak too, so it errs high).
- ``margin``: 1 GiB, or half of what is available where that is less, for the
  API process (which holds finished jobs' videos) and everything else.

Read once, when the worker starts: memory that other programs take later is
not seen (the budget is a bound on what sessions may take, not a guarantee).
"""

from __future__ import annotations

import resource
from pathlib import Path

MARGIN_BYTES = 1 << 30
"""Memory left to everything else on the host (at most half of what is available)."""

UNLIMITED = 1 << 60
"""cgroup v1 writes a huge number, not ``max``, for no limit: at least this is none."""


def meminfo_available(text: str) -> int | None:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes (None if absent)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_room(limit_text: str | None, usage_text: str | None) -> int | None:
    """Bytes the cgroup may still take (limit less usage), or None without a limit."""
    if limit_text is None or usage_text is None:
        return None
    limit = limit_text.strip()
    if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    return max(0, int(limit) - int(usage_text.strip()))


def available_bytes(root: Path = Path("/")) -> int | None:
    """What this host (and its cgroup, if limited) can still give, or None when
    ``/proc/meminfo`` cannot be read (not Linux)."""
    available = meminfo_available(_read(root / "proc/meminfo") or "")
    if available is None:
        return None
    cgroup = root / "sys/fs/cgroup"
    for limit, usage in (
        ("memory.max", "memory.current"),  # v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        room = cgroup_room(_read(cgroup / limit), _read(cgroup / usage))
        if room is not None:
            available = min(available, room)
    return available


def transient_bytes() -> int:
    """This process's peak resident memory less its resident memory now."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    statm = _read(Path("/proc/self/statm"))
    if statm is None:
        return 0
    resident = int(statm.split()[1]) * resource.getpagesize()
    return max(0, peak - resident)


def session_budget(available: int | None, transient: int) -> int | None:
    """``available - transient - margin`` (never negative); None when unknown."""
    if available is None:
        return None
    margin = min(MARGIN_BYTES, available // 2)
    return max(0, available - transient - margin)


def host_session_budget() -> int | None:
    """The budget for sessions' state in this host's memory, now (module docstring)."""
    return session_budget(available_bytes(), transient_bytes())


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
