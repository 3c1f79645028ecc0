from __future__ import annotations

import pytest

from rtvideo.engine.config import EngineConfig, PipelineSpec


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_sessions", 0),
        ("max_batch_rows", 0),
        ("startup_timeout_s", 0),
        ("worker_entry", "nocolon"),
        ("cpu_threads", 0),
    ],
)
def test_bounds_are_checked_at_construction_and_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_the_fork_server_preloads_what_the_worker_imports():
    """The stub's workers need the entry point (and torch through it); a model's
    need the causal Wan pipeline too, whose diffusers import is most of a start."""
    assert EngineConfig().worker_modules == ("rtvideo.workers.main",)
    model = EngineConfig(pipeline=PipelineSpec("tiny"), worker_entry="tests.fake:run")
    assert model.worker_modules == ("tests.fake", "rtvideo.workers.pipelines.causal_wan")
    ranks = EngineConfig(pipeline=PipelineSpec("tiny"), pp=2)  # the later ranks are forks of rank 0: their module too
    assert ranks.worker_modules[1:] == ("rtvideo.workers.pipelines.causal_wan", "rtvideo.workers.parallel.group")
