"""Rank 0's runner when the transformer is split over pipeline ranks.

Runs on the executor's thread of worker rank 0 (``rtvideo.workers.executor``), in
place of the one-rank ``ModelRunner``, with the same methods
(``rtvideo.workers.runner.WorkerRunner``). Like it, it holds a ``RunnerSessions``
(``rtvideo.workers.runner_sessions``: the sessions' state, the ``RowExecutor`` every
pipeline call goes through, releases, opens, boundaries, batched forwards,
decodes), which the executor and the decode stage take
(``runner.sessions``) and call directly; only ``execute`` differs (and
``rank_figures``, each rank's here). The engine plans each
micro-step for every rank (``MicroStep.ranks``: rank r runs the rows that
entered rank 0 r micro-steps ago; ``MicroStep.returning``: the rows the last
rank finished in the micro-step before, back at rank 0). Micro-step m here:

    send the plan to every other rank (``RankGroup.send_plan``: an
        ``rtvideo.engine.messages.RankPlan``); where the
        ring is on the plans' sockets, rank 1's carries the rows rank 0 ran
        in m-1, which rank 1 runs in m (it could not begin them before this
        plan: one write instead of two, and one wake-up)
    take back what the last rank finished in m-1 (its predictions: each row's
        sampler step; its commit passes: ``finish_commit``, then the decode)
    release, open, cross boundaries (as one rank does)
    run its own blocks over the rows entering (a denoise pass: ``forward``;
        a commit pass: ``commit``) for rank 1: kept for the next plan, or
        over ``torch.distributed`` posted now (``RingLink.send``: non-blocking,
        so rank 0 goes on while it travels)

Rows of a session that is stopping are not started (the plan's later ranks
expect them, but the message says which rows it carries), and rank 0's part
of a forward or commit pass whose sessions are all stopping is abandoned
between its blocks (``RunnerSessions.is_stopping``): those rows are left out of
the message, which still goes to rank 1, so no rank waits for a message that
never comes. Ranks after the first do not know of stops and run their part
of the rows they receive to the end. A row a later rank
failed comes back in the message's ``failed`` (``RingHeader.failed``) and
fails its session here, like any pipeline error (``RowExecutor.fail``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from rtvideo.engine.messages import RankFigures, RingHeader, RingItem, SessionGeometry, StartSession
from rtvideo.engine.plan import MicroStep, StepResult, StepRow
from rtvideo.workers.parallel.link import Message, items_and_tensors
from rtvideo.workers.pipelines.base import BatchRow, ChunkPipeline
from rtvideo.workers.row_executor import Ok, StageCall
from rtvideo.workers.runner_sessions import RunnerSessions


class RankError(RuntimeError):
    """A later pipeline rank failed a row (the message says which rank and why)."""


class RingRunner:
    def __init__(
        self,
        pipeline: ChunkPipeline,
        group,
        *,
        synchronize: Callable[[str], None] | None = None,
        on_stage: Callable[[StageCall], None] | None = None,
    ) -> None:
        """``group``: the ``rtvideo.workers.parallel.group.RankGroup`` (the link, the plans'
        sockets, the ranks' figures). ``synchronize`` and ``on_stage``: as
        ``ModelRunner``'s."""
        self.sessions = RunnerSessions(pipeline, synchronize=synchronize, on_stage=on_stage)
        self.pipeline = pipeline
        self.states = self.sessions.states  # session id -> the pipeline's state (RunnerSessions owns it)
        self.rows = self.sessions.rows
        self.group = group
        self._for_rank_1: tuple[int, Message] | None = None  # (tag, message): goes with the next plan
        self.busy_s = 0.0  # rank 0's time computing (not waiting for the ring)
        self.wall_s = 0.0  # rank 0's time inside micro-steps

    # -- engine.plan.Runner --------------------------------------------------

    def describe(self, start: StartSession) -> SessionGeometry:
        """The pipeline's ``describe``. A start with an ``input`` (video to video)
        needs the pipeline's ``video_input`` here as on one rank: this rank takes
        each chunk's frames (``take_input``) and crosses its boundary, and the
        chunk's latent goes on to the later ranks as the blocks' hidden states,
        so they need nothing of the input. One that does not declare it is
        refused, naming the pipeline and the ranks."""
        if start.input is not None and not self.pipeline.capabilities.video_input:
            raise ValueError(
                f"input: the {self.pipeline.name!r} pipeline split over {self.group.world} pipeline ranks "
                "takes no input video "
                "(it does not declare video_input: the first rank's take_input before each boundary)"
            )
        return self.sessions.describe(start)

    def held_sessions(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.sessions.held_sessions()

    def execute(self, step: MicroStep) -> StepResult:
        """Micro-step ``step`` on rank 0 (the module's docstring): the plan to the
        later ranks, what the last rank finished back, then rank 0's blocks over
        the rows entering, posted on to rank 1."""
        began = time.perf_counter()
        result = StepResult(step.number)
        carried, self._for_rank_1 = self._for_rank_1, None
        self.group.send_plan(step, carried)
        waited = 0.0
        if step.returning:
            waited_from = time.perf_counter()
            message = self.group.link.recv(self.group.world - 1, step.number)
            waited = time.perf_counter() - waited_from
            self.group.note_figures(message.header.figures)
            self._take_back(message, step.returning, result)
        self.sessions.prepare(step, result)
        rows = self.sessions.running(step.ranks[0])
        if step.ranks[0] or step.cancelled:  # rank 1 expects a message whenever rows were planned to enter
            message = self._enter(rows, result)
            if self.group.plans_carry_the_ring:  # rank 1 runs them in the next micro-step: they go with its plan
                self._for_rank_1 = (step.number + 1, message)
            else:
                self.group.link.send(1, step.number + 1, message)
        wall = time.perf_counter() - began
        self.wall_s += wall
        self.busy_s += wall - waited
        result.wall_s = wall
        return result

    # -- workers.runner.WorkerRunner --------------------------------------------

    def rank_figures(self) -> tuple[RankFigures, ...]:
        """Every rank's busy and wall seconds (``decoded_chunks`` 0: the decode
        stage counts those): rank 0's own, the others' as the latest message
        round the ring carried them (``RankGroup.figures``)."""
        others = sorted(self.group.figures.values(), key=lambda figures: figures.rank)
        own = RankFigures(rank=0, busy_s=self.busy_s, wall_s=self.wall_s)
        return (own, *(msgspec.structs.replace(f, decoded_chunks=0) for f in others))

    # -- the rows entering the ring --------------------------------------------

    def _enter(self, rows: list[StepRow], result: StepResult) -> Message:
        """Run the first rank's blocks over ``rows``: denoise passes in batches of
        ``max_batch_rows`` (a batch that raises is rerun row by row, so only a
        row that fails on its own fails its session), each commit pass alone;
        returns the message for rank 1."""
        blocks = self.group.blocks
        items: list[RingItem] = []
        tensors: list = []
        denoise = [row for row in rows if not row.commit]
        width = self.pipeline.max_batch_rows
        for first in range(0, len(denoise), width):
            for ran in self.sessions.forwards(result, denoise[first : first + width], blocks):
                for row in ran.rows:
                    out = result.row(row.session_id, row.chunk_index)
                    out.denoise_ms += ran.outcome.ms / len(ran.rows)
                    self.rows.note_batch(out, len(ran.rows))
                self._add(items, tensors, "forward", ran.outcome.value)
        for row in rows:
            if row.commit:
                sid, index = row.session_id, row.chunk_index
                session = self.states[sid]
                outcome = self.rows.call(
                    result, sid, index, "commit", self.pipeline.commit, session, index, blocks, stoppable=True
                )
                if isinstance(outcome, Ok):
                    result.row(sid, index).decode_ms += outcome.ms
                    self._add(items, tensors, "commit", outcome.value)
        return Message(RingHeader(items=tuple(items)), tensors)

    def _add(self, items: list[RingItem], tensors: list, kind: str, hidden) -> None:
        meta, parts = self.pipeline.pack(hidden)
        items.append(RingItem(kind=kind, meta=meta, count=len(parts)))
        tensors.extend(parts)

    # -- the rows coming back ----------------------------------------------------

    def _take_back(self, message: Message, returning: list[StepRow], result: StepResult) -> None:
        """The last rank's results for ``returning``: sampler steps for denoise
        passes, ``finish_commit`` (then the decode) for commit passes; rows it
        failed fail here; rows it does not carry were not started (stopping)."""
        planned = {(r.session_id, r.chunk_index, r.step): r for r in returning}
        for sid, error in message.header.failed.items():
            if sid in self.states:
                chunk_index = min((r.chunk_index for r in returning if r.session_id == sid), default=0)
                self.rows.fail(result, sid, chunk_index, "forward", RankError(error))
        ended: list[tuple[str, int]] = []  # chunks committed here: decoded (or deferred) together after
        for item, parts in items_and_tensors(message):
            for index, (sid, chunk_index, step) in enumerate(item.rows):
                row = planned.get((sid, chunk_index, step))
                if row is None or not self.sessions.running([row]):  # not started, released, or failed
                    continue
                session = self.states[sid]
                if item.kind == "commit":
                    done = self.rows.call(
                        result, sid, chunk_index, "commit", self.pipeline.finish_commit, session, chunk_index
                    )
                    if isinstance(done, Ok):
                        out = result.row(sid, chunk_index)
                        out.decode_ms += done.ms
                        out.committed = True
                        ended.append((sid, chunk_index))
                    continue
                prediction = parts[index].to(self.pipeline.device)
                batch_row = BatchRow(sid, chunk_index, step)
                stepped = self.rows.call(
                    result, sid, chunk_index, "sampler_step", self.pipeline.sampler_step, session, batch_row, prediction
                )
                if isinstance(stepped, Ok):
                    out = result.row(sid, chunk_index)
                    out.stepped = True
                    out.denoise_ms += stepped.ms
        self.sessions.committed(result, ended)
