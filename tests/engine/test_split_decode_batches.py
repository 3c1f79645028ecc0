"""Split decodes of several sessions as one batch, over real sockets on loopback:
rank 0's decode stage (``rtvideo.workers.parallel.rank_decode.RankDecodeStage`` with
``split``, the tiny model's real decoder, its front lane held by
``rtvideo.workers.decode_gather.RoundGather``) and a follower's ``DecodeServer``.

A round of the sessions' chunks goes through the front and the back as one
batch once it has come, the micro-steps between its chunks counted as the
executor reports them; a session that does not come holds the round one
micro-step less than a chunk of the first session took; an idle executor
sends what waits. Every chunk's frames are bit for bit its session's decode
alone, in order. A batch whose front raises is sent again chunk by chunk (the
follower drops what it had, so nothing is answered twice); on the follower a
cancelled session's chunk is answered cancelled while the others' keep their
frames, and a session it does not hold fails every chunk of the batch with
an error naming it, and the next request is served."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from rtvideo.engine.messages import DecodeCancel, DecodeFronts, DecodeFrontsEnd, DecodeWhole, StartSession
from rtvideo.engine.plan import MicroStep
from rtvideo.workers.parallel.decode_server import DecodeServer
from rtvideo.workers.parallel.link import Message
from rtvideo.workers.parallel.rank_decode import RankDecodeStage
from rtvideo.workers.parallel.sockets import CANCEL, DECODE, DECODED
from rtvideo.workers.pipelines.causal_wan import build
from tests.engine.test_rank_sockets import joined
from tests.model.test_batched_decode_stage import SEEDS, _committed_runner
from tests.model.test_causal_wan import open_session, release, run_chunk

SESSIONS = ("da", "db", "dc")
SPLIT = 7  # decoder stages on rank 0
CHUNKS = 3


@pytest.fixture(scope="module")
def pipelines():
    """Rank 0's pipeline and the follower's (each holds its own copy of a session)."""
    return [build("tiny", device="cpu", max_batch_rows=4, warm_up_chunks=0) for _ in range(2)]


@pytest.fixture(scope="module")
def alone(pipelines):
    """Each session's first chunks, run and decoded alone."""
    frames = {}
    for sid in SESSIONS:
        state = open_session(pipelines[0], sid + "-alone", seed=SEEDS[sid], prompt=sid, num_inference_steps=1)
        frames[sid] = [run_chunk(pipelines[0], state)[0].payload for _ in range(CHUNKS)]
        release(pipelines[0], state)
    return frames


def _start(sid: str) -> StartSession:
    return StartSession(session_id=sid, prompt=sid, seed=SEEDS[sid], num_inference_steps=1)


class Results:
    """The stage's ``DecodeResult`` s as they come (on its threads)."""

    def __init__(self) -> None:
        self.got: list = []
        self._changed = threading.Condition()

    def __call__(self, result) -> None:
        with self._changed:
            self.got.append(result)
            self._changed.notify_all()

    def wait_for(self, count: int) -> list:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.got) >= count, timeout=60), f"{len(self.got)} of {count}"
            return list(self.got)


