"""Pipelines a worker can build, by name. Imports are lazy: a worker that
serves the stub never imports torch."""

from __future__ import annotations

import importlib
import re

from rtvideo.engine.config import PipelineSpec
from rtvideo.engine.messages import StartSession
from rtvideo.engine.validation import check_geometry
from rtvideo.workers.pipelines.base import ChunkPipeline
from rtvideo.workers.pipelines.capabilities import check_pipeline

REGISTRY: dict[str, str] = {
    "stub": "rtvideo.workers.pipelines.stub:StubPipeline",
    "tiny": "rtvideo.workers.pipelines.causal_wan:build",
    "demo": "rtvideo.workers.pipelines.causal_wan:build_demo",
    "causal_wan": "rtvideo.workers.pipelines.causal_wan:build",
}


def build_pipeline(spec: PipelineSpec, max_batch_rows: int) -> ChunkPipeline:
    """Construct the pipeline ``spec`` names, for forwards of up to ``max_batch_rows``
    session rows (the engine's knob; a pipeline option of that name is refused so
    there is one). ``spec.name`` is a name of ``REGISTRY`` or the import path of a
    factory of one's own (``package.module:function``, importable in the worker
    processes). ``ValueError`` names an unknown pipeline or a refused option.
    Either way the pipeline built is checked against the contract and its
    declared capabilities (``rtvideo.workers.pipelines.capabilities.check_pipeline``):
    ``PipelineContractError`` names the pipeline and what it lacks. An option
    the pipeline does not take is a ``ValueError`` naming it, and so is one that
    leaves it no valid default session (``check_default_session``)."""
    target = REGISTRY.get(spec.name) or (spec.name if ":" in spec.name else None)
    if target is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"unknown pipeline {spec.name!r}; known: {known}, or an import path module:function")
    if "max_batch_rows" in spec.options:
        raise ValueError(
            "pipeline option max_batch_rows: set it as the server's --max-batch-rows (RTVIDEO_MAX_BATCH_ROWS)"
        )
    module, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    try:
        pipeline = factory(**spec.options, max_batch_rows=max_batch_rows)
    except TypeError as error:
        unknown = _UNEXPECTED_OPTION.search(str(error))
        if unknown is None or unknown.group(1) not in spec.options:
            raise
        option = unknown.group(1)
        how = f"--{option} or " if option in SERVER_FLAG_OPTIONS else ""
        raise ValueError(
            f"pipeline {spec.name!r} takes no option {option!r} (set by {how}--pipeline-options)"
        ) from None
    check_default_session(check_pipeline(pipeline))
    return pipeline


DEFAULT_START = StartSession(session_id="defaults", prompt="defaults")
"""A start that asks for nothing: its geometry is the model's default session
(``WorkerReady.defaults``)."""


def check_default_session(pipeline: ChunkPipeline) -> None:
    """``ValueError`` naming the field when the session that asks for nothing is
    one the pipeline cannot serve, or one the server cannot (chunks of no frames,
    a rate of 0: options can make it so), so the worker's start is refused in
    one line rather than each session failing."""
    what = f"the default session of pipeline {pipeline.name!r}"
    try:
        defaults = pipeline.describe(DEFAULT_START)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from error
    check_geometry(defaults, what)


_UNEXPECTED_OPTION = re.compile(r"unexpected keyword argument '(\w+)'")
SERVER_FLAG_OPTIONS = ("decoder", "quantize")
"""Pipeline options the server sets from flags of their own (``--decoder``, ``--quantize``)."""


def known_prompts(spec: PipelineSpec) -> tuple[str, ...]:
    """The prompts the model ``spec`` names knows, for clients to suggest
    (``WorkerReady.prompts``): a model directory's ``demo.prompts`` (the ``demo``
    preset's: its shipped directory's); () for the other presets and for
    directories that name none."""
    model_dir = spec.options.get("model_dir")
    if spec.name == "demo":
        from rtvideo.workers.demo import WEIGHTS as model_dir
    if model_dir is None:
        return ()
    from rtvideo.workers.pipelines.presets import demo_prompts

    return demo_prompts(model_dir)
