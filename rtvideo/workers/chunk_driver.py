"""One chunk driver: sessions through ``ModelRunner.execute``, micro-step by
micro-step, the way the worker runs them, for callers in the worker's own
process that have no engine loop: the warm-up (``rtvideo.workers.warmup``), the
pipeline bench (``rtvideo.bench.pipeline``) and the model tests.

It plans as the engine loop does (``rtvideo.engine.plan``): a micro-step opens
sessions, crosses a session's chunk boundary together with its chunk's first
step, and carries one row per session, at most ``max_rows`` rows (sessions take
turns round-robin when they do not all fit); a chunk's boundary comes only after its previous
chunk came back. After a chunk's last step the runner commits and decodes it;
with ``overlap_decode`` the decode goes to the decode stage
(``rtvideo.workers.decode_stage``, as in the worker) and the next micro-steps run while
it decodes. A session with an input (video to video) gets each chunk's frames
in its boundary task (``run``'s ``inputs``), as the engine loop hands them, and
a chunk of no denoise step is its commit row alone. A pipeline error is raised
here, as the pipeline raised it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rtvideo.engine.messages import StartSession, SubmitInput
from rtvideo.engine.plan import BoundaryTask, ChunkOutput, DecodeResult, MicroStep, StepResult, StepRow
from rtvideo.workers.decode_stage import DecodeStage, decode_batch_rows
from rtvideo.workers.pipelines.base import ChunkPipeline, SessionState
from rtvideo.workers.runner import ModelRunner, StageCall


class ChunkDriver:
    def __init__(
        self,
        pipeline: ChunkPipeline,
        *,
        max_rows: int | None = None,
        synchronize: Callable[[str], None] | None = None,
        on_stage: Callable[[StageCall], None] | None = None,
        overlap_decode: bool = False,
    ) -> None:
        """``max_rows``: rows per micro-step (default: the pipeline's
        ``max_batch_rows``; 1 steps one session per forward). ``synchronize``
        and ``on_stage`` go to the runner (stage timings, for benchmarks)."""
        self.pipeline = pipeline
        self.max_rows = max_rows or pipeline.max_batch_rows
        self._on_stage = on_stage
        self._errors: dict[str, BaseException] = {}
        self.runner = ModelRunner(pipeline, synchronize=synchronize, on_stage=self._heard)
        self.next_chunk: dict[str, int] = {}  # per open session: the chunk its next boundary begins
        self._number = 0
        self._last: str | None = None  # the session served last
        self._decoder: DecodeStage | None = None
        self._decoded: queue.SimpleQueue[DecodeResult] = queue.SimpleQueue()
        if overlap_decode:
            self.runner.sessions.defer_decode = True
            self._decoder = DecodeStage(self.runner.sessions, self._decoded.put, batch=decode_batch_rows(pipeline))

    def open(self, *starts: StartSession) -> list[SessionState]:
        """Open sessions (one micro-step); returns their pipeline states."""
        self.execute(MicroStep(number=0, open=list(starts)))
        for start in starts:
            self.next_chunk[start.session_id] = 0
        return [self.runner.states[start.session_id] for start in starts]

    def run(
        self,
        session_ids: Sequence[str],
        chunks: int = 1,
        interactions: Mapping[str, tuple[str, int]] | None = None,
        inputs: Mapping[str, Sequence[Any]] | None = None,
    ) -> dict[str, list[ChunkOutput]]:
        """``chunks`` more chunks of each session; ``interactions`` maps a session to
        (prompt, transition chunks) applied at its next boundary; ``inputs`` (video
        to video) maps a session to its frames for each of those chunks, uint8
        ``[F, H, W, 3]`` numpy arrays, handed to its boundaries as the engine hands
        them (``BoundaryTask.input``). Returns each session's chunks, in order."""
        pending = dict(interactions or {})
        given = {sid: list(frames) for sid, frames in (inputs or {}).items()}
        left = {sid: chunks for sid in session_ids}
        at_step: dict[str, int] = {}  # sessions inside a chunk: the step of their next row
        outputs: dict[str, list[ChunkOutput]] = {sid: [] for sid in session_ids}
        decoding = 0  # decodes handed to the decode stage
        while any(left.values()):
            waiting = [sid for sid in session_ids if left[sid]]
            if len(waiting) <= self.max_rows:
                picked = waiting  # lockstep, rows in the order given
            else:  # round-robin, from the session after the last one served
                after = session_ids.index(self._last) + 1 if self._last in session_ids else 0
                picked = [sid for sid in [*session_ids[after:], *session_ids[:after]] if left[sid]][: self.max_rows]
            self._last = picked[-1]
            micro = MicroStep(number=0, ranks=[[]])
            for sid in picked:
                chunk, step = self.next_chunk[sid], at_step.get(sid, 0)
                if step == 0:
                    prompt, transition = pending.pop(sid, (None, 0))
                    frames = _submitted(sid, chunk, given[sid].pop(0)) if given.get(sid) else None
                    micro.boundaries.append(BoundaryTask(sid, chunk, prompt, transition, frames))
                steps = self.runner.states[sid].geometry.num_inference_steps
                micro.ranks[0].append(StepRow(sid, chunk, step, steps))  # no step: its commit row
            result = self.execute(micro)
            for row in micro.ranks[0]:
                sid = row.session_id
                if not (row.last or row.commit):
                    at_step[sid] = row.step + 1
                    continue
                if self._decoder is None:
                    outputs[sid].append(result.row(sid, row.chunk_index).chunk)
                at_step.pop(sid, None)
                self.next_chunk[sid] += 1
                left[sid] -= 1
            for sid, chunk in result.decodes:
                self._decoder.submit(sid, chunk)
                decoding += 1
        for _ in range(decoding):  # a session's chunks come back in order
            decoded = self._decoded.get()
            if decoded.error is not None:
                raise self._errors.get(decoded.session_id) or RuntimeError(decoded.error)
            outputs[decoded.session_id].append(decoded.chunk)
        return outputs

    def run_chunk(self, session_id: str, prompt: str | None = None, transition_chunks: int = 0) -> ChunkOutput:
        """The next chunk of one session, with an interaction at its boundary if ``prompt`` is given."""
        interactions = None if prompt is None else {session_id: (prompt, transition_chunks)}
        return self.run([session_id], 1, interactions)[session_id][0]

    def close(self) -> None:
        """Stop the decode stage's thread (when there is one)."""
        if self._decoder is not None:
            self._decoder.close()

    def release(self, *session_ids: str) -> None:
        """Release sessions (one micro-step); ids not open are ignored."""
        self.execute(MicroStep(number=0, release=list(session_ids)))
        for sid in session_ids:
            self.next_chunk.pop(sid, None)

    def execute(self, micro: MicroStep) -> StepResult:
        """Run one micro-step (numbered here); re-raises the first pipeline error of any row."""
        self._number += 1
        micro.number = self._number
        self._errors.clear()
        result = self.runner.execute(micro)
        for (sid, _), row in result.rows.items():
            if row.error is not None:
                self.next_chunk.pop(sid, None)
                error = self._errors.get(sid)
                raise error if error is not None else RuntimeError(f"session {sid}: {row.error}")
        return result

    def _heard(self, call: StageCall) -> None:
        if call.error is not None:
            self._errors.setdefault(call.session_id, call.error)
        if self._on_stage is not None:
            self._on_stage(call)


def _submitted(session_id: str, chunk_index: int, frames: Any) -> SubmitInput:
    """A chunk's input frames as the engine hands them to its boundary."""
    count, height, width, _ = frames.shape
    return SubmitInput(
        session_id=session_id,
        chunk_index=chunk_index,
        count=count,
        height=height,
        width=width,
        frames=frames.tobytes(),
    )