@pytest.fixture
def split_stage(pipelines, monkeypatch):
    """Rank 0's split decode stage over committed chunks of the three sessions,
    a follower's decode server holding its copies of them, and the batches each
    side ran (the sessions of every ``decode_fronts`` and ``back_rows``)."""
    ranks = joined(2)
    states = {sid: pipelines[1].open(_start(sid), pipelines[1].describe(_start(sid)), None) for sid in SESSIONS}
    server = DecodeServer(pipelines[1], states, ranks[1])
    runner = _committed_runner(pipelines[0], list(SESSIONS), chunks=CHUNKS)
    batches = {"front": [], "back": []}
    real_fronts, real_back = pipelines[0].decode_fronts, pipelines[1].back_rows

    def decode_fronts(sessions, cleans, split):
        batches["front"].append([session.session_id for session in sessions])
        return real_fronts(sessions, cleans, split)

    def back_rows(sessions):
        batches["back"].append([sid for sid, state in states.items() if any(state is s for s in sessions)])
        return real_back(sessions)

    monkeypatch.setattr(pipelines[0], "decode_fronts", decode_fronts)
    monkeypatch.setattr(pipelines[1], "back_rows", back_rows)
    results = Results()
    group = SimpleNamespace(sockets=ranks[0], world=2, closing=False, on_death=lambda why: results(why))
    stage = RankDecodeStage(runner.sessions, results, group, split=SPLIT)
    yield SimpleNamespace(stage=stage, results=results, batches=batches, runner=runner)
    stage.close()
    server.close()
    for rank in ranks:
        rank.close()
    runner.execute(MicroStep(number=99, release=list(SESSIONS)))
    for state in states.values():
        pipelines[1].release(state)


def _steps(stage, count: int, idle: bool = False) -> None:
    for _ in range(count):
        stage.step_done(idle)


def _check_frames(results: list, alone) -> None:
    by_session: dict[str, list] = {}
    for result in results:
        assert not isinstance(result, str), result  # on_death: a rank was lost
        assert result.error is None and not result.cancelled, result
        by_session.setdefault(result.session_id, []).append(result)
    for sid, mine in by_session.items():
        assert [r.chunk_index for r in mine] == list(range(len(mine)))  # in order
        assert [r.chunk.payload for r in mine] == alone[sid][: len(mine)], f"{sid}: not its own decode's frames"


def test_a_round_of_split_chunks_goes_through_the_front_and_the_back_as_one_batch(split_stage, alone):
    stage, results, batches = split_stage.stage, split_stage.results, split_stage.batches
    for sid in SESSIONS:  # the first round commits together: it goes once the last came
        stage.submit(sid, 0)
    results.wait_for(3)
    _steps(stage, 20)  # then as a two-rank ring makes them: 3 and 7 micro-steps apart, each session every 20
    stage.submit("da", 1)
    _steps(stage, 3)
    stage.submit("db", 1)
    _steps(stage, 7)
    stage.submit("dc", 1)
    results.wait_for(6)
    _steps(stage, 10)  # da's next chunk 20 micro-steps after its last
    stage.submit("da", 2)  # dc does not come this round: da and db go after 19 micro-steps, together
    _steps(stage, 10)
    stage.submit("db", 2)
    _steps(stage, 9)
    results.wait_for(8)
    stage.submit("dc", 2)
    _steps(stage, 1, idle=True)  # nothing left to run: dc goes as it stands, alone
    _check_frames(results.wait_for(9), alone)
    assert batches["front"] == [list(SESSIONS), list(SESSIONS), ["da", "db"]]
    assert batches["back"] == batches["front"]
    assert stage.decodes == [0, 9]  # every chunk finished on the follower


def test_a_batch_whose_front_fails_goes_again_chunk_by_chunk(split_stage, alone, pipelines, monkeypatch):
    stage, results, batches = split_stage.stage, split_stage.results, split_stage.batches
    real = pipelines[0].decode_fronts

    def fails_after_one_part(sessions, cleans, split):
        parts = real(sessions, cleans, split)
        yield next(parts)
        raise RuntimeError("injected")

    monkeypatch.setattr(pipelines[0], "decode_fronts", fails_after_one_part)
    for sid in SESSIONS:
        stage.submit(sid, 0)
    got = results.wait_for(3)
    _check_frames(got, alone)  # each chunk's frames, from a front alone and caches the failed batch left as they were
    assert batches["back"] == [list(SESSIONS)]  # the follower began the batch, then dropped it unanswered
    monkeypatch.setattr(pipelines[0], "decode_fronts", real)
    for sid in SESSIONS:  # and the next round batches again, from the right caches
        stage.submit(sid, 1)
    _check_frames(results.wait_for(6), alone)
    assert len(results.got) == 6 and len(batches["back"]) == 2


