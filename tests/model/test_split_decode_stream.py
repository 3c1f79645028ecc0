"""A split decode (the decoder over two ranks: ``decode_front``/``decode_fronts``
on one, ``decode_back``, ``frames_of`` and ``back_rows`` on the other) runs
every tensor operation inside the pipeline's decode stream
(``CausalWanDecoding._decode_stream``). On a GPU that stream is the calling
thread's own and never waits for the default stream: an operation outside it
(the copy of a part to the device, the concatenation of a chunk's pixels, the
stacking of the sessions' caches) could reuse memory the stream's kernels
still read, or read pixels they have not made yet.

Checked on the CPU, where the stream is no stream: a dispatch mode records
each operator that runs while the stream is not entered, around the real
methods; the frames are a whole decode's, bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rtvideo.engine.messages import StartSession
from rtvideo.workers.pipelines.causal_wan import CausalWanPipeline, build

SPLIT = 7  # decoder stages in front


class OutsideTheStream(TorchDispatchMode):
    """Records the operators run while the decode stream is not entered."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.outside: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            self.outside.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watched(pipeline: CausalWanPipeline, monkeypatch) -> Iterator[OutsideTheStream]:
    mode = OutsideTheStream()
    real = pipeline._decode_stream

    @contextlib.contextmanager
    def stream(*committed):
        with real(*committed):
            mode.depth += 1
            try:
                yield
            finally:
                mode.depth -= 1

    monkeypatch.setattr(pipeline, "_decode_stream", stream)
    with mode:
        yield mode


@pytest.fixture(scope="module")
def pipeline() -> CausalWanPipeline:
    return build("tiny", device="cpu", max_batch_rows=2, warm_up_chunks=0)


def opened(pipeline: CausalWanPipeline, sid: str):
    start = StartSession(session_id=sid, prompt=sid, seed=3)
    return pipeline.open(start, pipeline.describe(start), None)


def test_a_split_chunk_and_a_split_batch_run_only_on_the_decode_stream(pipeline, monkeypatch):
    generator = torch.Generator().manual_seed(5)
    ids = ("a", "b")
    fronts, backs, whole = ({sid: opened(pipeline, f"{sid}-{copy}") for sid in ids} for copy in ("f", "b", "w"))
    latents = {sid: torch.randn(fronts[sid].latent_shape, generator=generator) for sid in ids}
    expected = {sid: pipeline.decode_latent(whole[sid], latents[sid]).payload for sid in ids}
    batch = {sid: torch.randn(fronts[sid].latent_shape, generator=generator) for sid in ids}
    expected_batch = {sid: pipeline.decode_latent(whole[sid], batch[sid]).payload for sid in ids}

    with watched(pipeline, monkeypatch) as mode:
        single = {}
        for sid in ids:  # each session's first chunk alone
            parts = list(pipeline.decode_front(fronts[sid], latents[sid], SPLIT))
            pixels = [pipeline.decode_back(backs[sid], header, activation, SPLIT) for header, activation in parts]
            single[sid] = pipeline.frames_of(pixels).payload
        # then the next chunk of both as one batch
        parts = list(pipeline.decode_fronts([fronts[sid] for sid in ids], [batch[sid] for sid in ids], SPLIT))
        back = pipeline.back_rows([backs[sid] for sid in ids])
        for header, activation in parts:
            back.decode(header, activation, SPLIT)
        batched = dict(zip(ids, (output.payload for output in back.frames()), strict=True))

    assert len(parts) > 1  # a part per latent frame
    assert mode.outside == []
    assert single == expected and batched == expected_batch
