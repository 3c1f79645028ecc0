"""The decode stage: committed chunks decoded on a thread of their own.

Worker rank 0 (or whichever rank decodes). A micro-step whose row ends a chunk
commits it (the chunk is in the KV cache, so the session's next chunk may be
denoised) and leaves the VAE decode to this stage: ``submit`` queues it and
returns, and the next micro-steps run while it decodes. ``lanes`` threads,
each a FIFO; a session keeps the lane it was first given (the least loaded),
so its chunks come out in order while different sessions decode side by
side. With ``batch``, a lane takes every decode waiting on it at once and
decodes them in rounds of one chunk per session, each round one decoder
batch (``ModelRunner.decode_many``): on a GPU the decodes that queued while
a forward ran go through the VAE together. On a CPU the overlap is threads
sharing the cores (it pays where the loop's own thread mostly waits, as
rank 0's does on a pipeline ring); on a
GPU the pipeline decodes on a stream of its own per thread
(``CausalWanPipeline.decode``), so the decode's kernels overlap the next
chunk's forward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.plan import DecodeResult
from workers.ordered_thread import OrderedThread
from workers.runner import ModelRunner

log = logging.getLogger(__name__)


def decodes_batch(pipeline) -> bool:
    """Whether chunks of several sessions decode as one batch on ``pipeline``: it
    takes batched forwards (``max_batch_rows`` > 1) and has ``decode_batch``."""
    return pipeline.max_batch_rows > 1 and hasattr(pipeline, "decode_batch")


class DecodeStage:
    def __init__(
        self, runner: ModelRunner, on_done: Callable[[DecodeResult], None], lanes: int = 1, batch: bool = False
    ) -> None:
        """``on_done`` is called on a lane's thread with each result; a session's in order."""
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self._runner = runner
        self._on_done = on_done
        together = self._decode_waiting if batch else None
        self._lanes: list[OrderedThread[tuple[str, int]]] = [
            OrderedThread(f"decode-{lane}", self._decode, together) for lane in range(lanes)
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
            result = self._runner.decode(session_id, chunk_index)
        except Exception as error:  # the runner returns pipeline errors; this is a bug of ours
            log.exception("decode of session %s chunk %d failed", session_id, chunk_index)
            result = DecodeResult(session_id, chunk_index, None, 0.0, f"decode failed: {error!r}")
        self._done(result)
        return True

    def _decode_waiting(self, items: list[tuple[str, int]]) -> bool:
        """Every decode waiting on a lane, in rounds: a session's n-th chunk in
        round n, so its chunks decode in order; each round one batch."""
        rounds: list[list[tuple[str, int]]] = []
        seen: dict[str, int] = {}
        for session_id, chunk_index in items:
            n = seen[session_id] = seen.get(session_id, -1) + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append((session_id, chunk_index))
        for keys in rounds:
            if len(keys) == 1:
                self._decode(keys[0])
                continue
            try:
                results = self._runner.decode_many(keys)
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
