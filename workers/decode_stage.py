"""The decode stage: committed chunks decoded on a thread of their own.

Worker rank 0 (or whichever rank decodes). A micro-step whose row ends a chunk
commits it (the chunk is in the KV cache, so the session's next chunk may be
denoised) and leaves the VAE decode to this stage: ``submit`` queues it and
returns, and the next micro-steps run while it decodes. One thread, one FIFO,
so a session's chunks come out in order. On a CPU the overlap is two threads
sharing the cores; on a GPU the pipeline decodes on a stream of its own
(``CausalWanPipeline.decode``), so the decode's kernels overlap the next
chunk's forward.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from engine.plan import DecodeResult
from workers.runner import ModelRunner

log = logging.getLogger(__name__)


class DecodeStage:
    def __init__(self, runner: ModelRunner, on_done: Callable[[DecodeResult], None]) -> None:
        """``on_done`` is called on this stage's thread with each result, in order."""
        self._runner = runner
        self._on_done = on_done
        self._lock = threading.Condition()
        self._queue: deque[tuple[str, int]] = deque()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    def submit(self, session_id: str, chunk_index: int) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("the decode stage is closed")
            self._queue.append((session_id, chunk_index))
            self._lock.notify_all()

    def close(self) -> None:
        """Decode what was submitted, then stop the thread."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                session_id, chunk_index = self._queue.popleft()
            try:
                result = self._runner.decode(session_id, chunk_index)
            except Exception as error:  # the runner returns pipeline errors; this is a bug of ours
                log.exception("decode of session %s chunk %d failed", session_id, chunk_index)
                result = DecodeResult(session_id, chunk_index, None, 0.0, f"decode failed: {error!r}")
            self._on_done(result)
