"""How many CPU threads a worker's kernels run on, measured where they run.

Worker rank 0, after the warm-up and before the calibration (whose chunk
costs depend on it), with one rank on a CPU and ``EngineConfig.cpu_threads``
unset. torch runs each kernel on ``torch.get_num_threads()`` OpenMP threads,
every core by default. The worker's kernels run on its executor thread, not
on the process's main thread, and on the 2-core development machine that
made torch's default the slowest choice: a chunk of the tiny preset at
192 x 192 took 0.34-0.39 s on one thread and 0.46-0.55 s on two when run
from a second thread, against 0.36 s and 0.21-0.32 s from the main thread;
served, the tiny preset and the demo model made 2x the frames per second on
one thread (docs/ENGINE.md, Measured). A count that suits the main thread
can be the wrong one for the executor, and the right one depends on the
machine and the model, so it is measured: ``measure_cpu_threads`` runs a
throwaway session's chunks through the worker's own path
(``rtvideo.workers.chunk_driver``) on a fresh thread per candidate count
(``candidates``: 1, the powers of two below the core count, the core
count), the candidates in turn over up to ``ROUNDS`` rounds (a count far
behind the fastest after a round, ``CONTENDER`` times its time or more, is
not measured again; with one count left the measuring ends), and
``pick_threads`` keeps the fastest, or the fewest threads within
``TOLERANCE`` of it (they leave cores to the decode stage, the loop and the
API process). A model whose warm-up chunk took longer than
``MAX_CHUNK_S`` is not measured (the measuring would delay the start by
minutes): torch's default stays.

A thread takes torch's thread count when it first runs a kernel; the
executor and decode threads start after this, so they take the chosen one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence

from rtvideo.engine.messages import StartSession

log = logging.getLogger(__name__)

ROUNDS = 2  # each candidate is measured once per round, the candidates in turn
CONTENDER = 1.5  # after a round, counts slower than this times the fastest are not measured again
TIMED_CHUNKS = 2  # chunks timed per measurement, after one that warms the thread up
TOLERANCE = 0.1  # fewer threads win while within this fraction of the fastest
MAX_CHUNK_S = 2.0  # a warm-up chunk slower than this: not measured
SESSION = "rtvideo.cpu-threads"


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system says it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def oversubscribed(threads: int, cores: int) -> str | None:
    """A warning when a configured ``cpu_threads`` is more than the cores there
    are (each kernel's threads then wait on one another: on 2 cores, 64 threads
    made a chunk 40x slower), else None."""
    if threads <= cores:
        return None
    return (
        f"--cpu-threads {threads} is more than the {cores} cores this worker may run on: its kernels' threads "
        "will wait on one another; leave it unset for the worker to measure the best count"
    )


def candidates(cores: int) -> list[int]:
    """The thread counts worth measuring on ``cores`` cores: 1, the powers of
    two below ``cores``, and ``cores``."""
    counts, count = {1, max(1, cores)}, 2
    while count < cores:
        counts.add(count)
        count *= 2
    return sorted(counts)


def pick_threads(seconds: Mapping[int, Sequence[float]], tolerance: float = TOLERANCE) -> int:
    """The thread count to keep from measured chunk times (``seconds``: each
    count's measurements, read by their best): the fewest threads whose best
    is within ``tolerance`` of the fastest count's. ``ValueError`` for no
    measurements."""
    best = _best(seconds)
    if not best:
        raise ValueError("no thread count was measured")
    fastest = min(best.values())
    return min(count for count, time_s in best.items() if time_s <= fastest * (1.0 + tolerance))


def contenders_of(seconds: Mapping[int, Sequence[float]], margin: float = CONTENDER) -> list[int]:
    """The counts worth measuring again: those whose best is within ``margin``
    times the fastest's (one far behind stays behind)."""
    best = _best(seconds)
    fastest = min(best.values())
    return sorted(count for count, time_s in best.items() if time_s <= fastest * margin)


def _best(seconds: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """Each measured count's best time (counts not measured left out)."""
    return {count: min(times) for count, times in seconds.items() if times}


def measure_cpu_threads(pipeline, warm_chunk_s: float, cores: int | None = None) -> tuple[int | None, dict]:
    """Measure and choose the thread count for ``pipeline``'s kernels
    (``warm_chunk_s``: what a chunk took in the warm-up, per chunk). Returns
    the count (None: not measured, torch's default stays) and each count's
    measured seconds per chunk. Leaves torch's thread count as it found it:
    the caller applies the count (``torch.set_num_threads``) before the
    threads that will use it start. An error in the pipeline is raised."""
    import torch

    cores = cores or os.cpu_count() or 1
    counts = candidates(cores)
    if len(counts) == 1:
        return counts[0], {}
    if warm_chunk_s > MAX_CHUNK_S:
        log.info(
            "CPU threads not measured: a warm-up chunk took %.1f s (over %.1f); torch's default (%d) stays",
            warm_chunk_s,
            MAX_CHUNK_S,
            torch.get_num_threads(),
        )
        return None, {}
    from rtvideo.workers.chunk_driver import ChunkDriver

    began = time.perf_counter()
    driver = ChunkDriver(pipeline)
    seconds: dict[int, list[float]] = {count: [] for count in counts}
    contenders = counts
    previous = torch.get_num_threads()
    try:
        for _ in range(ROUNDS):
            for count in contenders:
                seconds[count].append(_on_a_thread(driver, count))
            contenders = contenders_of(seconds)
            if len(contenders) < 2:
                break
    finally:  # a thread's set_num_threads is also what threads started later take: put it back
        torch.set_num_threads(previous)
    chosen = pick_threads(seconds)
    log.info(
        "CPU threads for the kernels: %d (s per chunk on a thread of its own: %s; measured in %.1f s)",
        chosen,
        ", ".join(f"{count} threads {min(times):.3f}" for count, times in seconds.items() if times),
        time.perf_counter() - began,
    )
    return chosen, seconds


def _on_a_thread(driver, count: int) -> float:
    """Seconds per chunk of a throwaway session, on a fresh thread running
    ``count`` kernel threads (a chunk first, to warm the thread's pool up).
    An error in the pipeline is raised here."""
    import torch

    result: dict = {}

    def run() -> None:
        torch.set_num_threads(count)
        sid = f"{SESSION}.{count}"
        try:
            driver.open(StartSession(session_id=sid, prompt="cpu threads"))
            try:
                driver.run([sid], 1)
                began = time.perf_counter()
                driver.run([sid], TIMED_CHUNKS)
                result["s"] = (time.perf_counter() - began) / TIMED_CHUNKS
            finally:
                driver.release(sid)
        except BaseException as error:  # raised on the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name=f"cpu-threads-{count}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["s"]
