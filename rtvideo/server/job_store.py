"""Where ``/v1/videos`` jobs live: SQLite for their records, files for their videos.

API process, no torch. A ``JobStore`` owns one data directory::

    DATA_DIR/jobs.sqlite3      one row per job (WAL journal)
    DATA_DIR/media/ID.part     a video being made, each chunk appended as it arrives
    DATA_DIR/media/ID.EXT      a finished video (renamed from ID.part, atomically, once complete)
    DATA_DIR/lock              held (flock) by the one server that uses the directory

Every SQLite call and every file operation runs on one dedicated thread, so the
event loop never waits on the disk, and they happen in the order they were
asked (one thread, first in first out). A row keeps the job's public answer
(the ``VideoObject`` JSON) as of its latest state change, beside the columns
the queries need; the live progress of a running job is the job manager's.

Contracts:

- ``open()`` takes the directory for this process (another process holding it:
  ``DataDirInUseError``) and opens the database. ``recover(now)``, once the
  server is ready for requests, marks every job still ``queued`` or
  ``in_progress`` — cut short by the previous process's end, however it ended —
  ``failed`` with ``INTERRUPTED`` (finished ``now``: it is kept ``ttl_s`` from
  then), deletes the jobs that expired meanwhile, and deletes every media file
  no finished job owns (partial ``.part`` files included).
- A finished job expires ``ttl_s`` after it finished (``completed_at``,
  wall-clock Unix seconds, so it holds across restarts; ``ttl_s`` is this
  process's, so a server restarted with another ``job_ttl_s`` applies it to
  every job kept). ``expire(now)`` deletes the rows and files of those past it;
  the ``expires_at`` of every body read is ``completed_at + ttl_s``.
- ``page`` lists jobs by creation order (``seq``, never reused), newest first or
  oldest first, after a cursor job id.
- Disk and database failures surface as ``StoreError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

T = TypeVar("T")

INTERRUPTED = "interrupted_by_restart"
INTERRUPTED_MESSAGE = (
    "the server stopped (shut down or crashed) before this job finished; it was not resumed: post the request again"
)
UNFINISHED = ("queued", "in_progress")
SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order, never reused
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,                -- Unix seconds
    completed_at REAL,                       -- Unix seconds; NULL until the job finished
    media TEXT,                              -- the finished video's file name under media/, if any
    body TEXT NOT NULL                       -- the job's VideoObject JSON as of its latest state change
);
CREATE INDEX IF NOT EXISTS jobs_completed_at ON jobs (completed_at);
"""


class StoreError(Exception):
    """The data directory could not be read or written (disk full, permissions, a broken database)."""


class DataDirInUseError(StoreError):
    """Another process holds the data directory."""


class UnknownCursorError(StoreError):
    """``page(after=...)`` names a job the store does not hold (deleted, expired, or never made)."""


@dataclass(frozen=True)
class StoredJob:
    id: str
    status: str
    created_at: float
    completed_at: float | None
    expires_at: float | None  # completed_at + the store's ttl_s
    media: Path | None  # the finished video, when there is one
    body: dict[str, Any]  # the VideoObject JSON, its expires_at as above


@dataclass(frozen=True)
class Recovered:
    interrupted: list[str]  # jobs marked failed (INTERRUPTED)
    expired: int  # jobs deleted for having expired
    orphans: int  # media files deleted that no finished job owned


