"""HTTP request mode: ``/v1/videos`` jobs over the same engine sessions.

API process. A job is a finite session whose prompt changes are scheduled in
advance. Jobs live in a ``JobStore`` (``rtvideo/server/job_store.py``: SQLite records
and video files in ``data_dir``), so they outlast a restart: each chunk is
encoded as it arrives and appended to the job's file (never held whole in
memory), and the finished video is renamed into place once complete. A job
stays until it is deleted or ``job_ttl_s`` after it finished (its record and
file are then deleted, across restarts too), never pushed out earlier by
other clients' jobs. A job that was queued or running when the server
stopped, however it stopped, reads ``failed`` with ``interrupted_by_restart``
(``INTERRUPTED``) afterwards; none is resumed.

A job waits (``queued``) while the engine is full and starts when a session
ends. The work is bounded: at most ``max_jobs_kept`` jobs at once (queued,
running, or finished and kept) and ``max_queued_jobs`` waiting for the engine;
beyond either a new job is refused (``JobsFullError``, HTTP 429 with
``Retry-After``) before anything is kept.

The jobs running here are ``live`` (in memory: their progress is read there);
every other job is read from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import (
    EngineDeadError,
    EngineRestartingError,
    SessionRejectedError,
    UnknownSessionError,
)
from rtvideo.engine.client.session_handle import SessionHandle
from rtvideo.engine.messages import (
    ChunkReady,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    SessionDone,
    SessionFailed,
    StartSession,
    VideoInput,
)
from rtvideo.server.dispatch import TypeDispatcher
from rtvideo.server.drain import Drainer
from rtvideo.server.job_store import INTERRUPTED, INTERRUPTED_MESSAGE, JobStore, StoredJob, UnknownCursorError
from rtvideo.server.metrics import Metrics
from rtvideo.server.output import SessionOutput
from rtvideo.server.prompt_policy import PromptPolicy, PromptRefused
from rtvideo.server.schemas import (
    DEFAULT_INPUT_STRENGTH,
    DEFAULT_JOB_SECONDS,
    EffectiveConfig,
    JobRequest,
    RequestError,
    VideoList,
    VideoObject,
    resolve,
)
from rtvideo.server.settings import ServerSettings
from rtvideo.server.video_reference import ReferenceDecoder, ReferenceFeeder, ReferenceVideo

log = logging.getLogger(__name__)
CAPACITY_RETRY_S = 1.0  # a queued job retries its start at least this often
SUFFIXES = {"fmp4": "mp4", "jpeg": "bin", "raw": "bin"}  # a finished video's file name: ID.SUFFIX
CLOSE_WAIT_S = 10.0  # at shutdown, how long the running jobs' tasks get to end


@dataclass
class Job:
    """A job queued or running in this process (``JobManager.live``)."""

    id: str
    request: JobRequest
    config: EffectiveConfig
    ttl_s: float
    created_at: float = field(default_factory=time.time)
    status: str = "queued"  # queued / in_progress / completed / failed / cancelled
    chunks_done: int = 0
    completed_at: float | None = None
    error: dict[str, str] | None = None
    compute_ms: float = 0.0
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # scheduled event id -> where it landed
    inexact_reason: str | None = None  # why its request would not regenerate the same bytes (None: it would)
    waiting: bool = False  # queued for want of an engine session (max_queued_jobs counts these)
    task: asyncio.Task | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # set once its end is in the store
    reference: ReferenceVideo | None = None  # its input video (video to video), checked; None: from the prompt
    # Where a scheduled prompt landed, by the outcome's type: one entry per outcome (``record``).
    _outcomes: TypeDispatcher[dict[str, Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._outcomes = TypeDispatcher(
            "Job outcome",
            {
                InteractionApplied: self._applied,
                InteractionSuperseded: self._superseded,
                InteractionRejected: self._rejected,
            },
        )

    def public(self, final: bool = False) -> VideoObject:
        """The job as the API answers it (``VideoObject``, the schema /openapi.json
        documents). It reads ``completed`` only once its video is in the store
        (``finished``), or ``final``: what is stored as it finishes."""
        c = self.config
        total = c.num_chunks
        status = self.status
        if status == "completed" and not (final or self.finished.is_set()):
            status = "in_progress"  # the last chunk is in; the video is being renamed into place
        progress = 100 if self.status == "completed" else int(100 * self.chunks_done / total)
        return VideoObject(
            id=self.id,
            object="video",
            model=c.model,
            status=status,
            progress=progress,
            created_at=int(self.created_at),
            completed_at=None if self.completed_at is None else int(self.completed_at),
            expires_at=None if self.completed_at is None else int(self.completed_at + self.ttl_s),
            error=self.error,
            seconds=f"{c.num_frames / c.fps:g}",
            size=f"{c.width}x{c.height}",
            format=c.format,
            num_frames=c.num_frames,
            num_chunks=total,
            width=c.width,
            height=c.height,
            fps=c.fps,
            seed=c.seed,
            prompt=c.prompt,
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
            input_strength=None if c.input is None else c.input["strength"],
        )

    def body(self, final: bool = False) -> dict[str, Any]:
        """``public()`` as the store keeps it (JSON)."""
        return self.public(final).model_dump(mode="json")

    def record(self, message: InteractionApplied | InteractionSuperseded | InteractionRejected) -> None:
        """Where a scheduled prompt landed (applied: chunk, first frame, media time) or
        why not, by the outcome's type; ``UnhandledMessageError`` for any other type."""
        self.outcomes[message.event_id] = self._outcomes(message)

    def fail(self, code: str, message: str) -> None:
        """The job failed: ``code`` and ``message`` are its ``error``."""
        self.status = "failed"
        self.error = {"code": code, "message": message}

    @staticmethod
    def _applied(message: InteractionApplied) -> dict[str, Any]:
        return {
            "status": "applied",
            "generation_chunk_index": message.generation_chunk_index,
            "first_frame_index": message.first_frame_index,
            "media_start_seconds": message.media_start_seconds,
        }

    @staticmethod
    def _superseded(message: InteractionSuperseded) -> dict[str, Any]:
        return {"status": "superseded", "by_event_id": message.by_event_id}

    @staticmethod
    def _rejected(message: InteractionRejected) -> dict[str, Any]:
        return {"status": "rejected", "error": {"code": message.code, "message": message.message}}


