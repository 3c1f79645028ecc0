"""The loop of a pipeline rank after the first.

A follower process holds its block range of the transformer and, per
session, only those blocks' KV cache. It runs no policy: it takes each
micro-step's plan from rank 0 (an ``rtvideo.engine.messages.RankPlan``, in order,
over the ranks' sockets) and does its part of it:

    release, open (allocate its blocks' cache), follow boundaries (a reset)
    if the plan gives it rows: receive them from the rank before (the message
        says which rows it carries and which failed upstream), run its blocks
        over them (a batch that raises is rerun row by row; a row that fails
        alone is named in ``failed`` and goes no further; so is every row of
        a session whose open or boundary failed here: none runs on a cache
        that missed its boundary), and post the result
        on: hidden states to the next rank, or, on the last rank, the
        predictions and finished commit passes back to rank 0

Each message (its header an ``rtvideo.engine.messages.RingHeader``) also carries the
ranks' figures so far (``RankFigures``: busy and wall seconds, cumulative),
so rank 0 learns every rank's busy / bubble fraction.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from rtvideo.engine.messages import RankFigures, RankPlan, RingHeader, RingItem
from rtvideo.workers.parallel.link import Message, RingLink, items_and_tensors
from rtvideo.workers.pipelines.base import BatchRow, Hidden, StepBatch

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, pipeline, link: RingLink, blocks: range) -> None:
        self.pipeline = pipeline
        self.link = link
        self.blocks = blocks
        self.states: dict[str, Any] = {}
        self.failed: dict[str, str] = {}  # sessions that failed on this rank, until released
        self.busy_s = 0.0
        self.wall_s = 0.0
        self.decoder = None  # workers.parallel.decode_server.DecodeServer, where this rank decodes sessions

    @property
    def last(self) -> bool:
        return self.link.rank == self.link.world - 1

    def run(self, step: RankPlan) -> None:
        """Do this rank's part of micro-step ``step``."""
        rank = self.link.rank
        for sid in step.release:
            self._release(sid)
        for start in step.open:
            try:
                geometry = self.pipeline.describe(start)
                self.states[start.session_id] = self.pipeline.open(start, geometry, None)
            except Exception as error:
                self.failed[start.session_id] = f"rank {rank}: open failed: {type(error).__name__}: {error}"
        for task in step.boundaries:
            session = self.states.get(task.session_id)
            if session is not None:
                self._guard(
                    task.session_id,
                    "boundary",
                    self.pipeline.follow_boundary,
                    session,
                    task.chunk_index,
                    task.prompt_changed,
                )
        if not step.ranks[rank]:
            return
        began = time.perf_counter()
        message = self.link.recv(rank - 1, step.number)
        received = time.perf_counter()
        out = self._compute(message, {(r.session_id, r.chunk_index, r.step) for r in step.ranks[rank]})
        done = time.perf_counter()
        self.busy_s += done - received
        self.wall_s += done - began
        figures = (
            *(f for f in message.header.figures if f.rank != rank),
            RankFigures(rank=rank, busy_s=self.busy_s, wall_s=self.wall_s),
        )
        out = Message(msgspec.structs.replace(out.header, figures=figures), out.tensors)
        if self.last:
            self.link.send(0, step.number + 1, out)
        else:
            self.link.send(rank + 1, step.number + 1, out)

    def _compute(self, message: Message, planned: set[tuple]) -> Message:
        failed = dict(message.header.failed)
        items: list[RingItem] = []
        tensors: list = []
        for item, parts in items_and_tensors(message):
            if item.meta is None:
                raise ValueError(f"rank {self.link.rank}: a {item.kind} pass reached it without hidden states")
            hidden = self.pipeline.unpack(item.meta, parts)
            keep = [
                i
                for i, row in enumerate(hidden.rows)
                if (row.session_id, row.chunk_index, row.step) in planned
                and row.session_id in self.states
                and row.session_id not in self.failed  # its cache here missed a boundary: the session fails
            ]
            for i, row in enumerate(hidden.rows):
                if i not in keep and row.session_id in self.failed:
                    failed[row.session_id] = self.failed[row.session_id]
            if not keep:
                continue
            if len(keep) != len(hidden.rows):
                hidden = self.pipeline.select(hidden, keep)
            for kind, value in self._run(item.kind, hidden, failed):
                self._emit(items, tensors, kind, value)
        return Message(RingHeader(items=tuple(items), failed=failed), tensors)

    def _run(self, kind: str, hidden: Hidden, failed: dict[str, str]) -> list[tuple[str, Any]]:
        """This rank's blocks over ``hidden``'s rows: [(kind, Hidden or (rows, predictions))]."""
        sessions = [self.states[row.session_id] for row in hidden.rows]
        try:
            if kind == "commit":
                row = hidden.rows[0]
                value = self.pipeline.commit(sessions[0], row.chunk_index, self.blocks, hidden)
                return [("commit", value if value is not None else hidden.rows)]
            value = self.pipeline.forward(_batch(hidden), sessions, self.blocks, hidden)
            return [("forward", value if isinstance(value, Hidden) else (hidden.rows, value))]
        except Exception as error:
            if len(hidden.rows) == 1:
                sid = hidden.rows[0].session_id
                stage = "commit" if kind == "commit" else "forward"
                failed[sid] = f"rank {self.link.rank}: {stage} failed: {type(error).__name__}: {error}"
                self.failed[sid] = failed[sid]
                log.warning("session %s failed on rank %d: %s", sid, self.link.rank, failed[sid])
                return []
            out = []
            for index in range(len(hidden.rows)):
                out.extend(self._run(kind, self.pipeline.select(hidden, [index]), failed))
            return out

    def _emit(self, items: list[RingItem], tensors: list, kind: str, value: Any) -> None:
        if isinstance(value, Hidden):
            meta, parts = self.pipeline.pack(value)
            items.append(RingItem(kind=kind, meta=meta, count=len(parts)))
            tensors.extend(parts)
            return
        if kind == "commit":  # the last block ran: rank 0 finishes the commit
            items.append(RingItem(kind="commit", rows=tuple(_row(r) for r in value), count=0))
            return
        rows, predictions = value
        items.append(RingItem(kind="forward", rows=tuple(_row(r) for r in rows), count=len(predictions)))
        tensors.extend(p.contiguous() for p in predictions)

    def _guard(self, sid: str, stage: str, function, *args) -> None:
        try:
            function(*args)
        except Exception as error:
            self.failed[sid] = f"rank {self.link.rank}: {stage} failed: {type(error).__name__}: {error}"

    def _release(self, sid: str) -> None:
        self.failed.pop(sid, None)
        session = self.states.pop(sid, None)
        if session is not None:
            try:
                self.pipeline.release(session)
            except Exception:
                log.exception("release of session %s failed on rank %d", sid, self.link.rank)

    def held_sessions(self) -> tuple[str, ...]:
        return tuple(self.states)


def _batch(hidden: Hidden) -> StepBatch:
    return StepBatch(hidden.rows)


def _row(row: BatchRow) -> tuple[str, int, int]:
    return (row.session_id, row.chunk_index, row.step)
