"""The job store (rtvideo/server/job_store.py) on a real directory: records, videos
written chunk by chunk and renamed into place, pages, expiry, jobs cut short by
a restart, and one server per directory."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from rtvideo.server.job_store import INTERRUPTED, DataDirInUseError, JobStore, UnknownCursorError

TTL = 100.0


def body(job_id: str, status: str = "queued") -> dict:
    return {"id": job_id, "object": "video", "status": status, "completed_at": None, "expires_at": None, "error": None}


@pytest.fixture
async def store(tmp_path):
    opened = JobStore(tmp_path, TTL)
    await opened.open()
    yield opened
    await opened.close()


async def test_a_video_is_written_as_it_arrives_and_renamed_whole_when_complete(store, tmp_path):
    await store.insert("a", 1000.0, body("a"))
    await store.update("a", body("a", "in_progress"))
    await store.append("a", b"first ")
    part = tmp_path / "media" / "a.part"
    assert part.read_bytes() == b"first "  # on disk as it arrives, not held until the end
    await store.append("a", b"second")
    assert (await store.get("a")).status == "in_progress" and (await store.get("a")).media is None
    await store.finish("a", body("a", "completed"), completed_at=2000.0, suffix="mp4")
    stored = await store.get("a")
    assert stored.status == "completed" and stored.expires_at == 2000.0 + TTL
    assert stored.media == tmp_path / "media" / "a.mp4" and stored.media.read_bytes() == b"first second"
    assert not part.exists()


async def test_a_job_that_did_not_complete_keeps_no_video(store, tmp_path):
    await store.insert("a", 1000.0, body("a"))
    await store.append("a", b"half")
    failed = {**body("a", "failed"), "error": {"code": "pipeline_error", "message": "boom"}}
    await store.finish("a", failed, completed_at=2000.0, suffix=None)
    stored = await store.get("a")
    assert stored.status == "failed" and stored.media is None and stored.body["error"]["code"] == "pipeline_error"
    assert list((tmp_path / "media").iterdir()) == []


async def test_pages_follow_creation_order_with_a_cursor(store):
    ids = [f"v{i}" for i in range(5)]
    for job_id in ids:
        await store.insert(job_id, 1000.0, body(job_id))  # the same second: the order is still creation's
    newest, more = await store.page(limit=2)
    assert [j.id for j in newest] == ["v4", "v3"] and more
    rest, more = await store.page(after="v3", limit=2)
    assert [j.id for j in rest] == ["v2", "v1"] and more
    last, more = await store.page(after="v1", limit=2)
    assert [j.id for j in last] == ["v0"] and not more
    oldest, more = await store.page(limit=3, order="asc")
    assert [j.id for j in oldest] == ["v0", "v1", "v2"] and more
    assert [j.id for j in (await store.page(after="v2", limit=3, order="asc"))[0]] == ["v3", "v4"]
    with pytest.raises(UnknownCursorError):
        await store.page(after="gone")
    assert await store.count() == 5


async def test_expiry_deletes_records_and_videos(store, tmp_path):
    for job_id, completed_at in (("old", 1000.0), ("new", 1050.0)):
        await store.insert(job_id, 900.0, body(job_id))
        await store.append(job_id, b"x")
        await store.finish(job_id, body(job_id, "completed"), completed_at=completed_at, suffix="bin")
    await store.insert("running", 900.0, body("running", "in_progress"))  # never expires while unfinished
    assert await store.soonest_expiry() == 1000.0 + TTL
    assert await store.expire(now=1000.0 + TTL - 0.5) == []
    assert await store.expire(now=1000.0 + TTL) == ["old"]
    assert await store.get("old") is None and not (tmp_path / "media" / "old.bin").exists()
    assert (await store.get("new")).media.exists() and await store.count() == 2
    assert await store.expire(now=10**12) == ["new"]
    assert await store.get("running") is not None


async def test_delete_forgets_the_record_and_every_file(store, tmp_path):
    await store.insert("done", 1.0, body("done"))
    await store.append("done", b"x")
    await store.finish("done", body("done", "completed"), completed_at=2.0, suffix="mp4")
    await store.insert("running", 1.0, body("running"))
    await store.append("running", b"x")
    assert await store.delete("done") and await store.delete("running")
    assert not await store.delete("done")
    assert list((tmp_path / "media").iterdir()) == [] and await store.count() == 0
    # A job deleted while it ran, whose end arrives after: it stays deleted.
    await store.finish("running", body("running", "cancelled"), completed_at=3.0, suffix=None)
    assert await store.get("running") is None


async def test_a_restart_fails_unfinished_jobs_expires_old_ones_and_clears_stray_files(tmp_path):
    first = JobStore(tmp_path, TTL)
    await first.open()
    await first.insert("queued", 1000.0, body("queued"))
    await first.insert("running", 1000.0, body("running", "in_progress"))
    await first.append("running", b"partial")
    await first.insert("done", 1000.0, body("done"))
    await first.append("done", b"whole")
    await first.finish("done", body("done", "completed"), completed_at=1010.0, suffix="mp4")
    await first.insert("stale", 900.0, body("stale"))
    await first.finish("stale", body("stale", "failed"), completed_at=900.0, suffix=None)
    await first.close()  # as a crash would leave it: two jobs unfinished, a partial file
    (tmp_path / "media" / "stray.mp4").write_bytes(b"?")

    second = JobStore(tmp_path, TTL)
    await second.open()
    report = await second.recover(now=1020.0)
    try:
        assert sorted(report.interrupted) == ["queued", "running"]
        assert report.expired == 1 and report.orphans == 2  # stale; running.part and stray.mp4
        for job_id in ("queued", "running"):
            stored = await second.get(job_id)
            assert stored.status == "failed" and stored.body["status"] == "failed"
            assert stored.body["error"]["code"] == INTERRUPTED and stored.body["completed_at"] == 1020
            assert stored.expires_at == 1020.0 + TTL and stored.body["expires_at"] == int(1020.0 + TTL)
        assert (await second.get("done")).media.read_bytes() == b"whole"
        assert await second.get("stale") is None
        assert sorted(p.name for p in (tmp_path / "media").iterdir()) == ["done.mp4"]
        assert sqlite3.connect(tmp_path / "jobs.sqlite3").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        await second.close()


async def test_one_server_per_directory(store, tmp_path):
    other = JobStore(tmp_path, TTL)
    with pytest.raises(DataDirInUseError, match="in use by another rtvideo server"):
        await other.open()
    other._executor.shutdown()


async def test_the_event_loop_goes_on_while_the_store_works(store):
    """Every call runs on the store's own thread: the loop is free meanwhile."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await store.insert("a", 1.0, body("a"))
    for _ in range(50):
        await store.append("a", b"x" * 100_000)
    ticker.cancel()
    assert ticks > 10
