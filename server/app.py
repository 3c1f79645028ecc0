"""The FastAPI application: routes, and a lifespan that owns the engine.

API process, asyncio, no torch. ``create_app(settings)`` builds everything
per app instance (no module globals): the ``EngineClient`` starts with the
app and shuts down with it, the job manager lives in ``app.state``.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.resources
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.client import EngineClient, EngineDeadError, EngineRestartingError
from engine.config import EngineConfig, PipelineSpec
from server.auth import is_authorized, redact_access_log
from server.drain import Drainer
from server.jobs import JobManager, JobsFullError
from server.limits import BodyLimits
from server.media import CONTENT_TYPES
from server.metrics import Metrics
from server.openapi import with_limits
from server.realtime import RealtimeConnection
from server.schemas import (
    DeletedVideo,
    ErrorBody,
    JobRequest,
    ModelList,
    RequestError,
    VideoList,
    VideoObject,
)
from server.settings import ServerSettings

STATIC = Path(__file__).parent / "static"
SWAGGER_UI = str(importlib.resources.files("swagger_ui") / "static")  # Swagger UI 5's files, from swagger-ui-py


def pipeline_spec(settings: ServerSettings) -> PipelineSpec:
    """A pipeline name (``tiny``, ``stub``) as it is; a path means a model directory."""
    options = dict(settings.pipeline_options)
    if "/" in settings.model or Path(settings.model).is_dir():
        return PipelineSpec("causal_wan", {"model_dir": settings.model, **options})
    return PipelineSpec(settings.model, options)


def engine_config(settings: ServerSettings) -> EngineConfig:
    """The engine configuration a server with ``settings`` runs."""
    return EngineConfig(
        pipeline=pipeline_spec(settings),
        max_sessions=settings.max_sessions,
        group_chunk_steps=settings.group_chunk_steps,
        max_batch_rows=settings.max_batch_rows,
        overlap_decode=settings.overlap_decode,
        pp=settings.pp,
        pp_timeout_s=settings.pp_timeout_s,
        worker_listen=settings.worker_listen,
        stream_batch=settings.stream_batch,
        max_chunks_in_flight=settings.max_chunks_in_flight,
        slo_first_chunk_s=settings.slo_first_chunk_s,
        max_undelivered_seconds=settings.max_undelivered_seconds,
        session_memory_bytes=None if settings.session_memory_gib is None else int(settings.session_memory_gib * 2**30),
        max_pixels=settings.max_pixels,
        max_realtime_load=settings.max_realtime_load,
        startup_timeout_s=settings.worker_startup_timeout_s,
        max_worker_restarts=settings.max_worker_restarts,
        wedged_after_s=settings.worker_wedged_after_s,
    )


def create_app(settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = EngineClient(engine_config(settings))
        await engine.start()
        app.state.engine = engine
        app.state.capacity = asyncio.Condition()
        app.state.metrics = Metrics(
            worker_up=lambda: engine.alive,
            memory=lambda: (engine.ready.session_memory_bytes if engine.ready else None, engine.held_state_bytes()),
            engine_stats=lambda: engine.stats,
        )
        app.state.drainer = Drainer(engine, app.state.capacity, settings.shutdown_grace_s)
        app.state.jobs = JobManager(
            engine, settings, engine.ready.pipeline, app.state.capacity, app.state.metrics, app.state.drainer
        )
        try:
            yield
        finally:
            for job in list(app.state.jobs.jobs.values()):
                if job.task is not None:
                    job.task.cancel()
            await engine.shutdown()

    app = FastAPI(
        title="rtvideo",
        version="0.1.0",
        summary="Realtime video generation: prompts in, video chunks out, each new prompt at the next chunk.",
        lifespan=lifespan,
        docs_url=None,  # served below from local files, not a CDN
        redoc_url=None,
    )
    app.mount("/docs/assets", StaticFiles(directory=SWAGGER_UI), name="docs-assets")
    default_openapi = app.openapi
    bounded: list[dict] = []  # the schema with the model's bounds, once the worker said them

    def openapi() -> dict:
        """The schema, with the served model's bounds once its worker said them."""
        engine = getattr(app.state, "engine", None)
        if not bounded and engine is not None and engine.ready is not None:
            bounded.append(with_limits(copy.deepcopy(default_openapi()), engine.ready.limits, settings))
        return bounded[0] if bounded else default_openapi()

    app.openapi = openapi

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        """Swagger UI over /openapi.json, every file from this server (nothing is
        downloaded: the page works offline)."""
        return get_swagger_ui_html(
            openapi_url=app.openapi_url,
            title="rtvideo API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )

    app.state.settings = settings
    app.add_middleware(BodyLimits, max_bytes=settings.max_request_bytes)
    redact_access_log()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        return _error(422, "invalid_request", describe_body_errors(error.errors(), content_type))

    @app.exception_handler(EngineDeadError)
    async def _engine_unavailable(request: Request, error: EngineDeadError) -> JSONResponse:
        return engine_unavailable_response(error)

    @app.exception_handler(StarletteHTTPException)  # ours, and the router's 404 / 405
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if isinstance(error.detail, dict):
            detail = error.detail
        elif error.status_code == 404:
            detail = {"code": "not_found", "message": f"no route {request.url.path!r}; the API is under /v1/"}
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r}"
            detail = {"code": "method_not_allowed", "message": message}
        else:
            detail = {"code": "error", "message": str(error.detail)}
        return JSONResponse({"error": detail}, status_code=error.status_code, headers=error.headers)

    def authorized(request: Request) -> None:
        if not is_authorized(request, settings.api_key):
            raise HTTPException(401, detail={"code": "unauthorized", "message": "a valid API key is required"})

    def engine_of(request: Request) -> EngineClient:
        return request.app.state.engine

    @app.get("/health/live", tags=["operations"])
    async def live(request: Request) -> JSONResponse:
        """Liveness, from what the server already knows (no round trip to the
        worker): 503 only when restarting this process is what would help: the
        worker died and the restart budget is spent (``dead``), or it is wedged
        and not yet replaced (``wedged``: the heartbeat kills a wedged worker,
        so this lasts until its death is handled). 200 otherwise: ``ok``,
        ``busy`` (one forward, or a silence of the loop, past a second),
        ``restarting`` (a fresh worker is loading, however long a real model
        takes), draining included."""
        engine = engine_of(request)
        if (unavailable := engine.unavailable()) is not None:
            if isinstance(unavailable, EngineRestartingError):
                return JSONResponse({"status": "restarting", "reason": str(unavailable)})
            return JSONResponse({"status": "dead", "reason": str(unavailable)}, status_code=503)
        status, reason = engine.responsiveness()
        if status == "wedged":
            return JSONResponse({"status": "wedged", "reason": reason}, status_code=503)
        if status == "busy":
            return JSONResponse({"status": "busy", "reason": reason})
        return JSONResponse({"status": "ok"})

    @app.get("/health", tags=["operations"])
    async def health(request: Request) -> JSONResponse:
        """Readiness, from what the server already knows (never a round trip to a
        busy worker): 200 while the workers are up and the server takes new work;
        503 when they are down, restarting or wedged, or the server is draining.
        The details (with an API key set, only for a request that presents it):
        the worker's pid, the sessions open here, and the sessions the runner and
        the pipeline still hold as of the worker's latest heartbeat answer (at
        most ``Heartbeat.interval_s`` old)."""
        engine = engine_of(request)
        if request.app.state.drainer.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if (unavailable := engine.unavailable()) is not None:
            status = "restarting" if isinstance(unavailable, EngineRestartingError) else "unavailable"
            return JSONResponse({"status": status, "reason": str(unavailable)}, status_code=503)
        status, reason = engine.responsiveness()
        if status == "wedged":
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        if not is_authorized(request, settings.api_key):
            return JSONResponse({"status": "ok"})
        probe = engine.heartbeat.last_reply
        return JSONResponse(
            {
                "status": "ok",
                "model": engine.ready.pipeline,
                "workers": [{"rank": 0, "pid": engine.worker_pid, "alive": True, "restarts": engine.restarts}],
                "sessions": len(engine.open_sessions()),
                "max_sessions": settings.max_sessions,
                "runner_sessions": list(probe.runner_sessions) if probe else [],
                "pipeline_sessions": list(probe.pipeline_sessions) if probe else [],
            }
        )

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        """The bundled browser client (no CDN: everything is in the one file)."""
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        """The page's icon (browsers ask every site for one; also linked from the page)."""
        cache = {"Cache-Control": "max-age=86400"}
        return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon", headers=cache)

    @app.get("/metrics", tags=["operations"], response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus text format: realtime sessions, latencies, interactions, jobs, workers."""
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["models"], dependencies=[Depends(authorized)], responses=errors(401))
    async def models(request: Request) -> ModelList:
        """The served model and what a request that leaves a field out gets."""
        ready = engine_of(request).ready
        d = ready.defaults
        defaults = {
            "width": d.width,
            "height": d.height,
            "fps": d.fps,
            "num_inference_steps": d.num_inference_steps,
            "first_chunk_frames": d.first_chunk_frames,
            "frames_per_chunk": d.frames_per_chunk,
        }
        card = {"id": ready.pipeline, "object": "model", "owned_by": "rtvideo", "defaults": defaults}
        card["prompts"] = list(ready.prompts)
        return ModelList(object="list", data=[card])

    @app.websocket("/v1/realtime/video")
    async def realtime(websocket: WebSocket) -> None:
        engine = websocket.app.state.engine
        state = websocket.app.state
        connection = RealtimeConnection(
            websocket, engine, settings, engine.ready.pipeline, state.metrics, state.drainer
        )
        try:
            await connection.serve()
        finally:
            async with websocket.app.state.capacity:
                websocket.app.state.capacity.notify_all()

    @app.post(
        "/v1/videos",
        status_code=202,
        tags=["videos"],
        dependencies=[Depends(authorized)],
        responses=errors(401, 413, 422, 429, 503),
    )
    async def create_video(body: JobRequest, request: Request) -> VideoObject:
        """Start a job; poll it, then fetch ``/content``."""
        return (await _create(request, body)).public()

    @app.post(
        "/v1/videos/sync",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        response_class=Response,
        responses={**VIDEO_CONTENT, **errors(401, 413, 422, 429, 499, 500, 503)},
    )
    async def create_video_sync(body: JobRequest, request: Request) -> Response:
        """Run a job and answer with its content. A client that leaves before the
        answer cancels the job: nobody would fetch it, so it frees its slot."""
        job = await _create(request, body)
        finished = asyncio.ensure_future(job.finished.wait())
        left = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({finished, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not finished.done():
            finished.cancel()
            await request.app.state.jobs.cancel(job.id)
            return _error(499, "client_closed", "the client left before the video was ready; the job was cancelled")
        request.app.state.jobs.jobs.pop(job.id, None)
        if job.status != "completed":
            code = job.error["code"] if job.error else "failed"
            status = 503 if code in ("engine_unavailable", "worker_died", "worker_wedged") else 500
            return _error(status, code, _job_error(job))
        return _content(job)

    @app.get("/v1/videos", tags=["videos"], dependencies=[Depends(authorized)], responses=errors(401))
    async def list_videos(request: Request) -> VideoList:
        """The jobs kept (queued, running, or finished less than job_ttl_s ago), newest first."""
        request.app.state.jobs.expire()
        jobs = sorted(request.app.state.jobs.jobs.values(), key=lambda j: j.created_at, reverse=True)
        return VideoList(object="list", data=[job.public() for job in jobs])

    @app.get(
        "/v1/videos/{video_id}", tags=["videos"], dependencies=[Depends(authorized)], responses=errors(401, 404, 422)
    )
    async def get_video(video_id: str, request: Request) -> VideoObject:
        """The job: status, progress, its request, and where each scheduled prompt landed."""
        return _job(request, video_id).public()

    @app.get(
        "/v1/videos/{video_id}/content",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        response_class=Response,
        responses={**VIDEO_CONTENT, **errors(401, 404, 409, 422)},
    )
    async def video_content(video_id: str, request: Request) -> Response:
        job = _job(request, video_id)
        if job.status != "completed":
            return _error(409, "not_ready", f"video {video_id} is {job.status}, not completed")
        return _content(job)

    @app.delete(
        "/v1/videos/{video_id}", tags=["videos"], dependencies=[Depends(authorized)], responses=errors(401, 404, 422)
    )
    async def delete_video(video_id: str, request: Request) -> DeletedVideo:
        """Stop the job if it runs, and forget it and its video."""
        _job(request, video_id)
        job = await request.app.state.jobs.cancel(video_id)
        return DeletedVideo(id=job.id, object="video", deleted=True, status=job.status)

    return app


async def _create(request: Request, body: JobRequest):
    if request.app.state.drainer.draining:
        raise HTTPException(503, detail={"code": "shutting_down", "message": "the server is shutting down"})
    try:
        return await request.app.state.jobs.create(body)
    except RequestError as error:
        raise HTTPException(422, detail={"code": "invalid_request", "message": str(error)}) from None
    except JobsFullError as error:
        retry = {"Retry-After": str(math.ceil(error.retry_after_s))}
        raise HTTPException(429, detail={"code": error.code, "message": error.message}, headers=retry) from None


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _job(request: Request, video_id: str):
    request.app.state.jobs.expire()
    job = request.app.state.jobs.jobs.get(video_id)
    if job is None:
        raise HTTPException(404, detail={"code": "not_found", "message": f"no video {video_id!r}"})
    return job


def _job_error(job) -> str:
    return job.error["message"] if job.error else f"the job ended {job.status}"


def _content(job) -> Response:
    c = job.config
    media_type = CONTENT_TYPES[c.format]
    suffix = "mp4" if c.format == "fmp4" else "bin"
    headers = {"Content-Disposition": f'attachment; filename="{job.id}.{suffix}"'}
    return Response(job.content, media_type=media_type, headers=headers)


ERROR_MEANINGS = {
    401: "an API key is configured and the request did not present it (unauthorized)",
    404: "no such video (not_found)",
    409: "the video is not completed yet (not_ready)",
    413: "the request body is over max_request_bytes (body_too_large)",
    422: "the request was refused; the message names the field (invalid_request)",
    429: "too many jobs kept or waiting (too_many_jobs, queue_full); see Retry-After",
    499: "the client left before the answer; the job was cancelled (client_closed)",
    500: "the job did not complete: its own error code",
    503: "no worker can take it (engine_unavailable; Retry-After while one restarts) or the server drains",
}
VIDEO_CONTENT = {
    200: {
        "description": "The video: MP4 for fmp4; for raw and jpeg the chunk payloads, concatenated",
        "content": {"video/mp4": {}, "application/octet-stream": {}},
    }
}


def errors(*statuses: int) -> dict[int, dict]:
    """OpenAPI responses for these error statuses, each in the project's error shape."""
    return {status: {"model": ErrorBody, "description": ERROR_MEANINGS[status]} for status in statuses}


def describe_body_errors(errors: list[dict], content_type: str | None = None) -> str:
    """One line naming each field the request got wrong, in the client's terms:
    ``width: Input should be ...``; ``body: not valid JSON (Expecting value) at
    character 18``; ``body: expected a JSON object ...`` for a body that is not
    one (a list, or a body sent without ``content-type: application/json``)."""
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e["loc"] if p != "body") or "body"
        if e["type"] == "json_invalid":
            at = e["loc"][1] if len(e["loc"]) > 1 else "?"
            parts.append(f"body: not valid JSON ({e.get('ctx', {}).get('error', e['msg'])}) at character {at}")
        elif where == "body" and e["type"] == "model_attributes_type":
            if isinstance(e.get("input"), bytes | str):  # not parsed: the content type was not JSON
                got = f"content-type {content_type}" if content_type else "no content-type"
                parts.append(f"body: expected a JSON object with content-type: application/json, got {got}")
            else:
                parts.append(f"body: expected a JSON object, got {type(e.get('input')).__name__}")
        else:
            parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def engine_unavailable_response(error: EngineDeadError) -> JSONResponse:
    """503 ``engine_unavailable``; with ``Retry-After`` while a fresh worker is starting."""
    headers = None
    if isinstance(error, EngineRestartingError):
        headers = {"Retry-After": str(math.ceil(error.retry_after_s))}
    return _error(503, "engine_unavailable", str(error), headers)
