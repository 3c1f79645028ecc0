"""HTTP request mode, capacity, auth, and the service routes."""

from __future__ import annotations

import asyncio
import io
import re
import time

import av
import httpx
import pytest

from tests.e2e.client import Realtime, open_realtime

JOB = {"prompt": "a windmill", "seed": 1, "width": 32, "height": 32, "format": "raw"}


def poll(server, job_id: str, status: str, within: float = 30.0) -> dict:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.http}/v1/videos/{job_id}").json()
        if job["status"] == status:
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} never became {status}: {job}")


def test_job_lifecycle_create_poll_content_list(server):
    created = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 4, "format": "fmp4"})
    assert created.status_code == 202
    job = created.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress", "completed")
    done = poll(server, job["id"], "completed")
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"] and done["error"] is None
    content = httpx.get(f"{server.http}/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(content.content)) as container:
        assert len(list(container.decode(video=0))) == 16
    listed = httpx.get(f"{server.http}/v1/videos").json()
    assert job["id"] in [j["id"] for j in listed["data"]]
    assert httpx.delete(f"{server.http}/v1/videos/{job['id']}").json()["deleted"] is True
    assert httpx.get(f"{server.http}/v1/videos/{job['id']}").status_code == 404


def test_a_videos_bytes_by_range_and_every_get_route_by_head(server):
    """Ranges as RFC 9110 has them: a satisfiable one 206; a unit other than
    bytes, or a range-set that does not parse, ignored (the whole video, 200);
    one past the end 416 in the API's error shape. HEAD answers what GET would,
    without the body, on every GET route."""
    job = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 2}).json()
    poll(server, job["id"], "completed")
    url = f"{server.http}/v1/videos/{job['id']}/content"
    whole = httpx.get(url).content
    size = len(whole)
    first = httpx.get(url, headers={"range": "bytes=0-9"})
    assert (first.status_code, first.content, first.headers["content-range"]) == (206, whole[:10], f"bytes 0-9/{size}")
    assert httpx.get(url, headers={"range": "bytes=-5"}).content == whole[-5:]
    for ignored in ("bytes=5-2", "items=0-5", "bytes=abc", "bytes"):
        answer = httpx.get(url, headers={"range": ignored})
        assert (answer.status_code, answer.content) == (200, whole), ignored
    past = httpx.get(url, headers={"range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    assert past.json()["error"] == {
        "code": "range_not_satisfiable",
        "message": f"range: 'bytes={size}-': no byte of it lies within the video's {size} bytes",
    }
    assert httpx.get(url, headers={"range": "bytes=-0"}).status_code == 416
    partly = httpx.get(url, headers={"range": f"bytes=0-9,{size}-"})  # the range that lies within: answered
    assert (partly.status_code, partly.content) == (206, whole[:10])
    etag = httpx.head(url).headers["etag"]
    for validator, status in ((etag, 206), ('"another"', 200)):  # If-Range: the range only for this very file
        answer = httpx.get(url, headers={"range": "bytes=0-9", "if-range": validator})
        assert answer.status_code == status, validator
    stale = httpx.get(url, headers={"range": f"bytes={size}-", "if-range": '"another"'})
    assert (stale.status_code, stale.content) == (200, whole)
    head = httpx.head(url)
    assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", str(size))
    for path in ("/health", "/health/live", "/v1/models", "/v1/videos", f"/v1/videos/{job['id']}"):
        got, head = httpx.get(f"{server.http}{path}"), httpx.head(f"{server.http}{path}")
        assert (head.status_code, head.content) == (got.status_code, b""), path
        assert head.headers["content-type"] == got.headers["content-type"], path
    assert httpx.head(f"{server.http}/v1/videos/video_nope").status_code == 404


def test_a_prompt_alone_makes_four_seconds(server):
    """All the schema requires is a prompt: a job that gives no length is 4 s of
    media, as the OpenAI API's default, and its answer says exactly what was made."""
    defaults = httpx.get(f"{server.http}/v1/models").json()["data"][0]["defaults"]
    fps, first, per = defaults["fps"], defaults["first_chunk_frames"], defaults["frames_per_chunk"]
    frames = round(4 * fps)
    created = httpx.post(f"{server.http}/v1/videos", json={"prompt": "a windmill"})
    assert created.status_code == 202, created.text
    job = poll(server, created.json()["id"], "completed")
    assert job["num_frames"] == frames and job["seconds"] == "4"
    assert job["num_chunks"] == 1 + -(-(frames - first) // per)  # the last chunk trimmed to fit
    content = httpx.get(f"{server.http}/v1/videos/{job['id']}/content")
    with av.open(io.BytesIO(content.content)) as container:
        assert len(list(container.decode(video=0))) == frames


async def test_delete_cancels_a_running_job_and_of_deletes_at_once_one_answers(make_server):
    """Six deletes of one job at once: one answers ``deleted`` with the status the
    job had (``cancelled``, running; ``completed``, finished), the others 404,
    as they would one after another."""
    server = make_server(pipeline={"step_time_s": 0.02})
    job = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 500}).json()
    poll(server, job["id"], "in_progress")
    assert httpx.get(f"{server.http}/v1/videos/{job['id']}/content").status_code == 409
    finished = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1}).json()
    poll(server, finished["id"], "completed")
    async with httpx.AsyncClient(base_url=server.http, timeout=30) as client:
        for job_id, status in ((job["id"], "cancelled"), (finished["id"], "completed")):
            answers = await asyncio.gather(*(client.delete(f"/v1/videos/{job_id}") for _ in range(6)))
            assert sorted(answer.status_code for answer in answers) == [200, 404, 404, 404, 404, 404], job_id
            [deleted] = [answer.json() for answer in answers if answer.status_code == 200]
            assert (deleted["deleted"], deleted["status"]) == (True, status)
            assert httpx.get(f"{server.http}/v1/videos/{job_id}").status_code == 404
    server.released()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"num_chunks": 2}, "prompt"),
        ({"prompt": "x", "num_chunks": 2, "width": 5000}, "width"),
        ({"prompt": "x", "num_chunks": 2, "interactions": [{"at_chunk": 9, "prompt": "y"}]}, "at_chunk"),
        ({"prompt": "x", "num_chunks": 2, "interactions": [{"at_chunk": 1}]}, "prompt"),
        ({"prompt": "x", "num_chunks": 2, "num_inference_steps": 9}, "num_inference_steps"),
        ({"prompt": "  ", "num_chunks": 2}, "prompt: Value error, must not be blank"),
        (
            {"prompt": "x", "num_chunks": 3, "interactions": [{"at_chunk": 1, "prompt": "a"}] * 2},
            "interactions: Value error, interactions[0] and [1] both change the prompt at chunk 1",
        ),
        (
            {"prompt": "x", "num_chunks": 2, "interactions": [{"at_chunk": 1, "prompt": " "}]},
            "interactions.0.prompt: Value error, must not be blank",
        ),
        ("a cat", "body: expected a JSON object, got str"),  # JSON, but not an object
    ],
)
def test_bad_job_requests_name_the_field(server, body, field):
    response = httpx.post(f"{server.http}/v1/videos", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and field in error["message"]


async def test_a_full_server_answers_1013_and_queues_jobs(make_server):
    server = make_server("--max-sessions", "1", pipeline={"step_time_s": 0.01})
    async with open_realtime(server.ws) as ws:
        holder = Realtime(ws)
        await holder.send({"type": "session.start", "prompt": "first", "format": "raw"})
        await holder.until("video.start")
        async with open_realtime(server.ws) as ws2:
            refused = Realtime(ws2)
            await refused.send({"type": "session.start", "prompt": "second", "format": "raw"})
            got = await refused.rest(timeout=10)
        assert got.close_code == 1013 and got.of("error")[0]["code"] == "server_full"
        job = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 2}).json()
        await holder.next()  # the holder streams on; the job waits for capacity
        assert httpx.get(f"{server.http}/v1/videos/{job['id']}").json()["status"] == "queued"
        await holder.send({"type": "session.stop"})
        await holder.rest()
    poll(server, job["id"], "completed")


