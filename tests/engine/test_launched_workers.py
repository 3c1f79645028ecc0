"""A worker group started by torchrun, one process per rank, reaching the API
process over TCP (``EngineConfig.worker_listen``, ``rtvideo.workers.launch``): on this
machine over loopback, two ranks over gloo, against the exact output of one
spawned rank; then a killed rank, and the group torchrun starts next."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
)
from tests.conftest import PINNED_LIMITS
from tests.engine.test_pipeline_parallel import interact_once, payloads, run_sessions, start_engine, start_of
from tests.support import Collected, collect, free_ports, read_until

ROOT = Path(__file__).resolve().parents[2]
SPEC = PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 1})


def free_port_pair() -> int:
    """A port P with P + 1 free too (control and results)."""
    return free_ports(2)


def torchrun(port: int, ranks: int, restarts: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(restarts),
        "-m",
        "rtvideo.workers.launch",
        "--api",
        f"127.0.0.1:{port}",
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_a_torchrun_group_serves_exactly_what_one_rank_makes_and_a_killed_rank_is_replaced():
    port = free_port_pair()
    launcher = torchrun(port, ranks=2, restarts=1)
    config = EngineConfig(pipeline=SPEC, worker_listen=f"127.0.0.1:{port}", startup_timeout_s=180, **PINNED_LIMITS)
    client = EngineClient(config)
    try:
        ready = await client.start()
        assert ready.blocks_per_rank == (1, 1) and len(ready.pipeline_ranks) == 1
        follower = ready.pipeline_ranks[0]
        assert follower != ready.pid

        # Served exactly: a session with a prompt sent once its first chunk is in.
        launched = await interact_once(client, start_of("s", 5, None))
        (applied,) = launched.of(InteractionApplied)

        # A rank killed mid-session: the session fails with the reason, soon.
        victim = await client.start_session(start_of("v", 6, None))
        await read_until(victim, ChunkReady, Collected(), timeout=60)
        killed_at = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        failed = (await collect(victim, timeout=60)).end
        failed_after = time.monotonic() - killed_at
        assert isinstance(failed, SessionFailed) and failed.code == "worker_died", failed
        assert failed_after < 10.0, failed_after

        # torchrun starts the group again; it connects and serves.
        await client.settled()
        assert client.alive and client.restarts == 1 and client.ready.pid != ready.pid
        again = await collect(await client.start_session(start_of("s", 5, 1)), timeout=120)
        assert isinstance(again.end, SessionDone) and again.end.reason == "completed"
    finally:
        await client.shutdown()
        try:
            code = await asyncio.to_thread(launcher.wait, 60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            pytest.fail("torchrun did not exit after the API process shut its group down")
    assert code == 0  # the group ended as asked

    one = await start_engine(1)
    try:
        scheduled = (
            ScheduledInteraction(
                at_chunk=applied.generation_chunk_index, event_id="e1", interaction=Interaction(prompt="a storm")
            ),
        )
        exact = await run_sessions(one, [start_of("s", 5, len(launched.chunks), scheduled=scheduled)])
    finally:
        await one.shutdown()
    assert payloads(launched) == payloads(exact["s"])
    assert payloads(again)[0] == payloads(exact["s"])[0]  # the same first chunk from the fresh group
