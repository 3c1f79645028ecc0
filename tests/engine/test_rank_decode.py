"""A follower's decode thread (``rtvideo.workers.parallel.decode_server.DecodeServer``):
the tiny model's real streaming decoder, behind real sockets on loopback, as
rank 0 reaches it (``DECODE`` frames out, ``DECODED`` frames back).

The frames it sends back are bit for bit those of decoding the same latents
in process, chunk after chunk (its copy of the session carries the decoder's
causal cache from one chunk to the next); a cancel that came first, or one
that arrives while a chunk decodes, ends that chunk's decode as cancelled
and the thread serves the next request; a session it does not hold is an
error naming it, not a hang. Whole chunks that wait for the thread together
decode in batches (``decode_latents``, at most ``decode_batch_rows``, a
session's chunks in order), each chunk's frames bit for bit its own decode's;
a cancelled session is left out of its batch and a batch that raises falls
back to one decode each.

A split decode (``pp_decode`` ``split``): rank 0's part of the decoder made
here, each latent frame's activation sent as a part and the chunk ended by a
last frame, as rank 0's front lane sends them: the follower's frames are bit
for bit the whole decoder's; however a chunk ends (a part it cannot decode, a
cancel, rank 0 abandoning its front), the follower answers it exactly once,
and serves the next, always after the chunk's last frame (rank 0's front is
done with the session then)."""

from __future__ import annotations

import select
import threading

import numpy as np
import pytest
import torch

from rtvideo.engine.config import PipelineSpec
from rtvideo.engine.messages import DecodeCancel, DecodeFront, DecodeFrontEnd, DecodeWhole, StartSession
from rtvideo.workers.parallel.decode_server import DecodeServer
from rtvideo.workers.parallel.link import LinkTimeout, Message
from rtvideo.workers.parallel.sockets import CANCEL, DECODE, DECODED, DECODES
from rtvideo.workers.pipelines import build_pipeline
from rtvideo.workers.pipelines.capabilities import Capabilities
from tests.engine.test_rank_sockets import joined


@pytest.fixture(scope="module")
def pipelines():
    """Rank 0's pipeline and the follower's (each holds its own copy of a session)."""
    return [build_pipeline(PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 0}), 1) for _ in range(2)]


@pytest.fixture
def served(pipelines):
    ranks = joined(2)
    states: dict = {}
    server = DecodeServer(pipelines[1], states, ranks[1])
    yield ranks[0], states, ranks[1]
    server.close()
    for rank in ranks:
        rank.close()


def open_on(pipeline, sid: str, size: int = 32):
    start = StartSession(session_id=sid, prompt="p", width=size, height=size)
    return pipeline.open(start, pipeline.describe(start), pipeline.encode_prompt("p"))


def whole_chunk(sid: str, chunk: int, latent: torch.Tensor) -> Message:
    """A ``DECODE`` frame asking for a whole chunk's decode."""
    return Message(DecodeWhole(session_id=sid, chunk_index=chunk), [latent])


def ask(rank0, sid: str, chunk: int, latent: torch.Tensor) -> Message:
    rank0.post(1, DECODE, chunk, whole_chunk(sid, chunk, latent))
    _, reply = rank0.take(1, (DECODED,), None, 60.0, "decoded chunk")
    return reply


def test_the_follower_decodes_chunk_after_chunk_as_rank_0_would(pipelines, served):
    rank0, states, _ = served
    here, there = open_on(pipelines[0], "s"), open_on(pipelines[1], "s")
    states["s"] = there
    generator = torch.Generator().manual_seed(5)
    try:
        for chunk in range(3):
            latent = torch.randn(here.latent_shape, generator=generator)
            expected = pipelines[0].decode_latent(here, latent)
            reply = ask(rank0, "s", chunk, latent)
            assert reply.header.session_id == "s" and reply.header.chunk_index == chunk
            assert reply.header.error is None and not reply.header.cancelled
            assert reply.header.frames == (expected.num_frames, expected.width, expected.height)
            assert reply.tensors[0].numpy().tobytes() == expected.payload, f"chunk {chunk} differs"
            assert np.frombuffer(expected.payload, np.uint8).std() > 0  # real frames, not a blank
    finally:
        pipelines[0].release(here)
        pipelines[1].release(there)


