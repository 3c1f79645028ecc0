"""A server's log stays clean through every way a session ends: no "Task
exception was never retrieved", no traceback, from the first request to the
last line uvicorn writes after SIGTERM; and a session or job whose generation
fails is named in one warning line with the engine's code and message (and
the worker's line says where the pipeline raised). Every line says when and
which process wrote it; at ``--log-level debug`` the worker's line about a
failed pipeline call carries its traceback. No credential (the API key, a
session's tokens) reaches the log, however a client spells it."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx

from tests.e2e.client import Chunk, Realtime, open_realtime
from tests.e2e.test_live_sessions import resume

START = {"type": "session.start", "prompt": "a quiet harbour", "format": "fmp4"}
STUB = Path(__file__).resolve().parents[2] / "rtvideo" / "workers" / "pipelines" / "stub.py"
DIRTY = ("never retrieved", "Traceback", "Exception in ASGI", "Task was destroyed but it is pending")


async def test_no_unretrieved_task_exception_or_traceback_from_start_to_exit(make_server):
    pipeline = {"step_time_s": 0.002, "fail_prompt": "a broken prompt", "fail_chunk": 1}
    server = make_server("--shutdown-grace-s", "0.5", pipeline=pipeline)

    async with open_realtime(server.ws) as ws:  # ends by itself: its length is reached
        client = Realtime(ws)
        await client.send({**START, "num_chunks": 2})
        started = await client.until("video.start")
        assert (await client.rest()).of("session.done")[0]["reason"] == "completed"
    server.wait_for_log(f" api INFO session {started['request_id']} ended: completed")  # the API process's own

    async with open_realtime(server.ws) as ws:  # stopped by its client
        client = Realtime(ws)
        await client.send(START)
        await client.until("video.start")
        await client.next()
        await client.send({"type": "session.stop"})
        assert (await client.rest()).of("session.done")[0]["reason"] == "stopped"

    async with open_realtime(server.ws) as ws:  # the client leaves without a word
        client = Realtime(ws)
        await client.send(START)
        await client.until("video.start")
        await client.next()
    async with open_realtime(server.ws) as ws:  # its generation fails: one line says which and why
        client = Realtime(ws)
        await client.send({**START, "prompt": "a broken prompt"})
        started = await client.until("video.start")
        failed = await client.rest()
        assert failed.close_code == 1011 and failed.of("error")[0]["code"] == "pipeline_error"
        said = f"session {started['request_id']} failed: pipeline_error: forward failed: RuntimeError: stub pipeline"
        server.wait_for_log(f" api WARNING {said}")
        where = f"forward of session {started['request_id']} failed at {STUB}:"  # the worker's line says where
        server.wait_for_log(f" worker[0] WARNING {where}")
        assert "in forward: RuntimeError: stub pipeline: injected failure at chunk 1" in next(
            line for line in server.log if where in line
        )
    async with open_realtime(server.ws) as ws:  # refused before it starts
        refused = Realtime(ws)
        await refused.send({"type": "session.dance"})
        assert (await refused.rest()).close_code == 1008

    job = httpx.post(f"{server.http}/v1/videos", json={"prompt": "p", "num_chunks": 2, "format": "raw"}).json()
    while httpx.get(f"{server.http}/v1/videos/{job['id']}").json()["status"] != "completed":
        await asyncio.sleep(0.02)
    broken = {"prompt": "a broken prompt", "num_chunks": 3, "format": "raw"}
    job = httpx.post(f"{server.http}/v1/videos", json=broken).json()
    server.wait_for_log(f"job {job['id']} failed: pipeline_error: forward failed: RuntimeError: stub pipeline")
    assert httpx.get(f"{server.http}/v1/videos/{job['id']}").json()["error"]["code"] == "pipeline_error"

    async with open_realtime(server.ws) as ws:  # still open at SIGTERM: ended by the drain
        client = Realtime(ws)
        await client.send(START)
        await client.until("video.start")
        await client.next()
        server.process.send_signal(signal.SIGTERM)
        assert (await client.rest()).of("session.done")[0]["reason"] == "shutdown"
    assert server.process.wait(timeout=30) == 0
    server.wait_for_log("Finished server process")  # the last line: everything before it was read

    dirty = [line for line in server.log if any(mark in line for mark in DIRTY)]
    assert dirty == [], "".join(server.log)


async def test_at_debug_the_worker_logs_the_traceback_of_a_failed_pipeline_call(make_server):
    pipeline = {"step_time_s": 0.002, "fail_prompt": "a broken prompt", "fail_chunk": 1}
    server = make_server("--log-level", "debug", pipeline=pipeline)
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**START, "prompt": "a broken prompt"})
        started = await client.until("video.start")
        assert (await client.rest()).close_code == 1011
    where = f"forward of session {started['request_id']} failed at {STUB}:"
    server.wait_for_log(where)
    warning = next(i for i, line in enumerate(server.log) if where in line)
    raised_in = f'File "{STUB}", line '  # the traceback's last frame: the stub's forward, which raised
    deadline = time.monotonic() + 30
    while not any(raised_in in line and "in forward" in line for line in server.log[warning:]):
        assert time.monotonic() < deadline, "no traceback after the warning:\n" + "".join(server.log[warning:])
        time.sleep(0.02)
    # The API process's lines may come between the worker's (each writes its own to the one stream).
    assert any(line.startswith("Traceback (most recent call last)") for line in server.log[warning:])


KEY = "k3y-that-is-never-logged-0123456789"


async def test_no_credential_reaches_the_log_in_any_spelling(make_server):
    """The API key in each spelling of its query parameter the server accepts, as
    a bearer token and as the key subprotocol, and a session's resume, watch and
    control tokens (in the URLs of a spectator and a further controller, and in a
    resume's first message): every request works, and the server's whole log, at
    debug, holds none of them, where it shows them masked."""
    server = make_server("--api-key", KEY, "--log-level", "debug", pipeline={"step_time_s": 0.005})
    for name in ("api_key", "api%5Fkey", "api%5fkey", "%61pi_key", "%61%70%69%5F%6B%65%79"):
        assert httpx.get(f"{server.http}/v1/models?{name}={KEY}").status_code == 200, name
    assert httpx.get(f"{server.http}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200

    start = {**START, "format": "raw", "width": 32, "height": 32, "shared_control": True}
    first = Realtime(await open_realtime(f"{server.ws}?api%5Fkey={KEY}"))
    await first.send(start)
    started = await first.until("video.start")
    while not isinstance(chunk := await first.next(), Chunk):
        pass
    tokens = (started["resume_token"], started["watch_token"], started["control_token"])
    watching = f"{server.ws}?w%61tch={started['watch_token']}"
    async with (
        open_realtime(watching, subprotocols=[f"rtvideo.key.{KEY}"]) as s,
        open_realtime(f"{server.ws}?c%6Fntrol={started['control_token']}&api_key={KEY}") as c,
    ):
        spectator, controller = Realtime(s), Realtime(c)
        assert (await spectator.until("video.start"))["role"] == "spectator"
        assert (await controller.until("video.start"))["controller_id"] == "c2"
        first.ws.transport.abort()  # a dropped socket: the session waits for a resume
        resumed = await resume(f"{server.ws}?api_key={KEY}", started, chunk.metadata["generation_chunk_index"])
        await resumed.send({"type": "session.stop"})
        assert (await resumed.rest()).of("session.done")[0]["reason"] == "stopped"
        assert (await spectator.rest()).of("session.done") and (await controller.rest()).of("session.done")
    server.wait_for_log(f"session {started['request_id']} ended: stopped")

    logged = "".join(server.log)
    secrets = dict(zip(("key", "resume", "watch", "control"), (KEY, *tokens), strict=True))
    leaked = [name for name, secret in secrets.items() if secret in logged]
    assert leaked == [], logged
    for masked in ("/v1/models?api%5Fkey=***", "?%61%70%69%5F%6B%65%79=***", "?w%61tch=***", "?c%6Fntrol=***"):
        assert masked in logged, masked
