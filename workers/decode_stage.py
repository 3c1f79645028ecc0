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
from collections.abc import Callable

from engine.plan import DecodeResult
from workers.ordered_thread import OrderedThread
from workers.runner import ModelRunner

log = logging.getLogger(__name__)


class DecodeStage:
    def __init__(self, runner: ModelRunner, on_done: Callable[[DecodeResult], None]) -> None:
        """``on_done`` is called on this stage's thread with each result, in order."""
        self._runner = runner
        self._on_done = on_done
        self._thread: OrderedThread[tuple[str, int]] = OrderedThread("decode", self._decode)

    def submit(self, session_id: str, chunk_index: int) -> None:
        self._thread.submit((session_id, chunk_index))

    def close(self) -> None:
        """Decode what was submitted, then stop the thread."""
        self._thread.close()

    def _decode(self, item: tuple[str, int]) -> bool:
        session_id, chunk_index = item
        try:
            result = self._runner.decode(session_id, chunk_index)
        except Exception as error:  # the runner returns pipeline errors; this is a bug of ours
            log.exception("decode of session %s chunk %d failed", session_id, chunk_index)
            result = DecodeResult(session_id, chunk_index, None, 0.0, f"decode failed: {error!r}")
        self._on_done(result)
        return True