def test_a_cancel_ends_a_decode_and_the_next_request_is_served(pipelines, served):
    rank0, states, follower = served
    small = states["small"] = open_on(pipelines[1], "small")
    big = states["big"] = open_on(pipelines[1], "big", size=64)
    began = threading.Event()

    def cancel_once_begun(module, args) -> None:  # on the decode thread, inside the real decode
        if not began.is_set():
            began.set()
            rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="big"), []))
            select.select([follower._in[0, DECODES].sock], [], [], 10)  # it has reached the follower's socket

    try:
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="small"), []))  # before its request: never begun
        reply = ask(rank0, "small", 0, torch.zeros(small.latent_shape))
        assert reply.header.cancelled and reply.header.frames is None and not reply.tensors

        hook = pipelines[1].decoder.vae.decoder.mid_block.register_forward_pre_hook(cancel_once_begun)
        try:
            reply = ask(rank0, "big", 0, torch.zeros(big.latent_shape))
        finally:
            hook.remove()
        assert began.is_set() and reply.header.session_id == "big"
        assert reply.header.cancelled and reply.header.frames is None  # abandoned part-way

        states["other"] = open_on(pipelines[1], "other")
        reply = ask(rank0, "other", 0, torch.zeros(small.latent_shape))
        assert reply.header.frames is not None and not reply.header.cancelled
    finally:
        for state in states.values():
            pipelines[1].release(state)


def test_whole_chunks_that_wait_together_decode_as_batches_with_their_own_frames(pipelines, served, monkeypatch):
    rank0, states, _ = served
    sessions = ("a", "b", "c")
    here = {sid: open_on(pipelines[0], sid) for sid in sessions}
    states.update({sid: open_on(pipelines[1], sid) for sid in (*sessions, "blocker")})
    generator = torch.Generator().manual_seed(11)
    latents = {
        (sid, chunk): torch.randn(here[sid].latent_shape, generator=generator) for chunk in (0, 1) for sid in sessions
    }
    expected = {key: pipelines[0].decode_latent(here[key[0]], latent).payload for key, latent in latents.items()}
    batches: list[list[str]] = []
    real = pipelines[1].decode_latents

    def decode_latents(sessions_, cleans):
        names = [sid for sid, state in states.items() if any(state is s for s in sessions_)]
        batches.append(sorted(names))
        if names == ["a", "b"] and not broke:
            broke.append(True)
            raise RuntimeError("injected")
        return real(sessions_, cleans)

    broke: list[bool] = [True]  # not yet: the first test round must not break
    monkeypatch.setattr(pipelines[1], "decode_latents", decode_latents)
    entered, gate = threading.Event(), threading.Event()

    def hold_first(module, args) -> None:  # the blocker's decode holds the thread until all is sent
        if not entered.is_set():
            entered.set()
            assert gate.wait(60)

    hook = pipelines[1].decoder.vae.decoder.mid_block.register_forward_pre_hook(hold_first)
    try:
        rank0.post(1, DECODE, 0, whole_chunk("blocker", 0, torch.zeros(here["a"].latent_shape)))
        assert entered.wait(60)
        for chunk in (0, 1):
            for sid in sessions:
                rank0.post(1, DECODE, chunk, whole_chunk(sid, chunk, latents[sid, chunk]))
        gate.set()
        replies = [rank0.take(1, (DECODED,), None, 60.0, "decoded chunk")[1] for _ in range(7)]
    finally:
        hook.remove()
    assert [r.header.session_id for r in replies][0] == "blocker"
    assert batches == [["a", "b", "c"], ["a", "b", "c"]]  # chunk 0 of the three, then chunk 1: one batch each
    got = {(r.header.session_id, r.header.chunk_index): r for r in replies[1:]}
    for key in latents:
        assert got[key].header.error is None and not got[key].header.cancelled
        assert got[key].tensors[0].numpy().tobytes() == expected[key], f"{key} differs from its own decode"
    order = [(r.header.session_id, r.header.chunk_index) for r in replies[1:]]
    assert all(order.index((sid, 0)) < order.index((sid, 1)) for sid in sessions)

    # A cancelled session is left out of its batch; a batch that raises decodes each alone.
    broke.clear()
    rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="c"), []))
    entered.clear()
    gate.clear()
    hook = pipelines[1].decoder.vae.decoder.mid_block.register_forward_pre_hook(hold_first)
    try:
        rank0.post(1, DECODE, 1, whole_chunk("blocker", 1, torch.zeros(here["a"].latent_shape)))
        assert entered.wait(60)
        more = {(sid, 2): torch.randn(here[sid].latent_shape, generator=generator) for sid in sessions}
        for (sid, chunk), latent in more.items():
            rank0.post(1, DECODE, chunk, whole_chunk(sid, chunk, latent))
        gate.set()
        replies = [rank0.take(1, (DECODED,), None, 60.0, "decoded chunk")[1] for _ in range(4)]
    finally:
        hook.remove()
    got = {r.header.session_id: r for r in replies[1:]}
    assert batches[2:] == [["a", "b"]] and broke == [True]  # c was not in it; it raised once
    assert got["c"].header.cancelled and got["c"].header.frames is None
    for sid in ("a", "b"):
        assert got[sid].header.error is None
        assert got[sid].tensors[0].numpy().tobytes() == pipelines[0].decode_latent(here[sid], more[sid, 2]).payload
    for state in [*here.values()]:
        pipelines[0].release(state)
    for state in states.values():
        pipelines[1].release(state)


