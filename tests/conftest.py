"""Fixtures shared by every tier."""

from __future__ import annotations

import importlib.util
import os

import pytest

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Test processes side by side (``make test``: pytest-xdist): each one's torch,
    # and the servers and workers it starts, get their share of the cores, so
    # no OpenMP pool spins on a core another process needs. Set before anything
    # imports torch (the fork servers inherit it too).
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec

ENGINE_KEYS = {
    "max_sessions",
    "group_chunk_steps",
    "max_batch_rows",
    "overlap_decode",
    "max_worker_restarts",
    "session_memory_bytes",
    "wedged_after_s",
    "max_pixels",
    "max_realtime_load",
    "input_timeout_s",
}


@pytest.fixture(scope="session", autouse=True)
def fork_server_with_the_models_modules():
    """The fork server the in-process engines' workers come from, started once a
    test process with the model's modules preloaded (``EngineConfig.worker_modules``
    of a model: diffusers and the causal Wan pipeline), as the server preloads
    them (``worker_context``: the fork server's own setup first). Each engine's own
    preload list takes effect only where it starts the server, so one of the
    stub model started first would leave every later model worker of the
    process importing diffusers itself (about 3 s a start on two cores, in
    dozens of engine tests); a server preloaded for the model serves the stub
    as well."""
    import multiprocessing.forkserver

    from rtvideo.engine.client.spawned_worker import worker_context

    worker_context(EngineConfig(pipeline=PipelineSpec("tiny", {}), pp=2))  # its preload, pipeline ranks' modules too
    multiprocessing.forkserver.ensure_running()
    yield


PINNED_LIMITS = {"max_pixels": 1 << 22, "max_realtime_load": None}
"""What tests run with unless they say otherwise: the frame bound and admission by
chunk cost are measured at start from this machine's speed (``rtvideo.workers.calibrate``),
which a loaded test machine would make vary from run to run; the tests of those
limits set them themselves."""


@pytest.fixture
async def make_engine():
    """Start real worker processes over the stub pipeline; shut them all down after.

    Keyword arguments named in ``ENGINE_KEYS`` go to ``EngineConfig`` (the
    machine-measured limits pinned unless given: ``PINNED_LIMITS``), the rest
    are the stub pipeline's options.
    """
    clients: list[EngineClient] = []

    async def factory(**options) -> EngineClient:
        engine = {key: options.pop(key) for key in list(options) if key in ENGINE_KEYS}
        engine = {**PINNED_LIMITS, **engine}
        config = EngineConfig(pipeline=PipelineSpec("stub", options), startup_timeout_s=60, **engine)
        client = EngineClient(config)
        await client.start()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.shutdown()


@pytest.fixture(scope="session")
def demo_server():
    """A server on the shipped demo model (``rtvideo serve``'s default, what a
    newcomer sees), started once and shared by the tests, in every tier, that
    need no flags of their own: a model's start is mostly its imports (about
    10 s here). Each test runs and ends sessions of its own on it."""
    from tests.e2e.conftest import start_server, stop_server

    server = start_server(model="demo")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def tiny_server():
    """A server on the tiny preset (random weights), shared like ``demo_server``:
    forwards carry up to 3 rows, frames at most 640 wide."""
    from tests.e2e.conftest import start_server, stop_server

    server = start_server("--max-batch-rows", "3", "--max-width", "640", model="tiny")
    yield server
    stop_server(server)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: pytest without it (the GPU check) runs on
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one test process more than the cores this
    process may run on. Much of a test's time is a server or worker starting or
    answering, in processes of their own, while the test waits: on 2 cores,
    with one test process a core the cores were idle 12% of a full run, with
    one more 2% (docs/log/measurements.md, 2026-12-07)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only where CUDA is available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = "needs CUDA"
    available = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        available = torch.cuda.is_available()
        reason = "needs CUDA; torch sees no GPU here"
    if not available:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