class JobRun:
    """A job's engine session as it runs: each result it yields (``result``), by
    its type, to the job, its video file in the ``store`` and /metrics (through
    ``output``, as a realtime session's). ``feeder``: its input video's, told
    each chunk made. A type that is no session result raises
    ``UnhandledMessageError`` naming it (the job then fails, ``internal_error``)."""

    def __init__(self, job: Job, output: SessionOutput, store: JobStore, feeder: ReferenceFeeder | None) -> None:
        self.job = job
        self.output = output
        self.store = store
        self.feeder = feeder
        # What a session's handle yields, by type: one entry per result.
        self._results: TypeDispatcher[Awaitable[None]] = TypeDispatcher(
            "JobRun result",
            {
                ChunkReady: self._on_chunk,
                InteractionQueued: self._on_queued,
                InteractionApplied: self._on_outcome,
                InteractionSuperseded: self._on_outcome,
                InteractionRejected: self._on_outcome,
                SessionDone: self._on_done,
                SessionFailed: self._on_failed,
            },
        )

    async def result(self, message: Any) -> None:
        """One engine result of the job's session, by its type (``_results``)."""
        await self._results(message)

    async def _on_chunk(self, message: ChunkReady) -> None:
        """Encode the chunk and append it to the job's file (none past ``num_frames``)."""
        if self.feeder is not None:
            self.feeder.made(message.generation_chunk_index)
        chunk = await self.output.chunk(message)
        if chunk is not None:
            job = self.job
            await self.store.append(job.id, chunk.payload)
            job.chunks_done += 1
            job.compute_ms = self.output.compute_ms
            job.inexact_reason = self.output.inexact_reason

    async def _on_queued(self, message: InteractionQueued) -> None:
        self.output.count(message)  # on /metrics as a realtime session's would be

    async def _on_outcome(self, message: InteractionApplied | InteractionSuperseded | InteractionRejected) -> None:
        self.output.count(message)
        self.job.record(message)

    async def _on_done(self, message: SessionDone) -> None:
        self.output.count(message)
        if message.reason == "completed":
            self.job.status = "completed"
        elif message.reason in ("shutdown", "parent_exited"):  # the server drained or stops
            self.job.fail(INTERRUPTED, INTERRUPTED_MESSAGE)
        else:
            self.job.status = "cancelled"

    async def _on_failed(self, message: SessionFailed) -> None:
        self.output.count(message)
        log.warning("job %s failed: %s: %s", self.job.id, message.code, message.message)
        self.job.fail(message.code, message.message)


