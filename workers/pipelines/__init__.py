"""Pipelines a worker can build, by name. Imports are lazy: a worker that
serves the stub never imports torch."""

from __future__ import annotations

import importlib

from engine.config import PipelineSpec
from workers.pipelines.base import ChunkPipeline

REGISTRY: dict[str, str] = {
    "stub": "workers.pipelines.stub:StubPipeline",
    "tiny": "workers.pipelines.causal_wan:build",
    "causal_wan": "workers.pipelines.causal_wan:build",
}


def build_pipeline(spec: PipelineSpec) -> ChunkPipeline:
    """Construct the pipeline ``spec`` names; ``ValueError`` for an unknown name."""
    target = REGISTRY.get(spec.name)
    if target is None:
        raise ValueError(f"unknown pipeline {spec.name!r}; known: {', '.join(sorted(REGISTRY))}")
    module, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**spec.options)
