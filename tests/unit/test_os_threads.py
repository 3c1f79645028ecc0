"""What the kernel knows of the worker's threads (``rtvideo.workers.os_threads``):
the names and the nice the threads really get, read back from ``/proc``."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from rtvideo.workers.ordered_thread import OrderedThread
from rtvideo.workers.os_threads import DEFAULT_CPU_NICE, MAX_NICE, decode_nice, lower_this_thread, name_this_thread

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def kernel_name_of_this_thread() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def on_a_thread(function):
    """``function``'s value, run on a fresh thread (whose priority dies with it)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(function()))
    thread.start()
    thread.join()
    return out[0]


def test_the_default_is_ten_steps_on_a_cpu_and_none_on_a_gpu_unless_configured():
    assert decode_nice(None, "cpu", 2) == DEFAULT_CPU_NICE == 10
    assert decode_nice(None, "cpu", 1) == 0  # one rank: no ring to yield to
    assert decode_nice(None, "cuda", 2) == 0
    assert decode_nice(3, "cuda", 1) == 3 and decode_nice(0, "cpu", 2) == 0


@linux_only
def test_lowering_a_thread_moves_only_that_thread_and_is_relative_and_capped():
    base = nice_of_this_thread()
    assert on_a_thread(lambda: (lower_this_thread(4), nice_of_this_thread())) == (min(MAX_NICE, base + 4),) * 2
    assert on_a_thread(lambda: (lower_this_thread(40), nice_of_this_thread())) == (MAX_NICE, MAX_NICE)
    assert on_a_thread(lambda: (lower_this_thread(0), nice_of_this_thread())) == (None, base)
    assert nice_of_this_thread() == base  # the calling thread kept its priority


@linux_only
def test_a_thread_tells_the_kernel_its_name_cut_to_what_the_kernel_keeps():
    assert on_a_thread(lambda: (name_this_thread("decode-front"), kernel_name_of_this_thread())[1]) == "decode-front"
    long = "a-name-longer-than-fifteen-bytes"

    def named_by_python() -> str:
        threading.current_thread().name = long
        name_this_thread()
        return kernel_name_of_this_thread()

    assert on_a_thread(named_by_python) == long[:15]


@linux_only
def test_an_ordered_thread_handles_its_items_at_its_nice_under_its_own_name():
    base = nice_of_this_thread()
    seen: dict[str, tuple[str, int]] = {}

    def handler(name):
        def handle(item) -> bool:
            seen[name] = (kernel_name_of_this_thread(), nice_of_this_thread())
            return False

        return handle

    lowered = OrderedThread("lowered", handler("lowered"), nice=5)
    plain = OrderedThread("plain", handler("plain"))
    for thread in (lowered, plain):
        thread.submit("item")
        thread.close()
    assert seen == {"lowered": ("lowered", min(MAX_NICE, base + 5)), "plain": ("plain", base)}
