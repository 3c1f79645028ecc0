"""What the operating system knows of a worker's threads: names and priorities.

Worker processes. Two things, both Linux's (elsewhere they do nothing):

- **Names.** A thread that runs the worker's own work tells the kernel its
  name (``name_this_thread``), so ``top -H``, ``ps -L`` and ``/proc`` show
  ``executor``, ``decode-front`` or ``decode`` instead of ``python``.
- **Decode threads yield the cores.** A decode stage of its own
  (``rtvideo.workers.decode_stage``, the pipeline ranks' decode lanes in
  ``rtvideo.workers.parallel.rank_decode``) runs on a thread beside the one that
  runs the micro-steps. On a CPU both want the cores, and with pipeline ranks
  the micro-step thread is the ring: every millisecond the scheduler gives a
  decode thread instead holds up the ranks waiting for its activations.
  Linux gives each thread its own ``nice``, so the decode threads run some
  steps below the worker (``lower_this_thread``): the ring keeps its core
  whenever it can run, and the decodes fill the time it waits. Threads a
  lowered thread starts (an OpenMP pool's, say) inherit its nice.
  ``EngineConfig.decode_nice`` says how many steps (None: ``DEFAULT_CPU_NICE``
  for pipeline ranks on CPUs, where it saves the ring CPU (measured: frames
  per second the same within the noise); none on one rank,
  where a lowered decode would only lose the cores to every other process of
  the machine, the API server's media encoders included; none on GPUs, whose
  decode threads mostly launch kernels).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

DEFAULT_CPU_NICE = 10
MAX_NICE = 19
_PR_SET_NAME = 15  # prctl(2)
_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL
_LINUX = sys.platform.startswith("linux")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if _LINUX else None


def decode_nice(configured: int | None, device_type: str, ranks: int) -> int:
    """The steps of ``nice`` the decode threads take: as configured, else
    ``DEFAULT_CPU_NICE`` where the decodes run on the CPU (``device_type``
    ``"cpu"``) beside a pipeline ring (``ranks`` of 2 or more), else 0."""
    if configured is not None:
        return configured
    return DEFAULT_CPU_NICE if device_type == "cpu" and ranks >= 2 else 0


def name_this_thread(name: str | None = None) -> None:
    """Give the calling thread's kernel name ``name`` (default: its Python
    name), cut to 15 bytes. Never raises."""
    if _libc is None:
        return
    text = (name or threading.current_thread().name).encode(errors="replace")[:_NAME_BYTES]
    if _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(text), 0, 0, 0) != 0:
        log.debug("thread %s keeps its kernel name: prctl: %s", name, os.strerror(ctypes.get_errno()))


def lower_this_thread(steps: int) -> int | None:
    """Lower the calling thread's priority by ``steps`` of ``nice`` (capped at
    19) and return its nice now; None where nothing changed: ``steps`` is 0,
    the platform has no per-thread nice (only Linux has), or the system
    refused (logged). Never raises: a thread that cannot be lowered runs at
    the priority it had."""
    if steps <= 0 or not _LINUX:
        return None
    tid = threading.get_native_id()  # on Linux a thread's id is a PRIO_PROCESS target of its own
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, now + steps))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as error:
        log.warning("thread %s keeps its priority: setpriority refused: %s", threading.current_thread().name, error)
        return None
