"""Temporal pipeline parallelism through real worker processes: the tiny model's
blocks split over two ranks (``EngineConfig.pp = 2``: one gloo process group,
the activations on the ranks' own sockets, or over gloo; each session's VAE
decoder split over the two ranks, or the sessions' decodes shared out over
them), against the same sessions on one rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest
import pytest_asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import SessionRejectedError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import (
    ChunkReady,
    Interaction,
    InteractionApplied,
    ScheduledInteraction,
    SessionDone,
    SessionFailed,
    StartSession,
)
from rtvideo.workers.cpu_threads import candidates
from rtvideo.workers.parallel.group import rank_threads
from tests.conftest import PINNED_LIMITS
from tests.engine.test_lifecycle import wait_gone
from tests.support import Collected, collect, free_ports, read_until

SIZE = {"width": 32, "height": 32}
SHARED = pytest.mark.asyncio(loop_scope="module")  # the tests that run on the module's engines


async def start_engine(pp: int, **config) -> EngineClient:
    spec = PipelineSpec("tiny", {"device": "cpu", "warm_up_chunks": 1})
    config = {"startup_timeout_s": 120, **PINNED_LIMITS, "max_sessions": 6, **config}
    client = EngineClient(EngineConfig(pipeline=spec, pp=pp, **config))
    await client.start()
    return client


def assert_forked_from_rank_0(ready) -> None:
    """Each later rank is a fork of rank 0 (its child, with its command line),
    started before rank 0 ran a thread: it begins with rank 0's modules
    imported, where a spawned rank would import them again."""

    def command(pid: int) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[1])

    for pid in ready.pipeline_ranks:
        assert parent(pid) == ready.pid and command(pid) == command(ready.pid), pid


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one_rank():
    """One rank, forwards of up to 2 rows, shared by this module's tests (a start
    is seconds of imports and warm-up); each test ends its own sessions."""
    engine = await start_engine(1, max_batch_rows=2)
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_ranks():
    """Two ranks, forwards of up to 2 rows, shared like ``one_rank``; their
    sockets on ports given (``pp_port``); every session's decoder split over
    them (``pp_decode`` ``split``; ``auto`` on a CPU spreads them whole, as the
    gloo test below does)."""
    engine = await start_engine(2, max_batch_rows=2, pp_port=free_ports(2), pp_decode="split")
    yield engine
    await engine.shutdown()


def start_of(sid: str, seed: int, chunks: int, **fields) -> StartSession:
    return StartSession(session_id=sid, prompt=f"prompt {sid}", seed=seed, num_chunks=chunks, **SIZE, **fields)


async def run_sessions(engine: EngineClient, starts: list[StartSession], stagger: int = 0) -> dict[str, Collected]:
    """Run ``starts`` together; with ``stagger``, each session after the first
    starts once the one before it has made ``stagger`` chunks (sessions join
    while others are in the ring)."""
    results: dict[str, Collected] = {}
    tasks = []
    for start in starts:
        handle = await engine.start_session(start)
        seen = Collected()
        if stagger:
            for _ in range(stagger):
                await read_until(handle, ChunkReady, seen)
        tasks.append((start.session_id, asyncio.create_task(collect(handle, seen, timeout=120))))
    for sid, task in tasks:
        results[sid] = await task
    return results


def payloads(result: Collected) -> list[bytes]:
    return [chunk.payload for chunk in result.chunks]


async def interact_once(engine: EngineClient, start: StartSession) -> Collected:
    """Run the open-ended ``start``, send one prompt once its first chunk is in,
    and stop the session once the chunk that prompt applied at is in. Open-ended,
    the session always has a next chunk for the prompt to land on, however far
    the worker has run ahead of this test when the prompt reaches it."""
    assert start.num_chunks is None
    handle = await engine.start_session(start)
    seen = Collected()
    await read_until(handle, ChunkReady, seen)
    await handle.interact("e1", Interaction(prompt="a storm"))
    applied = await read_until(handle, InteractionApplied, seen, timeout=120)
    while not any(c.generation_chunk_index >= applied.generation_chunk_index for c in seen.chunks):
        await read_until(handle, ChunkReady, seen, timeout=120)
    await handle.stop()
    return await collect(handle, seen, timeout=120)


@SHARED
async def test_two_ranks_make_exactly_what_one_rank_makes_and_interactions_land_where_they_say(one_rank, two_ranks):
    """Sessions of their own, joining while others run, different lengths and
    steps, sharing forwards where they meet: the frames of every chunk are bit
    for bit those of one rank (the same kernels on the same inputs: the
    activations cross between the ranks unchanged, and a batched forward is
    batch-invariant on a CPU). And a prompt sent while chunk k is in the ring
    applies at the chunk it reports, k + 1, with the frames of one rank's run
    of the same prompt scheduled at that chunk."""
    starts = [
        start_of("a", 1, 4),
        start_of("b", 2, 3, num_inference_steps=2),
        start_of("c", 3, 3, num_inference_steps=1),
    ]
    two = two_ranks
    assert two.ready.blocks_per_rank == (1, 1) and len(two.ready.pipeline_ranks) == 1
    assert_forked_from_rank_0(two.ready)
    # one rank: its measured thread count, or OMP_NUM_THREADS's (set by tests/conftest.py under xdist);
    # ranks take the cores shared out (workers.main._cpu_threads)
    assert one_rank.ready.cpu_threads in candidates(os.cpu_count() or 1)
    assert two.ready.cpu_threads == rank_threads(2)
    got = await run_sessions(two, starts, stagger=1)
    interacted = await interact_once(two, start_of("s", 5, None))
    probe = await two.probe()
    decoded = {figure.rank: figure.decoded_chunks for figure in two.stats.ranks}
    applied = interacted.of(InteractionApplied)
    assert len(applied) == 1
    at = applied[0].generation_chunk_index
    assert interacted.chunks[0].generation_chunk_index == 0 and at >= 1
    chunk = next(c for c in interacted.chunks if c.generation_chunk_index == at)
    assert "e1" in chunk.started_event_ids and applied[0].first_frame_index == chunk.first_frame_index

    expected = await run_sessions(one_rank, starts)
    scheduled = (ScheduledInteraction(at_chunk=at, event_id="e1", interaction=Interaction(prompt="a storm")),)
    replay = await run_sessions(one_rank, [start_of("s", 5, len(interacted.chunks), scheduled=scheduled)])
    for start in starts:
        sid = start.session_id
        assert isinstance(got[sid].end, SessionDone) and got[sid].end.reason == "completed"
        assert [c.generation_chunk_index for c in got[sid].chunks] == list(range(start.num_chunks))
        assert payloads(got[sid]) == payloads(expected[sid]), f"session {sid} differs"
    assert payloads(interacted) == payloads(replay["s"])
    assert probe.runner_sessions == probe.pipeline_sessions == ()
    # With pp_decode split every session's decoder is split over the ranks (the chunks of
    # sessions that meet batched), its frames from rank 1, all as one rank's frames. (The figures
    # are those of the latest EngineStats, sent while s ran: a, b and c were done.)
    assert decoded[0] == 0 and decoded[1] >= 4 + 3 + 3


async def test_a_killed_rank_fails_its_sessions_fast_and_the_group_restarts():
    """The rank's death is seen at once (its process, its closed sockets), not
    when a link gives up waiting: with a link timeout of 10 minutes, the
    session's failure within the 30 s it is waited for can only come so."""
    two = await start_engine(2, max_worker_restarts=1, pp_timeout_s=600)
    try:
        follower = two.ready.pipeline_ranks[0]
        rank0 = two.ready.pid
        handle = await two.start_session(start_of("s", 1, None))
        seen = Collected()
        await read_until(handle, ChunkReady, seen)
        os.kill(follower, signal.SIGKILL)
        end = await collect(handle, seen, timeout=30)
        assert isinstance(end.end, SessionFailed)
        assert "pipeline rank 1" in end.end.message
        await two.settled()  # a fresh group came up under the restart budget
        assert two.alive and two.ready.pid != rank0
        assert two.ready.pipeline_ranks and two.ready.pipeline_ranks[0] != follower
        assert_forked_from_rank_0(two.ready)  # the fresh group's rank 0 forked its follower too
        for pid in (rank0, follower):  # nothing of the old group is left
            with pytest.raises(ProcessLookupError):
                for _ in range(100):
                    os.kill(pid, 0)
                    await asyncio.sleep(0.05)
        again = await run_sessions(two, [start_of("t", 2, 2)])
        assert isinstance(again["t"].end, SessionDone) and len(again["t"].chunks) == 2
        # and no follower outlives its rank 0 (a fork of it, holding none of the pipe ends that tell it so)
        rank0, follower = two.ready.pid, two.ready.pipeline_ranks[0]
        os.kill(rank0, signal.SIGKILL)
        wait_gone(follower, within=10.0)
    finally:
        await two.shutdown()