def test_a_session_the_rank_does_not_hold_is_an_error_naming_it(served):
    rank0, _, _ = served
    reply = ask(rank0, "nobody", 0, torch.zeros(1, 16, 1, 4, 4))
    assert "session nobody is not open on rank 1" in reply.header.error
    assert reply.header.frames is None


SPLIT = 7  # decoder stages on rank 0


def send_split(rank0, pipeline, here, sid: str, chunk: int, latent: torch.Tensor, last: bool = True) -> None:
    """Rank 0's front lane: the chunk's front stages here, each part posted, then the chunk's last frame."""
    key = {"session_id": sid, "chunk_index": chunk, "split": SPLIT}
    for part, (meta, activation) in enumerate(pipeline.decode_front(here, latent, SPLIT)):
        rank0.post(1, DECODE, chunk, Message(DecodeFront(**key, part=part, meta=meta), [activation]))
    if last:
        send_last(rank0, sid, chunk)


def send_last(rank0, sid: str, chunk: int, **end) -> None:
    end = DecodeFrontEnd(session_id=sid, chunk_index=chunk, split=SPLIT, front_ms=1.0, **end)
    rank0.post(1, DECODE, chunk, Message(end, []))


def answer(rank0, timeout_s: float = 60.0) -> Message:
    _, reply = rank0.take(1, (DECODED,), None, timeout_s, "decoded chunk")
    return reply


def test_a_split_decode_gives_the_whole_decoders_frames_chunk_after_chunk(pipelines, served):
    rank0, states, _ = served
    front, whole = open_on(pipelines[0], "s"), open_on(pipelines[0], "whole")
    states["s"] = open_on(pipelines[1], "s")
    generator = torch.Generator().manual_seed(6)
    try:
        for chunk in range(3):
            latent = torch.randn(front.latent_shape, generator=generator)
            expected = pipelines[0].decode_latent(whole, latent)
            send_split(rank0, pipelines[0], front, "s", chunk, latent)
            reply = answer(rank0)
            assert reply.header.session_id == "s" and reply.header.chunk_index == chunk
            assert reply.header.error is None and not reply.header.cancelled
            assert reply.header.frames == (expected.num_frames, expected.width, expected.height)
            assert reply.tensors[0].numpy().tobytes() == expected.payload, f"chunk {chunk} differs"
            assert reply.header.ms >= 1.0  # the front's time and the back's
    finally:
        pipelines[0].release(front)
        pipelines[0].release(whole)
        pipelines[1].release(states.pop("s"))


def test_however_a_split_chunk_ends_the_follower_answers_it_once_and_serves_the_next(pipelines, served):
    rank0, states, _ = served
    fronts = {sid: open_on(pipelines[0], sid) for sid in ("f", "a", "n")}  # rank 0's copies
    front = fronts["f"]
    latent = torch.zeros(front.latent_shape)
    try:
        send_split(rank0, pipelines[0], front, "nobody", 0, latent, last=False)  # every part fails
        with pytest.raises(LinkTimeout):  # no answer before the chunk's last frame: rank 0's front still runs
            answer(rank0, timeout_s=0.3)
        send_last(rank0, "nobody", 0)  # then one
        reply = answer(rank0)
        assert "session nobody is not open on rank 1" in reply.header.error and reply.header.chunk_index == 0

        states["c"] = open_on(pipelines[1], "c")
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="c"), []))
        send_split(rank0, pipelines[0], front, "c", 0, latent)  # cancelled at its first part: one answer
        reply = answer(rank0)
        assert reply.header.session_id == "c" and reply.header.cancelled and reply.header.frames is None

        states["a"] = open_on(pipelines[1], "a")  # rank 0 abandoned its front after one part
        meta, activation = next(pipelines[0].decode_front(fronts["a"], latent, SPLIT))
        header = DecodeFront(session_id="a", chunk_index=0, split=SPLIT, part=0, meta=meta)
        rank0.post(1, DECODE, 0, Message(header, [activation]))
        send_last(rank0, "a", 0, cancelled=True)
        reply = answer(rank0)
        assert reply.header.session_id == "a" and reply.header.cancelled and reply.header.frames is None

        states["n"] = open_on(pipelines[1], "n")  # and the next chunk of another session decodes
        send_split(rank0, pipelines[0], fronts["n"], "n", 0, latent)
        reply = answer(rank0)
        assert reply.header.session_id == "n" and reply.header.frames is not None and reply.header.error is None
        with pytest.raises(LinkTimeout):  # nothing more: each chunk was answered once
            answer(rank0, timeout_s=0.3)
    finally:
        for state in states.values():
            pipelines[1].release(state)
        for state in fronts.values():
            pipelines[0].release(state)