async def test_auth_refuses_a_missing_or_wrong_key_before_any_engine_work(make_server):
    server = make_server("--api-key", "s3cret")
    assert httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1}).status_code == 401
    wrong = httpx.get(f"{server.http}/v1/videos", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{server.http}/v1/videos", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(f"{server.http}/v1/models?api_key=s3cret").status_code == 200
    for method, path in (("GET", "/v1/nothing"), ("PUT", "/v1/videos")):  # no route told apart without the key
        assert httpx.request(method, f"{server.http}{path}").status_code == 401, path
    assert httpx.get(f"{server.http}/v1/nothing", headers={"Authorization": "Bearer s3cret"}).status_code == 404
    bare = httpx.get(f"{server.http}/health")  # probes need no key, and learn nothing more than the status
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    detailed = httpx.get(f"{server.http}/health", headers={"Authorization": "Bearer s3cret"}).json()
    assert detailed["status"] == "ok" and detailed["workers"][0]["pid"] > 0

    for url, options in [
        (server.ws, {}),
        (server.ws + "?api_key=nope", {}),
        (server.ws, {"subprotocols": ["rtvideo.key.nope"]}),
    ]:
        async with open_realtime(url, **options) as ws:
            got = await Realtime(ws).rest(timeout=10)  # closed before anything is asked
        assert got.close_code == 1008 and "unauthorized" in got.close_reason
    assert httpx.get(f"{server.http}/health?api_key=s3cret").json()["sessions"] == 0

    async with open_realtime(server.ws, subprotocols=["rtvideo.key.s3cret"]) as ws:
        assert ws.subprotocol == "rtvideo.key.s3cret"
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "num_chunks": 1, "format": "raw"})
        got = await client.rest()
    assert got.of("session.done") and got.close_code == 1000
    async with open_realtime(server.ws, additional_headers={"Authorization": "Bearer s3cret"}) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "num_chunks": 1, "format": "raw"})
        assert (await client.rest()).of("session.done")


