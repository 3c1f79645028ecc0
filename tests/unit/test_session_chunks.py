"""A session's chunk records are changed by two threads at once: a boundary
adds a chunk on the micro-step thread while the decode stage's thread removes
an earlier, decoded one. The order checks must not trip over that.

Each test makes the other thread's change happen in the middle of a check, at
the one point where it can (the check reading a record, or comparing a key),
so the interleaving that failed served sessions ("dictionary changed size
during iteration", seen in an e2e run under load) happens every time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from rtvideo.engine.messages import SessionGeometry, StartSession
from rtvideo.workers.pipelines.base import BatchRow, ChunkOrderError, ChunkRecord, SessionState

GEOMETRY = SessionGeometry(
    width=32,
    height=32,
    fps=16.0,
    num_inference_steps=2,
    first_chunk_frames=1,
    frames_per_chunk=4,
    num_chunks=None,
    transition_chunks=0,
)


def session(lookahead: int = 1) -> SessionState:
    start = StartSession(session_id="s", prompt="a fox", seed=1, width=32, height=32)
    return SessionState(session_id="s", start=start, geometry=GEOMETRY, lookahead=lookahead)


@dataclass
class DecodedMidCheck(ChunkRecord):
    """A committed chunk that, the first time a check reads whether it is
    committed, has the decode thread remove ``victim`` (decoded) from the session."""

    owner: Any = None
    victim: int | None = None

    def __getattribute__(self, name: str) -> Any:
        if name == "committed":
            owner, victim = object.__getattribute__(self, "owner"), object.__getattribute__(self, "victim")
            if owner is not None and victim in owner.chunks:
                del owner.chunks[victim]
        return object.__getattribute__(self, name)


class BoundaryMidCheck(int):
    """A chunk index that, compared during a check, has the micro-step thread add
    a later chunk (``added``) to the session: a boundary while a decode checks."""

    owner: Any = None
    added: int = 0

    def __lt__(self, other: object) -> bool:
        chunks = self.owner.chunks
        if self.added not in chunks:
            chunks[self.added] = ChunkRecord(index=self.added, steps=2)
        return int(self) < other


def test_a_decode_removing_a_chunk_mid_check_leaves_the_forward_running() -> None:
    state = session()
    state.chunks[0] = DecodedMidCheck(index=0, steps=2, at_step=2, committed=True, owner=state, victim=1)
    state.chunks[1] = ChunkRecord(index=1, steps=2, at_step=2, committed=True)
    state.chunks[2] = ChunkRecord(index=2, steps=2)
    assert state.chunk_at(BatchRow("s", 2, 0)) is state.chunks[2]
    assert 1 not in state.chunks  # the decode did remove it, mid-check


def test_a_decode_removing_a_chunk_mid_check_leaves_a_boundary_and_its_refusals_right() -> None:
    state = session()
    state.chunks[0] = DecodedMidCheck(index=0, steps=2, at_step=2, committed=True, owner=state, victim=1)
    state.chunks[1] = ChunkRecord(index=1, steps=2, at_step=2, committed=True)
    state.check_boundary(2)  # every earlier chunk committed: allowed
    state.chunks[0].victim = 3
    state.chunks[3] = ChunkRecord(index=3, steps=2, at_step=2, committed=True)
    state.chunks[4] = ChunkRecord(index=4, steps=2)  # in flight, uncommitted
    with pytest.raises(ChunkOrderError, match="chunk 5 cannot be prepared before chunk 4 is committed"):
        state.check_boundary(5)


def test_a_decode_removing_a_chunk_mid_check_leaves_a_commit_right() -> None:
    state = session(lookahead=2)
    state.chunks[0] = DecodedMidCheck(index=0, steps=2, at_step=2, committed=True, owner=state, victim=1)
    state.chunks[1] = ChunkRecord(index=1, steps=2, at_step=2, committed=True)
    state.chunks[2] = ChunkRecord(index=2, steps=2, at_step=2)
    assert state.chunk_to_commit(2) is state.chunks[2]


def test_a_boundary_adding_a_chunk_mid_check_leaves_the_decode_running() -> None:
    state = session()
    key = BoundaryMidCheck(1)
    key.owner, key.added = state, 2
    state.chunks[key] = ChunkRecord(index=1, steps=2, at_step=2, committed=True)
    assert state.chunk_to_decode(1) is state.chunks[1]
    assert 2 in state.chunks  # the boundary did add it, mid-check


def test_a_boundary_adding_a_chunk_mid_check_leaves_the_decode_order_enforced() -> None:
    state = session(lookahead=2)
    key = BoundaryMidCheck(0)
    key.owner, key.added = state, 3
    state.chunks[key] = ChunkRecord(index=0, steps=2, at_step=2, committed=True)
    state.chunks[1] = ChunkRecord(index=1, steps=2, at_step=2, committed=True)
    with pytest.raises(ChunkOrderError, match="chunk 1 cannot be decoded before chunk 0"):
        state.chunk_to_decode(1)
