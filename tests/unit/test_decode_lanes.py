"""The decode stage's lanes: different sessions decode side by side, a
session's chunks come out in order, on one lane, and a released session's
lane goes to the next (threads; a recording stand-in for the runner's sessions).
And both decode stages, one rank's and the one over pipeline ranks, define
every member of what the executor drives (``DecodeStages``), each method
with its signature: the executor asks none of them whether it is there."""

from __future__ import annotations

import inspect
import threading

from rtvideo.engine.plan import DecodeResult
from rtvideo.workers.decode_stage import DecodeStage, DecodeStages


class RecordingSessions:
    """``decode`` records (session, chunk, thread); a barrier can hold it until
    ``parties`` decodes are inside at once."""

    def __init__(self, parties: int = 1) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(parties) if parties > 1 else None

    def decode(self, session_id: str, chunk_index: int) -> DecodeResult:
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # BrokenBarrierError unless the others decode at the same time
        with self.lock:
            self.calls.append((session_id, chunk_index, threading.current_thread().name))
        return DecodeResult(session_id, chunk_index, None, 0.0)


def test_two_sessions_decode_at_once_on_two_lanes_each_in_order():
    runner = RecordingSessions(parties=2)
    done: list[DecodeResult] = []
    stage = DecodeStage(runner, done.append, lanes=2)
    for chunk in range(3):
        stage.submit("a", chunk)
        stage.submit("b", chunk)
    stage.close()
    for sid in ("a", "b"):
        mine = [(c, t) for s, c, t in runner.calls if s == sid]
        assert [c for c, _ in mine] == [0, 1, 2]
        assert len({t for _, t in mine}) == 1  # one lane per session
    assert {t for _, _, t in runner.calls} == {"decode-0", "decode-1"}
    assert len(done) == 6


def test_a_released_sessions_lane_goes_to_the_next_session():
    runner = RecordingSessions()
    stage = DecodeStage(runner, lambda result: None, lanes=2)
    stage.submit("a", 0)
    stage.submit("b", 0)
    stage.forget("a")
    stage.submit("c", 0)  # a's lane is the free one
    stage.close()
    lanes = {s: t for s, _, t in runner.calls}
    assert lanes["c"] == lanes["a"] != lanes["b"]


def test_both_decode_stages_define_every_member_of_the_contract_with_its_signature():
    from rtvideo.workers.parallel.rank_decode import RankDecodeStage

    members = {name: value for name, value in vars(DecodeStages).items() if not name.startswith("_")}
    assert {"submit", "step_done", "forget", "close", "decodes"} <= set(members)
    for name, template in members.items():
        if isinstance(template, property):  # an attribute: RankDecodeStage's a property, DecodeStage's set at start
            assert isinstance(getattr(RankDecodeStage, name), property), name
            continue
        for stage in (DecodeStage, RankDecodeStage):
            assert name in vars(stage), (stage.__name__, name)
            assert inspect.signature(getattr(stage, name)) == inspect.signature(template), (stage.__name__, name)
    stage = DecodeStage(RecordingSessions(), lambda result: None)
    stage.step_done(True)  # gathers nothing: a no-op
    stage.submit("a", 0)
    stage.close()
    assert list(stage.decodes) == [0]  # the chunk came back without frames (the stand-in's)
