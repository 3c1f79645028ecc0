"""Jobs outlast the server: three ``rtvideo serve`` processes, one after the
other, on one data directory.

The first finishes a job and is stopped (SIGTERM) while a second job runs; the
next one lists the finished job and serves its video byte for byte, and reads
the cut-short job ``failed`` with ``interrupted_by_restart``; it is killed
(SIGKILL) under a third job, which the last one, started with a short
``job_ttl_s``, reads failed the same way; then expiry deletes every record and
file.
"""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.e2e.conftest import start_server, stop_server

STUB = {"step_time_s": 0.01}
LONG = {"prompt": "a long one", "num_frames": 4800, "format": "raw"}  # the most: minutes at these steps


def wait_for(http: str, video_id: str, done, within: float = 30.0) -> httpx.Response:
    """Poll the video until ``done(answer)``; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not done(answer := httpx.get(f"{http}/v1/videos/{video_id}")):
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.02)
    return answer


def wait_until(done, within: float = 30.0) -> None:
    """Poll ``done()`` until true; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def status_is(*statuses: str):
    return lambda answer: answer.status_code == 200 and answer.json()["status"] in statuses


def test_jobs_survive_restarts_and_expire(tmp_path):
    data = ["--data-dir", str(tmp_path)]
    first = start_server(*data, "--shutdown-grace-s", "0.2", pipeline=STUB)
    try:
        body = {"prompt": "a paper boat", "num_chunks": 3, "interactions": [{"at_chunk": 1, "prompt": "a storm"}]}
        done_id = httpx.post(f"{first.http}/v1/videos", json=body).json()["id"]
        done = wait_for(first.http, done_id, status_is("completed")).json()
        content = httpx.get(f"{first.http}/v1/videos/{done_id}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        cut_id = httpx.post(f"{first.http}/v1/videos", json=LONG).json()["id"]
        wait_for(first.http, cut_id, status_is("in_progress"))
    finally:
        assert stop_server(first) == 0  # drained: the running job is stopped at the grace's end

    second = start_server(*data, pipeline=STUB)
    try:
        listed = httpx.get(f"{second.http}/v1/videos").json()
        assert [job["id"] for job in listed["data"]] == [cut_id, done_id] and not listed["has_more"]
        assert httpx.get(f"{second.http}/v1/videos/{done_id}").json() == done
        again = httpx.get(f"{second.http}/v1/videos/{done_id}/content")
        assert again.content == content.content and again.headers["content-type"] == "video/mp4"
        cut = httpx.get(f"{second.http}/v1/videos/{cut_id}").json()
        assert cut["status"] == "failed" and cut["error"]["code"] == "interrupted_by_restart", cut
        assert httpx.get(f"{second.http}/v1/videos/{cut_id}/content").status_code == 409
        killed_id = httpx.post(f"{second.http}/v1/videos", json=LONG).json()["id"]
        wait_for(second.http, killed_id, status_is("in_progress"))
        part = tmp_path / "media" / f"{killed_id}.part"
        wait_until(lambda: part.exists() and part.stat().st_size > 0)  # its first chunk is on disk
        worker = second.health()["workers"][0]["pid"]
    finally:
        second.process.kill()  # no drain, no goodbye: as a crash
        second.process.wait()
    try:
        os.kill(worker, signal.SIGKILL)  # its worker would notice its parent gone; do not wait for it
    except ProcessLookupError:
        pass
    assert part.exists()  # its video so far, left behind

    last = start_server(*data, "--job-ttl-s", "3", pipeline=STUB)
    try:
        killed = httpx.get(f"{last.http}/v1/videos/{killed_id}").json()
        assert killed["status"] == "failed" and killed["error"]["code"] == "interrupted_by_restart", killed
        assert killed["expires_at"] == killed["completed_at"] + 3  # from when the server was back up
        assert not (tmp_path / "media" / f"{killed_id}.part").exists()  # nothing to serve: deleted at start
        for video_id in (done_id, cut_id, killed_id):  # each 3 s after it finished (the first two: at start)
            wait_for(last.http, video_id, lambda answer: answer.status_code == 404, within=15)
        assert httpx.get(f"{last.http}/v1/videos").json() == {
            "object": "list",
            "data": [],
            "first_id": None,
            "last_id": None,
            "has_more": False,
        }
        assert list((tmp_path / "media").iterdir()) == []
    finally:
        stop_server(last)