def test_service_routes(server):
    health = server.health()
    assert health["status"] == "ok" and health["workers"][0]["alive"] is True
    models = httpx.get(f"{server.http}/v1/models").json()
    assert models["data"][0]["id"] == "stub"
    openapi = httpx.get(f"{server.http}/openapi.json").json()
    assert "/v1/videos" in openapi["paths"] and "/health" in openapi["paths"]
    assert httpx.get(f"{server.http}/docs").status_code == 200


async def test_stall_and_duration_limits_end_sessions_cleanly(make_server):
    server = make_server("--stall-timeout-s", "0.5", "--max-session-seconds", "30", pipeline={"step_time_s": 0.01})
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "quiet client", "format": "raw"})
        got = await client.rest(timeout=15)  # the client never speaks again
    errors = got.of("error")
    assert errors and errors[0]["code"] == "stall_timeout" and errors[0]["fatal"] is True
    assert got.of("session.done")[0]["reason"] == "stall_timeout" and got.close_code == 1000

    short = make_server("--max-session-seconds", "0.5", pipeline={"step_time_s": 0.01})
    async with open_realtime(short.ws) as ws:
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "long", "format": "raw"})
        got = await client.rest(timeout=15)
    done = got.of("session.done")[0]
    assert done["reason"] == "max_duration" and done["stopped"] is True and len(got.chunks) > 0


async def test_a_key_in_the_query_string_never_reaches_the_logs(make_server):
    server = make_server("--api-key", "topsecret-key")
    assert httpx.get(f"{server.http}/v1/models?api_key=topsecret-key").status_code == 200
    assert httpx.get(f"{server.http}/v1/models?api_key=wrong-one").status_code == 401
    async with open_realtime(f"{server.ws}?api_key=topsecret-key") as ws:  # the handshake is logged too
        client = Realtime(ws)
        await client.send({"type": "session.start", "prompt": "p", "format": "raw", "num_chunks": 1})
        assert (await client.rest()).of("session.done")
    server.wait_for_log("WebSocket /v1/realtime/video", within=10)
    logged = "".join(server.log)
    assert "/v1/models?api_key=***" in logged and "/v1/realtime/video?api_key=***" in logged
    assert "topsecret-key" not in logged and "wrong-one" not in logged


async def test_device_memory_admission_over_websocket_and_http(make_server):
    """The stub holds 4 bytes a pixel and says 8 KiB are free: two 32x32 sessions fit;
    a third waits (1013, or queued as a job); one that never fits is a 4xx / 1008 naming memory."""
    server = make_server("--max-sessions", "8", pipeline={"step_time_s": 0.01, "memory_budget": 8192})
    too_big = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1, "width": 128, "height": 128})
    assert too_big.status_code == 422
    assert "too large: a 128x128 session needs 64.00 KiB of device memory" in too_big.json()["error"]["message"]
    async with open_realtime(server.ws) as ws:
        refused = Realtime(ws)
        await refused.send({"type": "session.start", "prompt": "p", "format": "raw", "width": 128, "height": 128})
        got = await refused.rest(timeout=10)
    assert got.close_code == 1008 and "too large" in got.of("error")[0]["message"]

    async with open_realtime(server.ws) as ws1, open_realtime(server.ws) as ws2:
        holders = [Realtime(ws1), Realtime(ws2)]
        for holder in holders:
            await holder.send({"type": "session.start", "prompt": "p", "format": "raw"})
            await holder.until("video.start")
        async with open_realtime(server.ws) as ws3:
            full = Realtime(ws3)
            await full.send({"type": "session.start", "prompt": "p", "format": "raw"})
            got = await full.rest(timeout=10)
        assert got.close_code == 1013 and got.of("error")[0]["code"] == "server_full"
        assert "needs 4.00 KiB of device memory; 0 B of the 8.00 KiB" in got.of("error")[0]["message"]
        for holder in holders:
            await holder.send({"type": "session.stop"})
            await holder.rest()


