"""A follower's decode thread (``workers.parallel.rank_decode.DecodeServer``):
the tiny model's real streaming decoder, behind real sockets on loopback, as
rank 0 reaches it (``DECODE`` frames out, ``DECODED`` frames back).

The frames it sends back are bit for bit those of decoding the same latents
in process, chunk after chunk (its copy of the session carries the decoder's
causal cache from one chunk to the next); a cancel that came first, or one
that arrives while a chunk decodes, ends that chunk's decode as cancelled
and the thread serves the next request; a session it does not hold is an
error naming it, not a hang."""

from __future__ import annotations

import select
import threading

import numpy as np
import pytest
import torch

from engine.config import PipelineSpec
from engine.messages import StartSession
from tests.engine.test_rank_sockets import joined
from workers.parallel.link import Message
from workers.parallel.rank_decode import DecodeServer
from workers.parallel.sockets import CANCEL, DECODE, DECODED, DECODES
from workers.pipelines import build_pipeline


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


def ask(rank0, sid: str, chunk: int, latent: torch.Tensor) -> Message:
    rank0.post(1, DECODE, chunk, Message({"session": sid, "chunk": chunk}, [latent]))
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
            assert reply.header["session"] == "s" and reply.header["chunk"] == chunk
            assert reply.header["error"] is None and not reply.header["cancelled"]
            assert reply.header["frames"] == [expected.num_frames, expected.width, expected.height]
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
            rank0.post(1, CANCEL, 0, Message({"session": "big"}, []))
            select.select([follower._in[0, DECODES].sock], [], [], 10)  # it has reached the follower's socket

    try:
        rank0.post(1, CANCEL, 0, Message({"session": "small"}, []))  # before its request: never begun
        reply = ask(rank0, "small", 0, torch.zeros(small.latent_shape))
        assert reply.header["cancelled"] and reply.header["frames"] is None and not reply.tensors

        hook = pipelines[1].decoder.vae.decoder.mid_block.register_forward_pre_hook(cancel_once_begun)
        try:
            reply = ask(rank0, "big", 0, torch.zeros(big.latent_shape))
        finally:
            hook.remove()
        assert began.is_set() and reply.header["session"] == "big"
        assert reply.header["cancelled"] and reply.header["frames"] is None  # abandoned part-way

        states["other"] = open_on(pipelines[1], "other")
        reply = ask(rank0, "other", 0, torch.zeros(small.latent_shape))
        assert reply.header["frames"] is not None and not reply.header["cancelled"]
    finally:
        for state in states.values():
            pipelines[1].release(state)


def test_a_session_the_rank_does_not_hold_is_an_error_naming_it(served):
    rank0, _, _ = served
    reply = ask(rank0, "nobody", 0, torch.zeros(1, 16, 1, 4, 4))
    assert "session nobody is not open on rank 1" in reply.header["error"]
    assert reply.header["frames"] is None
