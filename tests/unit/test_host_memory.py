"""The CPU worker's memory budget for sessions (``rtvideo.workers.host_memory``): read
from a fake ``/proc`` and ``/sys/fs/cgroup`` tree."""

from __future__ import annotations

from pathlib import Path

from rtvideo.workers.host_memory import (
    available_bytes,
    cgroup_room,
    host_session_budget,
    meminfo_available,
    session_budget,
)

GIB = 1 << 30
MEMINFO = "MemTotal:       24684092 kB\nMemFree:        21502624 kB\nMemAvailable:    8388608 kB\n"  # 8 GiB


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_meminfo_and_cgroup_files_are_read():
    assert meminfo_available(MEMINFO) == 8 * GIB
    assert meminfo_available("MemTotal: 1 kB\n") is None
    assert cgroup_room("max\n", "123\n") is None  # v2, no limit
    assert cgroup_room("9223372036854771712\n", "123\n") is None  # v1, no limit
    assert cgroup_room(f"{4 * GIB}\n", f"{GIB}\n") == 3 * GIB
    assert cgroup_room(f"{GIB}\n", f"{2 * GIB}\n") == 0
    assert cgroup_room(None, None) is None


def test_available_memory_is_the_least_of_the_host_and_its_cgroup(tmp_path):
    host = tree(tmp_path / "host", {"proc/meminfo": MEMINFO})
    assert available_bytes(host) == 8 * GIB
    v2 = tree(
        tmp_path / "v2",
        {"proc/meminfo": MEMINFO, "sys/fs/cgroup/memory.max": f"{3 * GIB}", "sys/fs/cgroup/memory.current": f"{GIB}"},
    )
    assert available_bytes(v2) == 2 * GIB
    v1 = tree(
        tmp_path / "v1",
        {
            "proc/meminfo": MEMINFO,
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{16 * GIB}",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}",
        },
    )
    assert available_bytes(v1) == 8 * GIB  # the host has less than the cgroup allows
    assert available_bytes(tmp_path / "nothing") is None


def test_the_budget_leaves_the_transient_peak_and_a_margin():
    assert session_budget(8 * GIB, transient=GIB // 2) == 8 * GIB - GIB // 2 - GIB
    assert session_budget(GIB, transient=0) == GIB // 2  # a small host keeps half for everything else
    assert session_budget(GIB, transient=2 * GIB) == 0
    assert session_budget(None, transient=0) is None


def test_this_host_has_a_budget():
    budget = host_session_budget()
    assert budget is not None and budget > 0