class JobStore:
    def __init__(self, data_dir: Path | str, ttl_s: float) -> None:
        self.data_dir = Path(data_dir)
        self.media_dir = self.data_dir / "media"
        self.ttl_s = ttl_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtvideo-job-store")
        # Touched only on the store's thread:
        self._db: sqlite3.Connection | None = None
        self._lock_file: BinaryIO | None = None
        self._writing: dict[str, BinaryIO] = {}  # job id -> its open .part file

    # -- the thread --------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except (sqlite3.Error, OSError) as error:
            raise StoreError(f"the job store at {self.data_dir}: {type(error).__name__}: {error}") from error

    # -- lifecycle ---------------------------------------------------------------

    async def open(self) -> None:
        await self._run(self._open)

    async def recover(self, now: float | None = None) -> Recovered:
        """What the previous process left: see the module's contract."""
        return await self._run(self._recover, time.time() if now is None else now)

    async def close(self) -> None:
        with contextlib.suppress(StoreError):
            await self._run(self._close)
        self._executor.shutdown(wait=True)

    def _open(self) -> None:
        self.media_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.data_dir / "lock", "a+b")  # noqa: SIM115 (held open for the process's life)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().decode(errors="replace").strip() or "?"
            lock.close()
            raise DataDirInUseError(
                f"data_dir {self.data_dir} is in use by another rtvideo server (pid {holder}); "
                "give each server its own (--data-dir or RTVIDEO_DATA_DIR)"
            ) from None
        lock.truncate(0)
        lock.write(str(os.getpid()).encode())
        lock.flush()
        self._lock_file = lock
        db = sqlite3.connect(self.data_dir / "jobs.sqlite3")  # `with db:` is one transaction
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            found = f"{self.data_dir}/jobs.sqlite3 has schema version {version}"
            raise StoreError(f"{found}; this server reads {SCHEMA_VERSION}")
        self._db = db

    def _recover(self, now: float) -> Recovered:
        interrupted = self._interrupt_unfinished(now)
        expired = len(self._expire(now))
        return Recovered(interrupted=interrupted, expired=expired, orphans=self._delete_orphans())

    def _close(self) -> None:
        for handle in self._writing.values():
            handle.close()
        self._writing.clear()
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _interrupt_unfinished(self, now: float) -> list[str]:
        db = self._conn()
        rows = db.execute("SELECT id, body FROM jobs WHERE status IN (?, ?)", UNFINISHED).fetchall()
        with db:
            for row in rows:
                body = json.loads(row["body"])
                body.update(
                    status="failed", error={"code": INTERRUPTED, "message": INTERRUPTED_MESSAGE}, completed_at=int(now)
                )
                db.execute(
                    "UPDATE jobs SET status = 'failed', completed_at = ?, media = NULL, body = ? WHERE id = ?",
                    (now, json.dumps(body), row["id"]),
                )
        return [row["id"] for row in rows]

    def _delete_orphans(self) -> int:
        owned = {row["media"] for row in self._conn().execute("SELECT media FROM jobs WHERE media IS NOT NULL")}
        deleted = 0
        for path in self.media_dir.iterdir():
            if path.name not in owned and path.name not in {f"{i}.part" for i in self._writing}:
                path.unlink(missing_ok=True)
                deleted += 1
        return deleted

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise sqlite3.ProgrammingError("the job store is not open")
        return self._db

    # -- records -----------------------------------------------------------------

    async def insert(self, job_id: str, created_at: float, body: dict[str, Any]) -> None:
        """A new job, ``body["status"]`` its status (queued or in_progress)."""
        await self._run(self._insert, job_id, created_at, body)

    def _insert(self, job_id: str, created_at: float, body: dict[str, Any]) -> None:
        with self._conn() as db:
            db.execute(
                "INSERT INTO jobs (id, status, created_at, body) VALUES (?, ?, ?, ?)",
                (job_id, body["status"], created_at, json.dumps(body)),
            )

    async def update(self, job_id: str, body: dict[str, Any]) -> None:
        """A state change of an unfinished job (``body["status"]``)."""
        await self._run(self._update, job_id, body)

    def _update(self, job_id: str, body: dict[str, Any]) -> None:
        with self._conn() as db:
            db.execute("UPDATE jobs SET status = ?, body = ? WHERE id = ?", (body["status"], json.dumps(body), job_id))

    async def append(self, job_id: str, data: bytes) -> None:
        """Append to the job's video, in ``media/ID.part`` until ``finish``."""
        await self._run(self._append, job_id, data)

    def _append(self, job_id: str, data: bytes) -> None:
        handle = self._writing.get(job_id)
        if handle is None:
            # Unbuffered: each chunk (large) goes to the OS as it arrives.
            handle = self._writing[job_id] = open(self.media_dir / f"{job_id}.part", "wb", buffering=0)  # noqa: SIM115
        handle.write(data)

    async def finish(self, job_id: str, body: dict[str, Any], completed_at: float, suffix: str | None) -> None:
        """The job ended: its record becomes ``body`` and expires ``ttl_s`` after
        ``completed_at``. With ``suffix`` its video is complete: flushed to disk and
        renamed ``media/ID.SUFFIX`` before the record says so; without, the partial
        video is deleted. A job deleted meanwhile stays deleted."""
        await self._run(self._finish, job_id, body, completed_at, suffix)

    def _finish(self, job_id: str, body: dict[str, Any], completed_at: float, suffix: str | None) -> None:
        part = self.media_dir / f"{job_id}.part"
        handle = self._writing.pop(job_id, None)
        media = None
        if handle is not None:
            if suffix is not None:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()
        if suffix is not None:
            if handle is None:  # a video of no chunks: an empty file all the same
                part.touch()
            media = f"{job_id}.{suffix}"
            os.replace(part, self.media_dir / media)
        else:
            part.unlink(missing_ok=True)
        with self._conn() as db:
            changed = db.execute(
                "UPDATE jobs SET status = ?, completed_at = ?, media = ?, body = ? WHERE id = ?",
                (body["status"], completed_at, media, json.dumps(body), job_id),
            ).rowcount
        if not changed and media is not None:  # deleted while it ran
            (self.media_dir / media).unlink(missing_ok=True)

    async def get(self, job_id: str) -> StoredJob | None:
        return await self._run(self._get, job_id)

    def _get(self, job_id: str) -> StoredJob | None:
        row = self._conn().execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._stored(row)

    def _stored(self, row: sqlite3.Row) -> StoredJob:
        completed_at = row["completed_at"]
        expires_at = None if completed_at is None else completed_at + self.ttl_s
        body = json.loads(row["body"])
        body["expires_at"] = None if expires_at is None else int(expires_at)
        return StoredJob(
            id=row["id"],
            status=row["status"],
            created_at=row["created_at"],
            completed_at=completed_at,
            expires_at=expires_at,
            media=None if row["media"] is None else self.media_dir / row["media"],
            body=body,
        )

    async def page(
        self, after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc"
    ) -> tuple[list[StoredJob], bool]:
        """Up to ``limit`` jobs in creation order (``desc``: newest first) that come
        after the job ``after`` in that order, and whether more follow.
        ``UnknownCursorError`` when the store does not hold ``after``."""
        return await self._run(self._page, after, limit, order)

    def _page(self, after: str | None, limit: int, order: str) -> tuple[list[StoredJob], bool]:
        db = self._conn()
        direction, compare = ("DESC", "<") if order == "desc" else ("ASC", ">")
        where, args = "", []
        if after is not None:
            cursor = db.execute("SELECT seq FROM jobs WHERE id = ?", (after,)).fetchone()
            if cursor is None:
                raise UnknownCursorError(after)
            where, args = f"WHERE seq {compare} ?", [cursor["seq"]]
        rows = db.execute(f"SELECT * FROM jobs {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)).fetchall()
        return [self._stored(row) for row in rows[:limit]], len(rows) > limit

    async def count(self) -> int:
        """Jobs kept: queued, running, or finished and not expired (nor deleted)."""
        return await self._run(lambda: self._conn().execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    async def soonest_expiry(self) -> float | None:
        """When the first finished job expires (Unix seconds); None when none has finished."""
        first = await self._run(lambda: self._conn().execute("SELECT MIN(completed_at) FROM jobs").fetchone()[0])
        return None if first is None else first + self.ttl_s

    async def delete(self, job_id: str) -> bool:
        """Forget the job and delete its video (partial or finished); False if it was not kept."""
        return await self._run(self._delete, job_id)

    def _delete(self, job_id: str) -> bool:
        handle = self._writing.pop(job_id, None)
        if handle is not None:
            handle.close()
        (self.media_dir / f"{job_id}.part").unlink(missing_ok=True)
        db = self._conn()
        row = db.execute("SELECT media FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return False
        with db:
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        if row["media"] is not None:
            (self.media_dir / row["media"]).unlink(missing_ok=True)
        return True

    async def expire(self, now: float | None = None) -> list[str]:
        """Delete the jobs whose ``expires_at`` is past (records and videos); their ids."""
        return await self._run(self._expire, time.time() if now is None else now)

    def _expire(self, now: float) -> list[str]:
        db = self._conn()
        rows = db.execute("SELECT id, media FROM jobs WHERE completed_at <= ?", (now - self.ttl_s,)).fetchall()
        if rows:
            with db:
                db.executemany("DELETE FROM jobs WHERE id = ?", [(row["id"],) for row in rows])
            for row in rows:
                if row["media"] is not None:
                    (self.media_dir / row["media"]).unlink(missing_ok=True)
        return [row["id"] for row in rows]
