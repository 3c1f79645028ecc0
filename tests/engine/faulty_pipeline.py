"""Tiny causal Wan pipelines that fail or wait where a test says, for the engine
tests of pipeline ranks (a worker builds one by import path: ``PipelineSpec(
"tests.engine.faulty_pipeline:build", ...)``)."""

from __future__ import annotations

from rtvideo.workers.pipelines.causal_wan import build as build_tiny


def build(*, fail_follow_prompt: str, fail_follow_chunk: int, **options):
    """The ``tiny`` preset, whose later ranks' boundary (``follow_boundary``) raises
    for sessions started with ``fail_follow_prompt`` at chunk ``fail_follow_chunk``."""
    pipeline = build_tiny(**options)
    follow = pipeline.follow_boundary

    def follow_boundary(session, chunk_index: int, prompt_changed: bool) -> None:
        if session.start.prompt == fail_follow_prompt and chunk_index == fail_follow_chunk:
            raise RuntimeError(f"injected boundary failure at chunk {chunk_index}")
        follow(session, chunk_index, prompt_changed)

    pipeline.follow_boundary = follow_boundary
    return pipeline


def build_gated(*, gate, **options):
    """The ``tiny`` preset whose first rank holds the forward of the gate's chunk and
    step (a ``rtvideo.workers.pipelines.stub.StubGate``: its events cross processes) until
    the test releases it, having said it got there: a control message then
    reaches the worker while that chunk is being denoised."""
    pipeline = build_tiny(**options)
    forward = pipeline.forward

    def gated_forward(batch, sessions, blocks=None, hidden=None):
        first_rank = blocks is None or blocks.start == 0
        if first_rank and any((row.chunk_index, row.step) == (gate.chunk, gate.step) for row in batch.rows):
            gate.reached.set()
            if not gate.release.wait(60):
                raise RuntimeError("the test never released the gate")
        return forward(batch, sessions, blocks, hidden)

    pipeline.forward = gated_forward
    return pipeline


def build_bad_later_decode(*, bad_prompt: str, bad_chunk: int, **options):
    """The ``tiny`` preset whose decode on a later rank returns what cannot be a
    chunk (an empty ``ChunkOutput``) for the ``bad_chunk``-th chunk of sessions
    started with ``bad_prompt`` (a batch holding one raises: each decodes alone)."""
    from rtvideo.engine.plan import ChunkOutput

    pipeline = build_tiny(**options)
    decode_latent, decode_latents = pipeline.decode_latent, pipeline.decode_latents
    decoded: dict[str, int] = {}

    def later_and_bad(session) -> bool:
        return pipeline.owned.start > 0 and session.start.prompt == bad_prompt

    def bad_decode_latent(session, clean):
        if later_and_bad(session):
            count = decoded[session.session_id] = decoded.get(session.session_id, 0) + 1
            if count - 1 == bad_chunk:
                return ChunkOutput(0, 0, 0, b"")
        return decode_latent(session, clean)

    def bad_decode_latents(sessions, cleans):
        if any(later_and_bad(session) for session in sessions):
            raise RuntimeError("a batch holding the bad session")
        return decode_latents(sessions, cleans)

    pipeline.decode_latent, pipeline.decode_latents = bad_decode_latent, bad_decode_latents
    return pipeline


def build_hung_later_decode(*, hang_prompt: str, hang_chunk: int, **options):
    """The ``tiny`` preset whose decode on a later rank never ends (an hour's
    sleep) for the ``hang_chunk``-th chunk of sessions started with ``hang_prompt``."""
    import time

    pipeline = build_tiny(**options)
    decode_latent, decode_latents = pipeline.decode_latent, pipeline.decode_latents
    decoded: dict[str, int] = {}

    def later_and_hung(session) -> bool:
        return pipeline.owned.start > 0 and session.start.prompt == hang_prompt

    def hung_decode_latent(session, clean):
        if later_and_hung(session):
            count = decoded[session.session_id] = decoded.get(session.session_id, 0) + 1
            if count - 1 == hang_chunk:
                time.sleep(3600)
        return decode_latent(session, clean)

    def hung_decode_latents(sessions, cleans):
        if any(later_and_hung(session) for session in sessions):
            raise RuntimeError("a batch holding the session whose decode hangs")
        return decode_latents(sessions, cleans)

    pipeline.decode_latent, pipeline.decode_latents = hung_decode_latent, hung_decode_latents
    return pipeline


def build_failing_back(*, bad_prompt: str, **options):
    """The ``tiny`` preset whose split decode's back half, on the rank that
    finishes it, fails for sessions started with ``bad_prompt``: a batch of
    rows holding one fails, and so does that session's chunk alone."""
    pipeline = build_tiny(**options)
    back_rows, decode_back = pipeline.back_rows, pipeline.decode_back

    def bad(sessions) -> bool:
        return pipeline.owned.start > 0 and any(session.start.prompt == bad_prompt for session in sessions)

    class FailingBack:
        def __init__(self, sessions) -> None:
            self.inner, self.sessions = back_rows(sessions), sessions

        def decode(self, header, activation, split):
            if bad(self.sessions):
                raise RuntimeError(f"injected back failure ({len(self.sessions)} rows)")
            return self.inner.decode(header, activation, split)

        def frames(self):
            return self.inner.frames()

    def failing_decode_back(session, header, activation, split):
        if bad([session]):
            raise RuntimeError("injected back failure (alone)")
        return decode_back(session, header, activation, split)

    pipeline.back_rows, pipeline.decode_back = FailingBack, failing_decode_back
    return pipeline
