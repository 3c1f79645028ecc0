"""A session the API process stops reading, or whose start it gives up waiting
for, leaves nothing behind: not in the client's open sessions (which the health
answer, the memory figures and a drain count), not on the worker."""

from __future__ import annotations

import asyncio

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import UnknownSessionError
from rtvideo.engine.messages import ChunkReady, Interaction, ProbeReply, SessionDone, StartSession
from rtvideo.server.drain import Drainer
from rtvideo.server.job_store import JobStore
from rtvideo.server.jobs import JobManager
from rtvideo.server.metrics import Metrics
from rtvideo.server.schemas import JobRequest
from rtvideo.server.settings import ServerSettings


async def worker_holds(engine: EngineClient, session_id: str, wanted: bool, rounds: int = 600) -> ProbeReply:
    """Probe the worker until it does (``wanted``) or does not hold ``session_id``.
    A probe is answered by the worker's loop, which sends a session's end before
    it answers a later probe, so once the reply leaves the session out its end
    has reached the client."""
    for _ in range(rounds):
        reply = await engine.probe()
        if (session_id in reply.sessions) == wanted:
            return reply
    raise AssertionError(f"the worker {'never took' if wanted else 'still holds'} session {session_id!r}")


async def test_a_session_nobody_reads_to_its_end_is_closed_as_its_end_arrives(make_engine):
    # Steps of 50 ms: the session's end cannot come before this test looks at it open (with
    # instant steps, a loaded machine's pump could take its start and its end in one go).
    engine = await make_engine(step_time_s=0.05)
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=1))
    assert engine.open_sessions() == ("s",) and engine.held_state_bytes() > 0

    await worker_holds(engine, "s", wanted=False)  # it ran its one chunk, and nobody read it

    assert engine.open_sessions() == () and engine.held_state_bytes() == 0
    assert engine.responsiveness()[0] == "ok"
    with_nobody = [await handle.next(5) for _ in range(2)]  # the stream still holds what came, its end last
    assert [type(m) for m in with_nobody] == [ChunkReady, SessionDone] and handle.finished
    # What a client sends after the end is refused here, never sent for a session the worker forgot.
    try:
        await handle.interact("late", Interaction(prompt="q"))
    except UnknownSessionError as error:
        assert "'s'" in str(error)
    else:
        raise AssertionError("an interaction after the session's end was taken")
    await handle.stop()  # reports and stops about a session gone are no-ops
    await engine.playback("s", 1.0)
    await engine.delivered("s", 1.0)


async def test_a_start_given_up_after_it_was_sent_is_stopped_on_the_worker(make_engine, monkeypatch):
    engine = await make_engine()
    sent = asyncio.Event()
    send = engine._send

    async def send_then_hang(message):
        await send(message)
        if isinstance(message, StartSession):
            sent.set()
            await asyncio.Event().wait()  # the caller is still waiting when it gives up

    monkeypatch.setattr(engine, "_send", send_then_hang)
    starting = asyncio.create_task(engine.start_session(StartSession(session_id="s", prompt="p")))  # no end
    await sent.wait()
    await worker_holds(engine, "s", wanted=True)
    monkeypatch.undo()
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)

    assert engine.open_sessions() == ()
    after = await worker_holds(engine, "s", wanted=False)  # an endless session: only the stop ends it
    assert after.runner_sessions == after.pipeline_sessions == ()
    # The worker still takes sessions, the same id included.
    handle = await engine.start_session(StartSession(session_id="s", prompt="p", num_chunks=1))
    assert [type(await handle.next(30)) for _ in range(2)] == [ChunkReady, SessionDone]


class HeldStore(JobStore):
    """A job store whose update (a job going ``in_progress``) waits until it is cancelled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.updating = asyncio.Event()

    async def update(self, job_id, body) -> None:
        self.updating.set()
        await asyncio.Event().wait()


async def test_a_job_deleted_as_it_starts_leaves_no_session(make_engine, tmp_path):
    engine = await make_engine()
    settings = ServerSettings(data_dir=str(tmp_path / "data"))
    store = HeldStore(settings.data_dir, settings.job_ttl_s)
    await store.open()
    capacity = asyncio.Condition()
    metrics = Metrics(worker_up=lambda: engine.alive)
    jobs = JobManager(engine, settings, "stub", capacity, metrics, Drainer(engine, capacity, 1.0), store)
    await jobs.open()
    try:
        job = await jobs.create(JobRequest(prompt="p"))  # started on the engine at once
        await store.updating.wait()  # the job holds its engine session, on its way to in_progress
        assert engine.open_sessions() == (job.id,)

        assert await jobs.delete(job.id) == "cancelled"

        assert engine.open_sessions() == ()  # read to its end before the delete answered
        reply = await engine.probe()
        assert job.id not in reply.sessions and reply.runner_sessions == ()
    finally:
        await jobs.close()  # the store too
