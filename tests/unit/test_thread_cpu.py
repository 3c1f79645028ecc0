"""``rtvideo.bench.thread_cpu``: the benchmarks' per-thread CPU, read from ``/proc``."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from rtvideo.bench import thread_cpu
from rtvideo.workers.os_threads import name_this_thread


def test_a_stat_line_names_the_thread_even_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    line = "4242 (decode (2) x) S 1 4242 4242 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 3 0 100"
    assert thread_cpu.parse_stat(line, 100) == ("decode (2) x", 3.0)


def test_what_each_thread_name_spent_between_two_samples():
    before = {(1, 1): ("main", 1.0), (1, 2): ("decode", 2.0), (7, 7): ("main", 5.0)}
    after = {
        (1, 1): ("main", 1.5),
        (1, 2): ("decode", 4.0),
        (1, 3): ("decode", 0.25),  # began between the samples: counts from zero
        (7, 7): ("main", 9.0),
    }
    assert thread_cpu.spent(before, after, [1]) == {"decode": 2.25, "main": 0.5}
    assert thread_cpu.spent(before, after) == {"main": 4.5, "decode": 2.25}
    assert thread_cpu.sample([2**22 + 12345]) == {}  # no such process: nothing, no error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_busy_named_thread_of_this_process_is_seen_with_its_cpu():
    started, go, burned, stop = (threading.Event() for _ in range(4))

    def burn() -> None:
        name_this_thread("cpu-burner")
        started.set()
        go.wait(10)
        began = time.thread_time()
        while not stop.is_set():
            sum(range(1000))
            if time.thread_time() - began >= 0.3:
                burned.set()

    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert started.wait(10)
        before = thread_cpu.sample([os.getpid()])
        go.set()
        assert burned.wait(30)
        after = thread_cpu.sample([os.getpid()])
    finally:
        stop.set()
        worker.join(30)
    assert any(name == "cpu-burner" for name, _ in before.values()), "the thread is sampled by its kernel name"
    assert thread_cpu.spent(before, after)["cpu-burner"] >= 0.25  # 0.3 s of its own CPU (ticks round down)