@SHARED
async def test_a_stop_mid_pipeline_frees_the_session_others_go_on_and_recache_is_refused(two_ranks):
    two = two_ranks
    with pytest.raises(SessionRejectedError, match="prompt_change"):  # a boundary on one rank cannot re-cache
        await two.start_session(start_of("r", 1, 2, prompt_change="recache"))
    stopped = await two.start_session(start_of("stopped", 1, None))
    other = await two.start_session(start_of("other", 2, 4))
    seen = Collected()
    await read_until(stopped, ChunkReady, seen)
    await stopped.stop()
    end = await collect(stopped, seen, timeout=60)
    result = await collect(other, timeout=120)
    probe = await two.probe()
    assert isinstance(end.end, SessionDone) and end.end.reason == "stopped"
    assert isinstance(result.end, SessionDone) and len(result.chunks) == 4
    assert probe.runner_sessions == probe.pipeline_sessions == ()


def test_the_pp_benchmark_reports_every_ranks_busy_and_bubble_fraction(capsys):
    """``rtvideo bench pp`` on a small run: frames per second, each rank's
    figures as the worker's EngineStats carried them round the ring, and where
    the CPU went: each rank's threads by name (rank 0's ring runs on its
    executor thread, the follower's in its main thread, and, with the decoders
    split, each decodes half of every chunk on a thread of its own)."""
    from rtvideo.bench import pp as bench_pp

    options = bench_pp.PpBenchOptions(chunks=2, size=32, steps=2)
    split = bench_pp.Config("pp2-decode-split", 2, None, 2, decode="split")
    assert bench_pp.main(options, as_json=True, configs=(split,)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (result,) = summary["results"]
    assert result["frames"] == 2 * (9 + 12) and result["fps"] > 0
    assert [rank["rank"] for rank in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        assert rank["busy_s"] > 0 and 0 <= rank["bubble"] < 1
    assert result["micro_steps"] >= 2 * 2 * 3  # 2 chunks of 2 steps and a commit, 2 ranks each
    assert 0 < result["mean_rows"] <= 1
    if sys.platform.startswith("linux"):
        cpu = result["cpu"]
        rank0, rank1 = cpu["ranks"]
        # every thread by its name (a short run may cost a thread less than a clock tick: >= 0)
        assert {"executor", "decode-front", "main"} <= set(rank0) and {"main", "decode"} <= set(rank1)
        assert all(seconds >= 0 for seconds in [*rank0.values(), *rank1.values()])
        assert cpu["total_s"] >= sum(rank0.values()) + sum(rank1.values()) - 0.01  # figures rounded to 1 ms
        assert cpu["total_s"] > 0 and cpu["cores_busy"] > 0


@SHARED
async def test_the_ring_over_gloo_with_whole_decodes_makes_what_sockets_and_split_decodes_make(two_ranks):
    """The two transports of the ring (``pp_transport``): the ranks' own sockets
    (the default on a CPU, ``two_ranks``) and ``torch.distributed`` point-to-point
    over gloo (the path NCCL takes on GPUs) carry the same activations; and a
    session's whole decode on one rank (``pp_decode`` ``spread``, here: on the
    follower, first on a tie; ``auto`` on a CPU) makes what its decoder split
    over the two makes. So a session's frames are bit for bit the same."""
    gloo = await start_engine(2, max_batch_rows=2, pp_transport="torch")
    try:
        start = start_of("g", 4, 3)
        over_gloo = (await run_sessions(gloo, [start]))["g"]
        for _ in range(100):  # the worker's figures once it is idle (sent then, ahead of a later probe's reply)
            await gloo.probe()
            decoded = {figure.rank: figure.decoded_chunks for figure in gloo.stats.ranks}
            if decoded[1] == 3:
                break
        over_sockets = (await run_sessions(two_ranks, [start]))["g"]
    finally:
        await gloo.shutdown()
    assert isinstance(over_gloo.end, SessionDone) and len(over_gloo.chunks) == 3
    assert payloads(over_gloo) == payloads(over_sockets)
    assert decoded == {0: 0, 1: 3}


@SHARED
async def test_batched_rows_cross_the_ring_as_one_forward(one_rank, two_ranks):
    """Two sessions started together share forwards (``max_batch_rows`` 2) on both
    ranks: the grouped activations travel as one message and come back as one
    prediction per row, and the frames are one rank's bit for bit (a batched
    forward is batch-invariant on a CPU, whichever micro-steps carry both rows);
    a row mixed up or misplaced on the way would differ everywhere."""
    starts = [start_of("ba", 1, 3), start_of("bb", 2, 3)]
    frames = {}
    for pp, engine in ((1, one_rank), (2, two_ranks)):
        before = (await engine.probe(), engine.stats)[1]  # None on an engine that has run no micro-step yet
        rows_before, steps_before = (before.rows, before.micro_steps) if before is not None else (0, 0)
        handles = [await engine.start_session(start) for start in starts]
        results = await asyncio.gather(*(collect(handle, timeout=120) for handle in handles))
        after = (await engine.probe(), engine.stats)[1]
        frames[pp] = [payloads(result) for result in results]
        assert all(isinstance(result.end, SessionDone) for result in results)
        rows, steps = after.rows - rows_before, after.micro_steps - steps_before
        assert rows > steps / 2 if pp == 1 else rows > steps / 4  # rows shared forwards
    assert [len(one) for one in frames[1]] == [3, 3]
    assert frames[1] == frames[2]


def threads_of(pid: int) -> dict[int, tuple[str, int]]:
    """Every thread of process ``pid``: its kernel name and nice."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        threads[int(tid)] = (name, int(stat[stat.rindex(")") + 2 :].split()[16]))  # nice: field 19 of proc(5)
    return threads


@SHARED
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread names and nice are Linux's")
async def test_on_a_cpu_each_ranks_decode_thread_runs_ten_steps_below_its_ring(two_ranks):
    """``decode_nice`` unset on a CPU: the decode thread of each rank (rank 0's
    front lane, the follower's decode server: every decoder is split) runs at
    nice 10 above the rank's once it has decoded, and the threads of the ring
    (rank 0's executor, the follower's main thread) at the rank's own."""
    got = await run_sessions(two_ranks, [start_of("n", 4, 2)])
    assert isinstance(got["n"].end, SessionDone)
    (follower,) = two_ranks.ready.pipeline_ranks
    for pid, ring, decode in ((two_ranks.ready.pid, "executor", "decode-front"), (follower, None, "decode")):
        threads = threads_of(pid)
        base = os.getpriority(os.PRIO_PROCESS, pid)  # the rank's main thread: the follower's ring
        by_name = {name: nice for name, nice in threads.values()}
        assert by_name[decode] == min(19, base + 10), threads
        assert ring is None or by_name[ring] == base, threads


@SHARED
async def test_ranks_on_a_cpu_talk_only_on_the_ports_given(two_ranks):
    """With ``pp_port`` rank 0's sockets are on that port and the follower's on
    the next, and on a CPU (the ring on those sockets) the ranks join no
    process group: every connection the follower has is to or from one of
    those ports or the rendezvous store, and it listens on nothing once joined
    (gloo would connect on ports of its own). So ranks on several machines
    need only these ports and the rendezvous port open between them."""
    import psutil

    base = two_ranks.config.pp_port
    ready = two_ranks.ready
    (follower,) = ready.pipeline_ranks
    rank0 = psutil.Process(ready.pid).net_connections("tcp")
    (store,) = {c.laddr.port for c in rank0 if c.status == psutil.CONN_LISTEN}  # the group's rendezvous
    assert any(c.laddr.port == base for c in rank0 if c.status == psutil.CONN_ESTABLISHED)
    theirs = psutil.Process(follower).net_connections("tcp")
    assert theirs and not [c for c in theirs if c.status == psutil.CONN_LISTEN]
    assert any(c.laddr.port == base + 1 for c in theirs)  # accepted from rank 0
    other = [c for c in theirs if c.laddr.port != base + 1 and (not c.raddr or c.raddr.port not in (base, store))]
    assert not other, other
    served = (await run_sessions(two_ranks, [start_of("ports", 3, 2)]))["ports"]
    assert isinstance(served.end, SessionDone) and len(served.chunks) == 2


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_rank_port_already_taken_fails_the_start_naming_it(rank):
    """Rank 0's own, or a follower's (which says so in the store, so rank 0 fails
    the start with its reason at once instead of waiting out the start-up)."""
    import socket

    from rtvideo.engine.client.errors import EngineStartupError

    base = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + rank))
        taken.listen(1)
        # Its own reason, at once: waiting out the start-up timeout (10 minutes here) would end the test first.
        with pytest.raises(EngineStartupError, match=f"pipeline rank {rank} cannot listen on port {base + rank}"):
            async with asyncio.timeout(90):
                await start_engine(2, pp_port=base, startup_timeout_s=600)