class JobsFullError(Exception):
    """No room for another job now; try again after ``retry_after_s``."""

    def __init__(self, code: str, message: str, retry_after_s: float) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


class UnknownJobError(KeyError):
    """No such job: never made, deleted, or expired."""


class JobManager:
    """The jobs: the ones running here (``live``) and the ``store`` of all kept.
    ``open()`` before the first request, ``close()`` at shutdown."""

    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        model: str,
        capacity: asyncio.Condition,
        metrics: Metrics,
        drainer: Drainer,
        store: JobStore,
        prompt_policy: PromptPolicy | None = None,
    ) -> None:
        self.engine = engine
        self.prompt_policy = prompt_policy
        self.drainer = drainer
        self.metrics = metrics
        self.settings = settings
        self.model = model
        self.capacity = capacity  # notified whenever a session ends anywhere
        self.store = store
        self.live: dict[str, Job] = {}
        self._starting = 0  # creates past the kept-jobs check, not yet in the store
        self._admission = asyncio.Lock()  # the kept-jobs check and _starting, together
        self._closing = False
        self._deleting: set[str] = set()  # jobs a DELETE is ending: not kept for anyone else
        self._sweeper: asyncio.Task | None = None
        self._decoder = ReferenceDecoder()  # input videos' decodes, on threads of their own

    async def open(self) -> None:
        """Once the server is ready: fail the jobs the previous process left
        unfinished (``INTERRUPTED``, kept ``job_ttl_s`` from now), delete the
        expired ones, and start expiring jobs in the background."""
        found = await self.store.recover()
        log.info(
            "jobs in %s: %d interrupted by the restart (now failed: %s), %d expired, %d stray files removed",
            self.store.data_dir.resolve(),
            len(found.interrupted),
            INTERRUPTED,
            found.expired,
            found.orphans,
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="jobs-expiry")

    async def close(self) -> None:
        """Shutdown: end the jobs still running here (each is kept ``failed``
        with ``INTERRUPTED``), stop expiring, close the store."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [job.task for job in self.live.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        self._decoder.close()
        await self.store.close()

    async def _sweep(self) -> None:
        interval = min(60.0, self.settings.job_ttl_s / 2)
        while True:
            await asyncio.sleep(interval)  # a period, not a synchronisation: expiry is also checked on every read
            try:
                await self.store.expire()
            except Exception:
                log.exception("expiring jobs failed; trying again in %g s", interval)

    async def create(self, request: JobRequest, reference: bytes | None = None) -> Job:
        """Validate and start a job (``DEFAULT_JOB_SECONDS`` long when the request
        gives no length, the input video's length with a ``reference``: the bytes of
        its ``input_reference`` file, ``with_reference``); ``RequestError`` names
        what is wrong, ``PromptRefused`` a prompt the prompt policy refuses. The
        first start attempt happens here, so the worker's own checks (sizes,
        steps) refuse a bad request at once; a full engine leaves it queued.
        The job is in the store (``queued``) when this returns."""
        if (unavailable := self.engine.unavailable()) is not None:
            raise unavailable  # answered 503 before anything is kept
        if self.prompt_policy is not None:
            try:
                await self.prompt_policy.check(job_prompts(request))
            except PromptRefused:
                self.metrics.prompts_refused.labels("job").inc()
                raise
        # Counted with the creates still on their way to the store (the awaits below), so
        # a burst of concurrent requests cannot all pass the check before any is kept.
        async with self._admission:
            await self.store.expire()
            kept = await self.store.count() + self._starting
            if kept >= self.settings.max_jobs_kept:
                raise JobsFullError(
                    "too_many_jobs",
                    f"{kept} jobs are kept (queued, running, or finished less than "
                    f"{self.settings.job_ttl_s:g} s ago); at most {self.settings.max_jobs_kept}",
                    await self._soonest_expiry_s(),
                )
            self._starting += 1
        try:
            job_id = f"video_{uuid.uuid4().hex}"
            defaults = self.engine.ready.defaults
            # With an input video and no length, the video's own is the job's (``with_reference``),
            # held to max_frames there: the 4 s default is not this job's.
            default_seconds = None if reference is not None else DEFAULT_JOB_SECONDS
            start, config = resolve(
                request, job_id, defaults, self.settings, self.model, paced=False, default_seconds=default_seconds
            )
            video = None
            if reference is not None:
                start, config, video = await self.with_reference(request, reference, job_id, config)
            elif request.input_strength is not None:
                raise RequestError(
                    "input_strength: given without input_reference (the input video it is the strength of)"
                )
            handle = None
            try:
                handle = await self.engine.start_session(start)
            except SessionRejectedError as error:
                if error.code != "server_full":
                    raise RequestError(error.message) from None
                waiting = sum(1 for j in self.live.values() if j.waiting)
                if waiting >= self.settings.max_queued_jobs:
                    limit = self.settings.max_queued_jobs
                    message = f"{waiting} jobs wait for the engine already; at most {limit}"
                    raise JobsFullError("queue_full", message, CAPACITY_RETRY_S) from None
            job = Job(job_id, request, config, self.settings.job_ttl_s, waiting=handle is None, reference=video)
            self.live[job_id] = job  # now: the next create's waiting count sees it
            try:
                await self.store.insert(job.id, job.created_at, job.body())
            except BaseException:
                del self.live[job_id]
                if handle is not None:
                    await _stop_and_drain(self.engine, handle)
                raise
        finally:
            self._starting -= 1
        job.task = asyncio.create_task(self._run(job, start, handle), name=f"job-{job_id}")
        return job

    async def with_reference(
        self, request: JobRequest, reference: bytes, job_id: str, config: EffectiveConfig
    ) -> tuple[StartSession, EffectiveConfig, ReferenceVideo]:
        """A job with an input video: the file decoded once (in a thread) at the job's
        size and fps (``rtvideo.server.video_reference``), the job's length its length unless
        the request gives one (no longer than the video; a still image, one frame,
        stands for every frame of a job as long as any), and the engine start with
        its ``input`` (``input_strength``, ``DEFAULT_INPUT_STRENGTH`` when null).
        ``RequestError`` naming ``input_reference`` for a file that does not decode or
        is too long or too short."""
        fps = config.fps
        given = any(getattr(request, name) is not None for name in ("num_frames", "num_chunks", "seconds"))
        limit = config.num_frames if given else self.settings.max_frames  # frames past it are not counted
        video = await self._decoder.open(reference, config.width, config.height, fps, limit)
        length = f"{video.count} frames at {fps:g} fps ({video.count / fps:g} s)"
        if video.still:
            pass  # a still image: every frame of the job is it (ReferenceFeeder repeats the last frame)
        elif not given:
            if video.count > self.settings.max_frames:
                most = self.settings.max_frames
                raise RequestError(
                    f"input_reference: the video is longer than this server's max_frames ({most} frames at "
                    f"{fps:g} fps, {most / fps:g} s; rtvideo serve --max-frames); give a shorter length "
                    "(num_frames, num_chunks or seconds)"
                )
            request = request.model_copy(update={"num_frames": video.count})
        elif config.num_frames > video.count:
            raise RequestError(
                f"input_reference: the video is {length}, shorter than the job's {config.num_frames} frames; "
                "give a shorter length, or none to take the video's"
            )
        strength = DEFAULT_INPUT_STRENGTH if request.input_strength is None else request.input_strength
        source = VideoInput(strength=strength, format="raw", width=config.width, height=config.height, fps=fps)
        start, config = resolve(
            request,
            job_id,
            self.engine.ready.defaults,
            self.settings,
            self.model,
            paced=False,
            default_seconds=DEFAULT_JOB_SECONDS,
            video_input=source,
        )
        return start, config, video

    async def get(self, job_id: str) -> VideoObject:
        """The job as the API answers it; ``UnknownJobError`` if it is not kept."""
        if (job := self.live.get(job_id)) is not None:
            return job.public()
        return VideoObject.model_validate((await self._stored(job_id)).body)

    async def _stored(self, job_id: str) -> StoredJob:
        """The job's record; ``UnknownJobError`` if it is not kept, or a delete is ending it."""
        if job_id in self._deleting:
            raise UnknownJobError(job_id)
        return await self._kept(job_id)

    async def _kept(self, job_id: str) -> StoredJob:
        await self.store.expire()
        stored = await self.store.get(job_id)
        if stored is None:
            raise UnknownJobError(job_id)
        return stored

    async def page(self, after: str | None, limit: int, order: Literal["asc", "desc"]) -> VideoList:
        """A page of the jobs kept, in creation order (``desc``: newest first),
        after the job ``after``; ``RequestError`` naming ``after`` if it is not kept."""
        await self.store.expire()
        try:
            rows, has_more = await self.store.page(after, limit, order)
        except UnknownCursorError:
            raise RequestError(f"after: no video {after!r} (deleted, expired, or never made)") from None
        data = [
            self.live[row.id].public() if row.id in self.live else VideoObject.model_validate(row.body)
            for row in rows
            if row.id not in self._deleting  # going: not kept for anyone else (a page may come out shorter)
        ]
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return VideoList(object="list", data=data, first_id=first, last_id=last, has_more=has_more)

    async def content(self, job_id: str) -> tuple[VideoObject, StoredJob | None]:
        """The job, and with it its record when its video is complete (``media``
        set); ``UnknownJobError`` if it is not kept."""
        if (job := self.live.get(job_id)) is not None:
            return job.public(), None
        stored = await self._stored(job_id)
        video = VideoObject.model_validate(stored.body)
        return video, (stored if stored.status == "completed" and stored.media is not None else None)

    async def delete(self, job_id: str) -> str:
        """Stop the job if it runs, and forget it and its video; its status at
        that point (``cancelled`` if it had not finished). ``UnknownJobError`` if
        it is not kept, or another delete is ending it: of deletes at once, one
        answers, as one after another would."""
        if job_id in self._deleting:
            raise UnknownJobError(job_id)
        job = self.live.pop(job_id, None)
        self._deleting.add(job_id)  # before any wait: a delete beside this one finds it gone
        try:
            if job is None:
                status = (await self._kept(job_id)).status
            else:
                if job.task is not None and not job.task.done():
                    with contextlib.suppress(EngineDeadError, UnknownSessionError):
                        await self.engine.stop(job_id, "cancelled")
                    job.task.cancel()
                    await asyncio.gather(job.task, return_exceptions=True)
                status = job.status
            await self.store.delete(job_id)
        finally:
            self._deleting.discard(job_id)
        return status

    async def discard(self, job_id: str) -> None:
        """``delete`` for a job its own request ends (``/sync``): one that another
        client deleted already, or is deleting, is no error."""
        with contextlib.suppress(UnknownJobError):
            await self.delete(job_id)

    async def _run(self, job: Job, start: StartSession, handle: SessionHandle | None) -> None:
        try:
            await self._generate(job, start, handle)
        except asyncio.CancelledError:
            if self._closing:
                job.fail(INTERRUPTED, INTERRUPTED_MESSAGE)
            else:
                job.status = "cancelled"
            raise
        except EngineDeadError as error:
            job.fail("engine_unavailable", str(error))
        except Exception as error:  # an encoder, disk or server bug fails this job, not the server
            log.exception("job %s failed", job.id)
            job.fail("internal_error", f"{type(error).__name__}: {error}")
        finally:
            job.waiting = False
            job.completed_at = job.completed_at or time.time()
            suffix = SUFFIXES[job.config.format] if job.status == "completed" else None
            try:
                await self.store.finish(job.id, job.body(final=True), job.completed_at, suffix)
            except Exception:
                log.exception("job %s: its end could not be stored", job.id)
            finally:  # even when a delete cancels the wait: the store finishes it all the same
                if self.live.get(job.id) is job:
                    del self.live[job.id]
                job.finished.set()
                self.metrics.jobs.labels(job.status).inc()

    async def _generate(self, job: Job, start: StartSession, handle: SessionHandle | None) -> None:
        while handle is None:
            # Wait for a session to end, then try again; the timeout covers an end
            # that happened between the refusal and this wait.
            with contextlib.suppress(TimeoutError):
                async with self.capacity, asyncio.timeout(CAPACITY_RETRY_S):
                    await self.capacity.wait()
            if self.drainer.draining:
                return job.fail(INTERRUPTED, INTERRUPTED_MESSAGE)
            try:
                handle = await self.engine.start_session(start)
            except SessionRejectedError as error:
                if error.code != "server_full":
                    return job.fail(error.code, error.message)
            except EngineRestartingError:
                pass  # a queued job outlives a worker restart: try again once it is up
        feeding = None
        try:  # from here the engine session is this job's: whatever happens, it is stopped and read to its end
            job.waiting = False
            job.status = "in_progress"
            await self.store.update(job.id, job.body())
            feeder = None
            if job.reference is not None:
                feeder = ReferenceFeeder(job.reference, handle, job.config.num_chunks, self._decoder)
                feeding = asyncio.create_task(self._feed(job, feeder), name=f"job-input-{job.id}")
            run = JobRun(job, SessionOutput(job.id, job.config, self.metrics), self.store, feeder)
            try:
                async with asyncio.timeout(self.settings.max_session_seconds):
                    async for message in handle:
                        await run.result(message)
            except TimeoutError:
                await self.engine.stop(job.id, "max_duration")
                job.fail("max_duration", f"the job ran longer than {self.settings.max_session_seconds:g} s")
        finally:
            if feeding is not None:
                feeding.cancel()
                await asyncio.gather(feeding, return_exceptions=True)
            if not handle.finished:
                await _stop_and_drain(self.engine, handle)
            async with self.capacity:
                self.capacity.notify_all()
        job.completed_at = time.time()

    async def _feed(self, job: Job, feeder: ReferenceFeeder) -> None:
        """A job's input video to its engine session. One that fails to decode
        midway (checked whole before the job began: not expected) is logged, and
        the engine fails the job (``input_timeout``) for want of its frames."""
        try:
            await feeder.run()
        except Exception:
            log.exception("job %s: its input video failed", job.id)

    async def _soonest_expiry_s(self) -> float:
        """Seconds until a kept job expires (a fair Retry-After when the store is full)."""
        soonest = await self.store.soonest_expiry()
        return CAPACITY_RETRY_S if soonest is None else max(1.0, soonest - time.time())


def job_prompts(request: JobRequest) -> dict[str, str | None]:
    """Every prompt a job request carries, by field, as the prompt policy checks them."""
    prompts = {"prompt": request.prompt, "negative_prompt": request.negative_prompt}
    prompts.update({f"interactions[{i}].prompt": item.prompt for i, item in enumerate(request.interactions)})
    return prompts


async def _stop_and_drain(engine: EngineClient, handle: SessionHandle) -> None:
    """Stop a session we stopped reading, and read it to its end so nothing lingers."""
    with contextlib.suppress(EngineDeadError, UnknownSessionError):
        await engine.stop(handle.session_id, "cancelled")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30.0):
            async for _ in handle:
                pass


async def open_job_store(settings: ServerSettings) -> JobStore:
    """The store in ``settings.data_dir``, opened: held by this process (``DataDirInUseError``
    if another holds it). ``JobManager.open`` recovers what the previous process left."""
    store = JobStore(settings.data_dir, settings.job_ttl_s)
    await store.open()
    return store
