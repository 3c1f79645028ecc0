"""The stub pipeline, whose construction fails as often as a test says, for the
engine tests of failed restarts (a worker builds it by import path:
``PipelineSpec("tests.engine.flaky_start:build", {"fail_starts": PATH, ...})``)."""

from __future__ import annotations

from pathlib import Path

from rtvideo.workers.pipelines.stub import StubPipeline


def build(*, fail_starts: str, **options) -> StubPipeline:
    """The stub pipeline of ``options``; but while the file at ``fail_starts`` holds
    a count above 0, the count is lowered by one and construction raises (the
    worker says ``WorkerStartupFailed`` and exits). No file: no failure."""
    path = Path(fail_starts)
    left = int(path.read_text()) if path.exists() else 0
    if left > 0:
        path.write_text(str(left - 1))
        raise RuntimeError(f"injected startup failure ({left - 1} more to come)")
    return StubPipeline(**options)
