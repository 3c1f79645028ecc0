"""Where a benchmark's CPU went: each thread's CPU seconds, read from ``/proc``.

The benchmarks' process, no torch. ``sample(pids)`` reads the user and system
time of every thread of the given processes (Linux: ``/proc/PID/task/TID/stat``;
elsewhere an empty sample); ``spent(before, after)`` is what each thread used
between two samples, summed by thread name (``rtvideo.workers.os_threads`` names the
worker's threads: ``executor``, ``decode-front``, ``decode``...). A thread that
began between the samples counts from zero; one that ended between them is
missed (the worker's threads live as long as it does). A process's main thread
is named by the process's command, ``python`` here; it is reported as
``main``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")

Sample = dict[tuple[int, int], tuple[str, float]]
"""(pid, tid) -> (thread name, CPU seconds so far)."""


def sample(pids: Iterable[int], proc: Path = PROC) -> Sample:
    """The CPU seconds so far of every thread of ``pids`` (processes gone or
    unreadable are left out)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: Sample = {}
    for pid in pids:
        try:
            tids = [int(entry.name) for entry in (proc / str(pid) / "task").iterdir()]
        except (OSError, ValueError):
            continue
        for tid in tids:
            try:
                stat = (proc / str(pid) / "task" / str(tid) / "stat").read_text()
            except OSError:
                continue
            name, seconds = parse_stat(stat, ticks)
            out[pid, tid] = ("main" if tid == pid else name, seconds)
    return out


def parse_stat(stat: str, ticks: int) -> tuple[str, float]:
    """A thread's name and CPU seconds (user + system) from its ``stat`` line.
    The name sits in parentheses and may itself hold spaces or ``)``, so the
    fields are read after the last ``)``."""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    # after the name: state(0) ppid(1) ... utime(11) stime(12), in clock ticks
    return name, (int(fields[11]) + int(fields[12])) / ticks


def spent(before: Sample, after: Sample, pids: Iterable[int] | None = None) -> dict[str, float]:
    """CPU seconds each thread name used between two samples (of ``pids`` only,
    when given), largest first."""
    wanted = None if pids is None else set(pids)
    totals: dict[str, float] = {}
    for (pid, tid), (name, seconds) in after.items():
        if wanted is not None and pid not in wanted:
            continue
        used = seconds - before.get((pid, tid), (name, 0.0))[1]
        totals[name] = totals.get(name, 0.0) + used
    return dict(sorted(totals.items(), key=lambda item: -item[1]))
