"""HTTP request mode: ``/v1/videos`` jobs over the same engine sessions.

API process. A job is a finite session whose prompt changes are scheduled in
advance; its chunks are encoded as they arrive and kept in memory until the
job is deleted or ``job_ttl_s`` after it finished, never pushed out earlier by
other clients' jobs. A job waits (``queued``) while the engine is full and
starts when a session ends. The work is bounded: at most ``max_jobs_kept``
jobs at once (queued, running, or finished and kept) and ``max_queued_jobs``
waiting for the engine; beyond either a new job is refused (``JobsFullError``,
HTTP 429 with ``Retry-After``) before anything is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.client import (
    EngineClient,
    EngineDeadError,
    EngineRestartingError,
    SessionHandle,
    SessionRejectedError,
    UnknownSessionError,
)
from engine.messages import (
    ChunkReady,
    InteractionApplied,
    InteractionRejected,
    InteractionSuperseded,
    SessionDone,
    SessionFailed,
    StartSession,
)
from server.drain import Drainer
from server.metrics import Metrics
from server.output import SessionOutput
from server.schemas import EffectiveConfig, JobRequest, RequestError, VideoObject, resolve
from server.settings import ServerSettings

log = logging.getLogger(__name__)
CAPACITY_RETRY_S = 1.0  # a queued job retries its start at least this often


@dataclass
class Job:
    id: str
    request: JobRequest
    config: EffectiveConfig
    created_at: float = field(default_factory=time.time)
    status: str = "queued"  # queued / in_progress / completed / failed / cancelled
    chunks_done: int = 0
    completed_at: float | None = None
    error: dict[str, str] | None = None
    payloads: list[bytes] = field(default_factory=list)
    compute_ms: float = 0.0
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # scheduled event id -> where it landed
    inexact_reason: str | None = None  # why its request would not regenerate the same bytes (None: it would)
    waiting: bool = False  # queued for want of an engine session (max_queued_jobs counts these)
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def content(self) -> bytes:
        return b"".join(self.payloads)

    def public(self) -> VideoObject:
        """The job as the API answers it (``VideoObject``, the schema /openapi.json documents)."""
        total = self.config.num_chunks
        progress = 100 if self.status == "completed" else int(100 * self.chunks_done / total)
        return VideoObject(
            id=self.id,
            object="video",
            model=self.config.model,
            status=self.status,
            progress=progress,
            created_at=int(self.created_at),
            completed_at=None if self.completed_at is None else int(self.completed_at),
            error=self.error,
            format=self.config.format,
            num_frames=self.config.num_frames,
            num_chunks=total,
            width=self.config.width,
            height=self.config.height,
            fps=self.config.fps,
            seed=self.config.seed,
            prompt=self.config.prompt,
            interactions=[
                {
                    "at_chunk": item.at_chunk,
                    "prompt": item.prompt,
                    "transition_chunks": item.transition_chunks,
                    **self.outcomes.get(f"scheduled-{i}", {"status": "pending"}),
                }
                for i, item in enumerate(self.request.interactions)
            ],
            inference_time_s=self.compute_ms / 1000.0,
            exact=self.inexact_reason is None,
            inexact_reason=self.inexact_reason,
        )

    def record(self, message: Any) -> None:
        """Where a scheduled prompt landed (applied: chunk, first frame, media time) or why not."""
        if isinstance(message, InteractionApplied):
            self.outcomes[message.event_id] = {
                "status": "applied",
                "generation_chunk_index": message.generation_chunk_index,
                "first_frame_index": message.first_frame_index,
                "media_start_seconds": message.media_start_seconds,
            }
        elif isinstance(message, InteractionSuperseded):
            self.outcomes[message.event_id] = {"status": "superseded", "by_event_id": message.by_event_id}
        elif isinstance(message, InteractionRejected):
            error = {"code": message.code, "message": message.message}
            self.outcomes[message.event_id] = {"status": "rejected", "error": error}


class JobsFullError(Exception):
    """No room for another job now; try again after ``retry_after_s``."""

    def __init__(self, code: str, message: str, retry_after_s: float) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class JobManager:
    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        model: str,
        capacity: asyncio.Condition,
        metrics: Metrics,
        drainer: Drainer,
    ) -> None:
        self.engine = engine
        self.drainer = drainer
        self.metrics = metrics
        self.settings = settings
        self.model = model
        self.capacity = capacity  # notified whenever a session ends anywhere
        self.jobs: dict[str, Job] = {}
        self._starting = 0  # creates past the kept-jobs check, waiting on the engine's answer

    async def create(self, request: JobRequest) -> Job:
        """Validate and start a job; ``RequestError`` names what is wrong. The
        first start attempt happens here, so the worker's own checks (sizes,
        steps) refuse a bad request at once; a full engine leaves it queued."""
        if request.num_frames is None and request.num_chunks is None and request.seconds is None:
            raise RequestError("num_frames: a job needs a length (num_frames, num_chunks or seconds)")
        if (unavailable := self.engine.unavailable()) is not None:
            raise unavailable  # answered 503 before anything is kept
        self.expire()
        # Counted with the creates still waiting on the engine (the await below), so a
        # burst of concurrent requests cannot all pass the check before any is kept.
        kept = len(self.jobs) + self._starting
        if kept >= self.settings.max_jobs_kept:
            raise JobsFullError(
                "too_many_jobs",
                f"{kept} jobs are kept (queued, running, or finished less than "
                f"{self.settings.job_ttl_s:g} s ago); at most {self.settings.max_jobs_kept}",
                self._soonest_expiry_s(),
            )
        job_id = f"video_{uuid.uuid4().hex}"
        start, config = resolve(request, job_id, self.engine.ready.defaults, self.settings, self.model, paced=False)
        handle = None
        self._starting += 1
        try:
            handle = await self.engine.start_session(start)
        except SessionRejectedError as error:
            if error.code != "server_full":
                raise RequestError(error.message) from None
            waiting = sum(1 for j in self.jobs.values() if j.waiting)
            if waiting >= self.settings.max_queued_jobs:
                limit = self.settings.max_queued_jobs
                message = f"{waiting} jobs wait for the engine already; at most {limit}"
                raise JobsFullError("queue_full", message, CAPACITY_RETRY_S) from None
        finally:
            self._starting -= 1
        job = Job(job_id, request, config, waiting=handle is None)
        self.jobs[job_id] = job
        job.task = asyncio.create_task(self._run(job, start, handle), name=f"job-{job_id}")
        return job

    async def cancel(self, job_id: str) -> Job:
        job = self.jobs.pop(job_id)
        if job.task is not None and not job.task.done():
            with contextlib.suppress(EngineDeadError, UnknownSessionError):
                await self.engine.stop(job_id, "cancelled")
            job.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await job.task
        return job

    async def _run(self, job: Job, start: StartSession, handle: SessionHandle | None) -> None:
        try:
            await self._generate(job, start, handle)
        except asyncio.CancelledError:
            job.status = "cancelled"
            raise
        except EngineDeadError as error:
            self._fail(job, "engine_unavailable", str(error))
        except Exception as error:  # an encoder or server bug fails this job, not the server
            log.exception("job %s failed", job.id)
            self._fail(job, "internal_error", f"{type(error).__name__}: {error}")
        finally:
            job.waiting = False
            job.completed_at = job.completed_at or time.time()
            job.finished.set()
            self.metrics.jobs.labels(job.status).inc()

    async def _generate(self, job: Job, start: StartSession, handle: SessionHandle | None) -> None:
        while handle is None:
            # Wait for a session to end, then try again; the timeout covers an end
            # that happened between the refusal and this wait.
            with contextlib.suppress(TimeoutError):
                async with self.capacity:
                    await asyncio.wait_for(self.capacity.wait(), CAPACITY_RETRY_S)
            if self.drainer.draining:
                return self._fail(job, "shutting_down", "the server shut down before this job could start")
            try:
                handle = await self.engine.start_session(start)
            except SessionRejectedError as error:
                if error.code != "server_full":
                    return self._fail(job, error.code, error.message)
            except EngineRestartingError:
                pass  # a queued job outlives a worker restart: try again once it is up
        job.waiting = False
        job.status = "in_progress"
        output = SessionOutput(job.id, job.config, self.metrics)
        try:
            async with asyncio.timeout(self.settings.max_session_seconds):
                async for message in handle:
                    if isinstance(message, ChunkReady):
                        chunk = await output.chunk(message)
                        if chunk is not None:
                            job.payloads.append(chunk.payload)
                            job.chunks_done += 1
                            job.compute_ms = output.compute_ms
                            job.inexact_reason = output.inexact_reason
                    else:
                        output.count(message)  # on /metrics as a realtime session's would be
                        job.record(message)
                    if isinstance(message, SessionDone):
                        job.status = "completed" if message.reason == "completed" else "cancelled"
                    elif isinstance(message, SessionFailed):
                        self._fail(job, message.code, message.message)
        except TimeoutError:
            await self.engine.stop(job.id, "max_duration")
            self._fail(job, "max_duration", f"the job ran longer than {self.settings.max_session_seconds:g} s")
        finally:
            if not handle.finished:
                await _stop_and_drain(self.engine, handle)
            async with self.capacity:
                self.capacity.notify_all()
        job.completed_at = time.time()

    @staticmethod
    def _fail(job: Job, code: str, message: str) -> None:
        job.status = "failed"
        job.error = {"code": code, "message": message}

    def expire(self) -> None:
        """Forget finished jobs kept for ``job_ttl_s`` already."""
        now = time.time()
        for job in [j for j in self.jobs.values() if j.finished.is_set()]:
            if now - (job.completed_at or now) >= self.settings.job_ttl_s:
                del self.jobs[job.id]

    def _soonest_expiry_s(self) -> float:
        """Seconds until a kept job expires (a fair Retry-After when the store is full)."""
        now = time.time()
        ends = [j.completed_at + self.settings.job_ttl_s - now for j in self.jobs.values() if j.finished.is_set()]
        return max(1.0, min(ends)) if ends else CAPACITY_RETRY_S


async def _stop_and_drain(engine: EngineClient, handle: SessionHandle) -> None:
    """Stop a session we stopped reading, and read it to its end so nothing lingers."""
    with contextlib.suppress(EngineDeadError, UnknownSessionError):
        await engine.stop(handle.session_id, "cancelled")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30.0):
            async for _ in handle:
                pass