@pytest.mark.parametrize(
    ("pp_decode", "pp", "overlap", "stages", "stream", "expected"),
    [
        ("auto", 2, None, 13, False, "spread"),  # on a CPU: every session whole on one rank
        ("auto", 2, None, 13, True, "spread"),  # with stream batch too
        ("split", 2, None, 13, False, "split"),
        ("auto", 2, None, 0, True, "spread"),  # the demo model's codec cannot be split
        ("split", 2, None, 0, False, "spread"),
        ("spread", 2, None, 13, True, "spread"),
        ("first", 2, None, 13, False, "first"),
        ("split", 1, None, 13, False, "first"),  # one rank
        ("split", 2, False, 13, False, "first"),  # rank 0 decodes inside its micro-steps
    ],
)
def test_where_decodes_run_follows_the_option_and_what_the_pipeline_can(
    pp_decode, pp, overlap, stages, stream, expected
):
    from rtvideo.engine.config import EngineConfig
    from rtvideo.workers.parallel.group import decode_placement

    class Pipeline:  # what decode_placement reads of a pipeline
        capabilities = Capabilities(rank_decode=True, split_decode=True)
        decode_stages = stages

    config = EngineConfig(
        pipeline=PipelineSpec("tiny", {}), pp=pp, pp_decode=pp_decode, overlap_decode=overlap, stream_batch=stream
    )
    assert decode_placement(config, Pipeline()) == expected


@pytest.mark.parametrize(
    ("split", "steps", "expected"),
    [
        (7, ["a", "b", "c"], ["1", "1", "1"]),  # pp_decode split: every session, on a follower
        (0, ["a", "b", "c", "-b", "d"], ["1", "0", "1", "0"]),  # spread: whole, the fewest, a follower on a tie
    ],
)
def test_where_each_session_decodes(pipelines, split, steps, expected):
    from types import SimpleNamespace

    from rtvideo.workers.parallel.rank_decode import RankDecodeStage
    from rtvideo.workers.runner import ModelRunner

    ranks = joined(2)
    group = SimpleNamespace(sockets=ranks[0], world=2, closing=False, on_death=lambda why: None)
    stage = RankDecodeStage(ModelRunner(pipelines[0]).sessions, lambda result: None, group, split=split)
    placed = []
    try:
        for step in steps:
            if step.startswith("-"):  # released
                stage.forget(step[1:])
                continue
            rank = stage._rank_of[step] = stage._place(step)  # as submit places a session's first decode
            placed.append(str(rank))
    finally:
        stage.close()
        for rank in ranks:
            rank.close()
    assert placed == expected


def test_a_cancel_that_outlives_its_session_does_not_cancel_the_next_of_that_id(pipelines, served):
    """The stop's cancel can reach the follower after the session's last chunk
    came back and it was released (the plans travel on another connection):
    rank 0 then says the session ended, after the cancel on the same
    connection, and a new session of the same id decodes; its own stop still
    cancels it."""
    rank0, states, _ = served
    states["s"] = open_on(pipelines[1], "s")
    try:
        assert ask(rank0, "s", 0, torch.zeros(states["s"].latent_shape)).header.frames is not None
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="s"), []))  # late: s has nothing out any more
        pipelines[1].release(states.pop("s"))  # released
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="s", ended=True), []))  # RankDecodeStage.forget
        states["s"] = open_on(pipelines[1], "s")  # a new session, the same id
        reply = ask(rank0, "s", 0, torch.zeros(states["s"].latent_shape))
        assert reply.header.frames is not None and not reply.header.cancelled
        rank0.post(1, CANCEL, 0, Message(DecodeCancel(session_id="s"), []))  # and its own stop
        assert ask(rank0, "s", 1, torch.zeros(states["s"].latent_shape)).header.cancelled
    finally:
        for state in states.values():
            pipelines[1].release(state)
