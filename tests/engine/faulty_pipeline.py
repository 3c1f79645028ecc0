"""A tiny causal Wan pipeline that fails where a test says, for the engine tests
of pipeline ranks (a worker builds it by import path: ``PipelineSpec(
"tests.engine.faulty_pipeline:build", ...)``)."""

from __future__ import annotations

from workers.pipelines.causal_wan import build as build_tiny


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
