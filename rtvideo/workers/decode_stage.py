"""The decode stage: committed chunks decoded on a thread of their own.

Worker rank 0 (or whichever rank decodes). A micro-step whose row ends a chunk
commits it (the chunk is in the KV cache, so the session's next chunk may be
denoised) and leaves the VAE decode to this stage: ``submit`` queues it and
returns, and the next micro-steps run while it decodes. ``lanes`` threads,
each a FIFO; a session keeps the lane it was first given (the least loaded),
so its chunks come out in order while different sessions decode side by
side. With ``batch``, a lane takes every decode waiting on it at once and
decodes them in rounds of one chunk per session, each round one decoder
batch (``RunnerSessions.decode_many``): on a GPU the decodes that queued while
a forward ran go through the VAE together. On a CPU the overlap is threads
sharing the cores (it pays where the loop's own thread mostly waits, as
rank 0's does on a pipeline ring); on a
GPU the pipeline decodes on a stream of its own per thread
(``CausalWanPipeline.decode``), so the decode's kernels overlap the next
chunk's forward.

``DecodeStages`` is what the executor asks of a decode stage: this one and
``rtvideo.workers.parallel.rank_decode.RankDecodeStage`` (the decodes shared out
over pipeline ranks) each define all of it, with its signatures
(``step_done`` a no-op here), so the executor calls them without asking
whether they are there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rtvideo.engine.plan import DecodeResult
from rtvideo.workers.ordered_thread import OrderedThread
from rtvideo.workers.pipelines.capabilities import device_type
from rtvideo.workers.runner_sessions import RunnerSessions

log = logging.getLogger(__name__)


CPU_DECODE_ROWS = 4


def decode_batch_rows(pipeline) -> int:
    """The most chunks of different sessions one batched decode takes on
    ``pipeline`` (1: each decodes alone). 1 where it declares no
    ``decode_batch`` (``rtvideo.workers.pipelines.capabilities``); on a
    GPU ``max_batch_rows``, the rows its memory was planned for; on a CPU at
    least ``CPU_DECODE_ROWS``: there a batch costs only a little host memory
    and runs the decoder's many small kernels once for all its rows
    (measured with the tiny preset at 64x64 on 2 cores, one thread, a busy
    afternoon: 44-50 ms a chunk alone, 29-37 in batches of 2, 28-31 in
    batches of 4, 26 in batches of 8; ``rtvideo.workers.pipelines.cpu_kernels``)."""
    if not pipeline.capabilities.decode_batch:
        return 1
    if device_type(pipeline) == "cpu":
        return max(pipeline.max_batch_rows, CPU_DECODE_ROWS)
    return pipeline.max_batch_rows


class DecodeStages(Protocol):
    """A decode stage, as the executor (``rtvideo.workers.executor.LocalExecutor``) drives
    it: ``DecodeStage``, ``RankDecodeStage``, or a test's stand-in."""

    def submit(self, session_id: str, chunk_index: int) -> None:
        """Decode the session's committed chunk (after its earlier ones); its
        ``DecodeResult`` goes to the stage's callback, on a thread of its own."""
        ...

    def step_done(self, idle: bool) -> None:
        """A micro-step ended, its chunks submitted (``idle``: none is queued after
        it): a stage that gathers rounds of chunks may let them go; a no-op for
        one that decodes each as it comes."""
        ...

    def forget(self, session_id: str) -> None:
        """The session was released."""
        ...

    def close(self) -> None:
        """Decode what was submitted (what this rank holds), then stop."""
        ...

    @property
    def decodes(self) -> Sequence[int]:
        """Chunks decoded (with frames) so far, per rank, rank 0 first, for
        ``rank_figures``; empty for one that counts none (a rank it does
        not list decoded none)."""
        ...


class DecodeStage:
    def __init__(
        self,
        sessions: RunnerSessions,
        on_done: Callable[[DecodeResult], None],
        lanes: int = 1,
        batch: int = 1,
        nice: int = 0,
    ) -> None:
        """``sessions``: the runner's (``runner.sessions``), whose deferred
        decodes this runs. ``on_done`` is called on a lane's thread with each result; a session's
        in order. ``batch``: the most chunks one decoder batch takes (1: none).
        ``nice``: steps of ``nice`` the lanes run below the worker
        (``rtvideo.workers.os_threads``)."""
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._sessions = sessions
        self._on_done = on_done
        self._batch = batch
        together = self._decode_waiting if batch > 1 else None
        self._lanes: list[OrderedThread[tuple[str, int]]] = [
            OrderedThread(f"decode-{lane}", self._decode, together, nice=nice) for lane in range(lanes)
        ]
        self._lane_of: dict[str, int] = {}  # session -> its lane (touched by the submitting thread only)
        self._count_lock = threading.Lock()
        self.decodes = [0]  # chunks decoded (with frames), per rank: all on this one (as RankDecodeStage.decodes)

    def submit(self, session_id: str, chunk_index: int) -> None:
        lane = self._lane_of.get(session_id)
        if lane is None:
            load = [0] * len(self._lanes)
            for taken in self._lane_of.values():
                load[taken] += 1
            lane = self._lane_of[session_id] = load.index(min(load))
        self._lanes[lane].submit((session_id, chunk_index))

    def step_done(self, idle: bool) -> None:
        """Nothing to do: each lane takes what waits on it as soon as it is free."""

    def forget(self, session_id: str) -> None:
        """The session was released: its lane may go to another."""
        self._lane_of.pop(session_id, None)

    def close(self) -> None:
        """Decode what was submitted, then stop the threads."""
        for lane in self._lanes:
            lane.close()

    def _decode(self, item: tuple[str, int]) -> bool:
        session_id, chunk_index = item
        try:
            result = self._sessions.decode(session_id, chunk_index)
        except Exception as error:  # RunnerSessions returns pipeline errors; this is a bug of ours
            log.exception("decode of session %s chunk %d failed", session_id, chunk_index)
            result = DecodeResult(session_id, chunk_index, None, 0.0, f"decode failed: {error!r}")
        self._done(result)
        return True

    def _decode_waiting(self, items: list[tuple[str, int]]) -> bool:
        """Every decode waiting on a lane, in rounds (``batch_rounds``): a session's
        n-th chunk in round n, so its chunks decode in order; each batch of a
        round one decoder batch."""
        for keys in batch_rounds(items, self._batch):
            if len(keys) == 1:
                self._decode(keys[0])
                continue
            try:
                results = self._sessions.decode_many(keys)
            except Exception as error:  # as in _decode: a bug of ours, not a pipeline error
                log.exception("decodes of sessions %s failed", [sid for sid, _ in keys])
                results = [DecodeResult(sid, index, None, 0.0, f"decode failed: {error!r}") for sid, index in keys]
            for result in results:
                self._done(result)
        return True

    def _done(self, result: DecodeResult) -> None:
        with self._count_lock:
            self.decodes[0] += result.chunk is not None
        self._on_done(result)


def batch_rounds(items: list[tuple[str, Any]], most: int) -> list[list[tuple[str, Any]]]:
    """``items`` (session id first, in the order they came) in batches of at most
    ``most``, a session's n-th item in its n-th round of batches, rounds in
    order: each session's items come out in order, at most one per batch."""
    rounds: list[list[tuple[str, Any]]] = []
    seen: dict[str, int] = {}
    for item in items:
        n = seen[item[0]] = seen.get(item[0], -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(item)
    return [keys[first : first + most] for keys in rounds for first in range(0, len(keys), most)]
