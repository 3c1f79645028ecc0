"""A worker that says its engine is dead (``EngineDead``: a pipeline rank died,
a link timed out) is on its way out, and a restart follows its exit where the
budget allows one: until then the client answers as it does during the restart
(``EngineRestartingError``), so queued jobs wait it out and liveness does not
say the replica is dead; only with the budget spent is it dead at once."""

from __future__ import annotations

from rtvideo.engine.client.engine_client import EngineClient, WorkerState
from rtvideo.engine.client.errors import EngineDeadError, EngineRestartingError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import EngineDead

REASON = "engine dead: engine loop failed: LinkTimeout: rank 0: ring message from rank 1 not done within 5 s"


def dying_client(max_worker_restarts: int) -> EngineClient:
    """A client whose worker is up, as its engine's last word arrives."""
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {}), max_worker_restarts=max_worker_restarts))
    client.state = WorkerState.UP
    assert client.unavailable() is None
    client._route(EngineDead(reason=REASON.removeprefix("engine dead: ")))
    return client


def test_a_worker_whose_engine_died_is_restarting_while_the_budget_allows_one():
    refused = dying_client(max_worker_restarts=3).unavailable()
    assert isinstance(refused, EngineRestartingError), refused
    assert REASON in str(refused) and refused.retry_after_s >= 1.0


def test_with_the_budget_spent_it_is_dead_at_once():
    refused = dying_client(max_worker_restarts=0).unavailable()
    assert type(refused) is EngineDeadError and str(refused) == REASON


def test_once_the_server_drains_a_worker_lost_is_not_replaced():
    client = EngineClient(EngineConfig(pipeline=PipelineSpec("stub", {}), max_worker_restarts=3))
    client.state = WorkerState.UP
    client.no_more_restarts("the server is shutting down")
    client._route(EngineDead(reason="pipeline rank 1 lost"))
    refused = client.unavailable()
    assert type(refused) is EngineDeadError and "pipeline rank 1 lost" in str(refused)