def _send_batch(rank0, pipeline, fronts, rows, latents, **end) -> None:
    """Rank 0's front lane for one batch: its parts, then its last frame."""
    keys = tuple(rows)
    for part, (meta, activation) in enumerate(pipeline.decode_fronts(fronts, latents, SPLIT)):
        header = DecodeFronts(rows=keys, split=SPLIT, part=part, meta=meta)
        rank0.post(1, DECODE, rows[0][1], Message(header, [activation]))
    last = DecodeFrontsEnd(rows=keys, split=SPLIT, front_ms=1.0, **end)
    rank0.post(1, DECODE, rows[0][1], Message(last, []))


def test_on_the_follower_a_cancelled_session_leaves_a_batch_and_a_missing_one_fails_alone(pipelines):
    ranks = joined(2)
    states = {sid: pipelines[1].open(_start(sid), pipelines[1].describe(_start(sid)), None) for sid in SESSIONS}
    server = DecodeServer(pipelines[1], states, ranks[1])
    here = {sid: pipelines[0].open(_start(sid), pipelines[0].describe(_start(sid)), None) for sid in SESSIONS}
    whole = {sid: pipelines[0].open(_start(sid), pipelines[0].describe(_start(sid)), None) for sid in SESSIONS}
    generator = torch.Generator().manual_seed(4)
    rank0 = ranks[0]

    def answers(count: int) -> dict:
        replies = [rank0.take(1, (DECODED,), None, 60.0, "decoded chunk")[1] for _ in range(count)]
        return {reply.header.session_id: reply for reply in replies}

    try:
        latents = [torch.randn(here["da"].latent_shape, generator=generator) for _ in SESSIONS]
        expected = {
            sid: pipelines[0].decode_latent(whole[sid], lat) for sid, lat in zip(SESSIONS, latents, strict=True)
        }
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="db"), []))
        _send_batch(rank0, pipelines[0], [here[sid] for sid in SESSIONS], [(sid, 0) for sid in SESSIONS], latents)
        got = answers(3)
        assert got["db"].header.cancelled and got["db"].header.frames is None
        for sid in ("da", "dc"):
            assert got[sid].header.error is None and not got[sid].header.cancelled
            assert got[sid].tensors[0].numpy().tobytes() == expected[sid].payload

        rows = [("da", 1), ("nobody", 1)]
        latents = [torch.randn(here["da"].latent_shape, generator=generator) for _ in rows]
        _send_batch(rank0, pipelines[0], [here["da"], here["dc"]], rows, latents)
        got = answers(2)
        # The batch fails (a row's session is not open here); each row then goes alone: only that one fails.
        assert "session nobody is not open on rank 1" in got["nobody"].header.error
        assert got["nobody"].header.frames is None
        assert got["da"].header.error is None
        assert got["da"].tensors[0].numpy().tobytes() == pipelines[0].decode_latent(whole["da"], latents[0]).payload

        other = StartSession(session_id="other", prompt="other")  # the next request is served
        states["other"] = pipelines[1].open(other, pipelines[1].describe(other), None)
        whole["other"] = pipelines[0].open(other, pipelines[0].describe(other), None)
        latent = torch.randn(here["dc"].latent_shape, generator=generator)
        rank0.post(1, DECODE, 0, Message(DecodeWhole(session_id="other", chunk_index=0), [latent]))
        reply = answers(1)["other"]
        assert reply.header.error is None
        assert reply.tensors[0].numpy().tobytes() == pipelines[0].decode_latent(whole["other"], latent).payload
    finally:
        server.close()
        for rank in ranks:
            rank.close()
        for pipeline, held in ((pipelines[1], states), (pipelines[0], here), (pipelines[0], whole)):
            for state in held.values():
                pipeline.release(state)