def test_a_job_says_where_each_scheduled_prompt_landed_and_is_counted(make_server):
    server = make_server(pipeline={"step_time_s": 0.002})
    body = {
        **JOB,
        "num_chunks": 4,
        "interactions": [
            {"at_chunk": 2, "prompt": "a storm", "transition_chunks": 2},
            {"at_chunk": 3, "prompt": "a calm sea"},
        ],
    }
    created = httpx.post(f"{server.http}/v1/videos", json=body).json()
    assert created["prompt"] == "a windmill"
    assert [i["status"] for i in created["interactions"]] == ["pending", "pending"]
    done = poll(server, created["id"], "completed")
    storm, calm = done["interactions"]
    frames = 4  # the stub's frames per chunk
    assert storm == {
        "at_chunk": 2,
        "prompt": "a storm",
        "transition_chunks": 2,
        "status": "applied",
        "generation_chunk_index": 2,
        "first_frame_index": 2 * frames,
        "media_start_seconds": 2 * frames / 16.0,
    }
    assert calm["status"] == "applied" and calm["generation_chunk_index"] == 3
    text = httpx.get(f"{server.http}/metrics").text
    assert 'rtvideo_interactions_total{outcome="applied"} 2.0' in text
    assert "rtvideo_chunk_compute_seconds_count 4.0" in text
    assert "rtvideo_interaction_latency_seconds_count 0.0" in text  # scheduled, not waited for


def test_unknown_routes_and_methods_answer_in_the_error_shape(server):
    missing = httpx.get(f"{server.http}/v2/videos")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "/v2/videos" in missing.json()["error"]["message"]
    wrong = httpx.put(f"{server.http}/v1/videos")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    gone = httpx.get(f"{server.http}/v1/videos/video_nope")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "no video 'video_nope'"
    socket_path = httpx.get(f"{server.http}/v1/realtime/video")  # a WebSocket's path, asked for over plain HTTP
    assert socket_path.status_code == 404 and socket_path.json()["error"]["message"].startswith(
        "/v1/realtime/video is a WebSocket: connect to it with a WebSocket client"
    )


async def test_jobs_are_bounded_and_a_finished_one_is_kept_for_its_ttl(make_server):
    server = make_server(
        "--max-sessions",
        "1",
        "--max-queued-jobs",
        "1",
        "--max-jobs-kept",
        "3",
        "--job-ttl-s",
        "3600",
        pipeline={"step_time_s": 0.002},
    )
    done = poll(server, httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1}).json()["id"], "completed")
    async with open_realtime(server.ws) as ws:  # holds the only session
        holder = Realtime(ws)
        await holder.send({"type": "session.start", "prompt": "holder", "format": "raw"})
        await holder.until("video.start")
        waiting = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1})
        assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
        refused = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        await holder.send({"type": "session.stop"})
        await holder.rest()
    poll(server, waiting.json()["id"], "completed")
    third = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1})
    assert third.status_code == 202
    poll(server, third.json()["id"], "completed")
    # Three jobs kept: a fourth is refused rather than pushing the first one out.
    full = httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1})
    assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_jobs"
    assert 3000 < int(full.headers["retry-after"]) <= 3600  # when the oldest one expires
    assert httpx.get(f"{server.http}/v1/videos/{done['id']}/content").status_code == 200


def test_a_finished_job_expires_after_its_ttl(make_server):
    server = make_server("--job-ttl-s", "2", pipeline={"step_time_s": 0.002})  # time for a loaded machine to look
    job = poll(server, httpx.post(f"{server.http}/v1/videos", json={**JOB, "num_chunks": 1}).json()["id"], "completed")
    assert job["expires_at"] - job["completed_at"] in (1, 2, 3)  # completed_at + 2 s, each rounded down
    assert httpx.get(f"{server.http}/v1/videos/{job['id']}/content").status_code == 200
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.http}/v1/videos/{job['id']}").status_code != 404:  # the condition is time itself
        assert time.monotonic() < deadline, "the job outlived its ttl"
        time.sleep(0.1)
    assert httpx.get(f"{server.http}/v1/videos").json()["data"] == []


def test_the_api_docs_are_served_from_this_server_alone(server):
    page = httpx.get(f"{server.http}/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    links = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
    assert links and all(link.startswith("/docs/assets/") for link in links), links  # no CDN
    assert "http://" not in page.text and "https://" not in page.text
    for link in links:
        asset = httpx.get(f"{server.http}{link}")
        assert asset.status_code == 200 and len(asset.content) > 500, link
    assert httpx.get(f"{server.http}/openapi.json").json()["info"]["title"] == "rtvideo"
    assert httpx.get(f"{server.http}/redoc").status_code == 404
