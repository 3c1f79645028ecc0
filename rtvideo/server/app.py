"""The FastAPI application: routes, and a lifespan that owns the engine.

API process, asyncio, no torch. ``create_app(settings)`` builds everything
per app instance (no module globals): the ``EngineClient`` starts with the
app and shuts down with it, the job manager lives in ``app.state``.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.resources
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from rtvideo.engine.client.engine_client import EngineClient
from rtvideo.engine.client.errors import EngineDeadError, EngineRestartingError, EngineStartupError
from rtvideo.engine.config import EngineConfig, PipelineSpec
from rtvideo.engine.messages import ModelLimits, SessionGeometry
from rtvideo.server.auth import is_authorized
from rtvideo.server.drain import Drainer
from rtvideo.server.file_answers import HeadAsGet, VideoFile
from rtvideo.server.job_forms import INPUT_REFERENCE, OPENAPI_FORMS, FormBodies
from rtvideo.server.job_store import JobStore, StoreError
from rtvideo.server.jobs import JobManager, JobsFullError, UnknownJobError, open_job_store
from rtvideo.server.limits import BodyLimits
from rtvideo.server.logs import AnswersToGoneClients, redact_uvicorn_loggers
from rtvideo.server.media import CONTENT_TYPES
from rtvideo.server.metrics import Metrics
from rtvideo.server.openapi import with_limits
from rtvideo.server.prompt_policy import PromptPolicyError, PromptRefused, load_prompt_policy
from rtvideo.server.realtime import RealtimeConnection
from rtvideo.server.schemas import (
    DeletedVideo,
    ErrorBody,
    JobRequest,
    ModelList,
    RequestError,
    VideoList,
    VideoObject,
)
from rtvideo.server.session_registry import SessionRegistry
from rtvideo.server.settings import ServerSettings
from rtvideo.server.startup import StartupFailed

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
SWAGGER_UI = str(importlib.resources.files("swagger_ui") / "static")  # Swagger UI 5's files, from swagger-ui-py


def pipeline_spec(settings: ServerSettings) -> PipelineSpec:
    """A pipeline name (``tiny``, ``stub``) as it is; a path means a model directory."""
    options = dict(settings.pipeline_options)
    if settings.decoder != "full":  # the model's own decoder is every pipeline's default
        options["decoder"] = settings.decoder
    if settings.quantize is not None:
        options["quantize"] = settings.quantize
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
        decode_nice=settings.decode_nice,
        cpu_threads=settings.cpu_threads,
        pp=settings.pp,
        pp_timeout_s=settings.pp_timeout_s,
        pp_transport=settings.pp_transport,
        pp_port=settings.pp_port,
        pp_decode=settings.pp_decode,
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
        input_timeout_s=settings.input_timeout_s,
        log_level=settings.log_level,
    )


def create_app(settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            app.state.prompt_policy = load_prompt_policy(settings.prompt_policy, settings.prompt_policy_timeout_s)
        except PromptPolicyError as error:
            raise _cannot_start(app, error) from None
        try:
            store = await open_job_store(settings)  # first: a data_dir in use stops the start before the model loads
        except StoreError as error:
            raise _cannot_start(app, error) from None
        engine = EngineClient(engine_config(settings))
        try:
            await engine.start()
        except BaseException as error:  # the worker was stopped (also for a start given up: cancelled)
            await store.close()
            if isinstance(error, EngineStartupError):  # its traceback is in the worker's log at debug
                raise _cannot_start(app, error) from None
            raise
        try:
            if (why := _default_refused(engine.ready.defaults, engine.ready.limits, settings)) is not None:
                raise _cannot_start(app, why)
            _serve_with(app, engine, store, settings)
            await app.state.jobs.open()
        except BaseException:  # refused, or given up, once the worker was up: nothing of it is left running
            await engine.shutdown()
            await store.close()
            raise
        try:
            yield
        finally:
            await app.state.jobs.close()  # jobs still running are kept failed (interrupted_by_restart)
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
    app.state.live_sessions = SessionRegistry()  # realtime sessions by token (resume, watch, control)
    # Added first, so it sits inside BodyLimits: a form is bounded as a JSON body is, then read as one.
    app.add_middleware(FormBodies, paths=("/v1/videos", "/v1/videos/sync"))
    app.add_middleware(BodyLimits, max_bytes=settings.max_request_bytes, body_timeout_s=settings.header_timeout_s)
    app.add_middleware(HeadAsGet)  # HEAD on every GET route: its answer without the body
    app.add_middleware(AnswersToGoneClients)  # outermost: it sees the disconnect the routes read
    redact_uvicorn_loggers()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        return _error(422, "invalid_request", describe_body_errors(error.errors(), content_type))

    @app.exception_handler(EngineDeadError)
    async def _engine_unavailable(request: Request, error: EngineDeadError) -> JSONResponse:
        # A call the worker's death cut short names that death; a fresh worker may be on its way now.
        return engine_unavailable_response(error, request.app.state.engine.unavailable())

    @app.exception_handler(StoreError)
    async def _storage_unavailable(request: Request, error: StoreError) -> JSONResponse:
        return _error(503, "storage_unavailable", str(error))  # the data_dir's disk or database failed

    @app.exception_handler(StarletteHTTPException)  # ours, and the router's 404 / 405
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        unknown = error.status_code in (404, 405) and not isinstance(error.detail, dict)  # the router's
        if unknown and request.url.path.startswith("/v1/") and not is_authorized(request, settings.api_key):
            # Every /v1/ path needs the key, one that names no route too: no route is told apart without it.
            return JSONResponse({"error": UNAUTHORIZED}, status_code=401)
        if isinstance(error.detail, dict):
            detail = error.detail
        elif error.status_code == 404 and request.url.path == "/v1/realtime/video":
            message = "/v1/realtime/video is a WebSocket: connect to it with a WebSocket client (ws:// or wss://)"
            detail = {"code": "not_found", "message": message}
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
            raise HTTPException(401, detail=UNAUTHORIZED)

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
    @app.get("/health/ready", tags=["operations"])
    async def health(request: Request) -> JSONResponse:
        """Readiness (``/health``, and ``/health/ready`` for orchestrators that
        expect the name), from what the server already knows (never a round trip to a
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
                "workers": [
                    {
                        "rank": 0,
                        "pid": engine.worker_pid,
                        "alive": True,
                        "restarts": engine.restarts,
                        "cpu_threads": engine.ready.cpu_threads,
                        "device": msgspec.to_builtins(engine.ready.device),
                    }
                ],
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
            websocket,
            engine,
            settings,
            engine.ready.pipeline,
            state.metrics,
            state.drainer,
            sessions=state.live_sessions,
            capacity=state.capacity,
            prompt_policy=state.prompt_policy,
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
        responses=errors(400, 401, 413, 422, 429, 503),
        openapi_extra=OPENAPI_FORMS,
    )
    async def create_video(body: JobRequest, request: Request) -> VideoObject:
        """Start a job; poll it, then fetch ``/content``. The body is JSON, or a form
        (multipart, as the OpenAI SDK's videos.create sends it, or urlencoded) of
        the same fields."""
        return (await _create(request, body)).public()

    @app.post(
        "/v1/videos/sync",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        response_class=Response,
        responses={**VIDEO_CONTENT, **errors(400, 401, 413, 422, 429, 499, 500, 503)},
        openapi_extra=OPENAPI_FORMS,
    )
    async def create_video_sync(body: JobRequest, request: Request) -> Response:
        """Run a job and answer with its content. A client that leaves before the
        answer cancels the job: nobody would fetch it, so it frees its slot. The job
        is not kept: it is deleted once its content was sent."""
        jobs = request.app.state.jobs
        job = await _create(request, body)
        finished = asyncio.ensure_future(job.finished.wait())
        left = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({finished, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not finished.done():
            finished.cancel()
            await jobs.discard(job.id)
            return _error(499, "client_closed", "the client left before the video was ready; the job was cancelled")
        try:
            video, stored = await jobs.content(job.id)
        except UnknownJobError:  # deleted meanwhile by another client
            return _error(500, "failed", f"video {job.id} was deleted before it finished")
        if stored is None:
            await jobs.discard(job.id)
            code = video.error.code if video.error else "failed"
            status = 503 if code in ("engine_unavailable", "worker_died", "worker_wedged") else 500
            return _error(status, code, video.error.message if video.error else f"the job ended {video.status}")
        return _content(video, stored.media, background=BackgroundTask(jobs.discard, job.id))

    @app.get("/v1/videos", tags=["videos"], dependencies=[Depends(authorized)], responses=errors(401, 422, 503))
    async def list_videos(
        request: Request,
        after: str | None = Query(None, description="A video id: list the ones after it (a page's last_id)."),
        limit: int = Query(20, ge=1, le=100, description="At most this many videos (1-100)."),
        order: Literal["asc", "desc"] = Query("desc", description="desc: newest first; asc: oldest first."),
    ) -> VideoList:
        """The jobs kept (queued, running, or finished less than job_ttl_s ago), a
        page at a time: newest first (order=asc: oldest first), at most ``limit``,
        after the video ``after``; ``has_more`` says whether another page follows
        (its ``after`` is this page's ``last_id``)."""
        try:
            return await request.app.state.jobs.page(after, limit, order)
        except RequestError as error:
            raise HTTPException(422, detail={"code": "invalid_request", "message": str(error)}) from None

    @app.get(
        "/v1/videos/{video_id}",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        responses=errors(401, 404, 422, 503),
    )
    async def get_video(video_id: str, request: Request) -> VideoObject:
        """The job: status, progress, its request, and where each scheduled prompt landed."""
        try:
            return await request.app.state.jobs.get(video_id)
        except UnknownJobError:
            raise _not_found(video_id) from None

    @app.get(
        "/v1/videos/{video_id}/content",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        response_class=Response,
        responses={**VIDEO_CONTENT, **errors(401, 404, 409, 416, 422, 503)},
    )
    async def video_content(
        video_id: str,
        request: Request,
        variant: str | None = Query(None, description="video (the default; the OpenAI SDK's parameter): nothing else"),
    ) -> Response:
        """The finished video, from its file (range requests answered)."""
        if variant not in (None, "video"):
            message = f"variant: only 'video' is served (no thumbnail or spritesheet), got {variant!r}"
            return _error(422, "invalid_request", message)
        try:
            video, stored = await request.app.state.jobs.content(video_id)
        except UnknownJobError:
            raise _not_found(video_id) from None
        if stored is None:
            return _error(409, "not_ready", f"video {video_id} is {video.status}, not completed")
        return _content(video, stored.media)

    @app.delete(
        "/v1/videos/{video_id}",
        tags=["videos"],
        dependencies=[Depends(authorized)],
        responses=errors(401, 404, 422, 503),
    )
    async def delete_video(video_id: str, request: Request) -> DeletedVideo:
        """Stop the job if it runs, and forget it and its video."""
        try:
            status = await request.app.state.jobs.delete(video_id)
        except UnknownJobError:
            raise _not_found(video_id) from None
        return DeletedVideo(id=video_id, object="video.deleted", deleted=True, status=status)

    for method, path, call in OPENAI_NOT_IMPLEMENTED:
        app.add_api_route(
            path,
            _not_implemented(method, path, call),
            methods=[method],
            name=f"{call}_not_implemented",
            summary=f"Not implemented here: the OpenAI SDK's videos.{call}",
            tags=["videos"],
            dependencies=[Depends(authorized)],
            status_code=501,
            response_model=None,
            responses=errors(401, 501),
            openapi_extra={"parameters": [_path_parameter(name) for name in re.findall(r"{(\w+)}", path)]},
        )
    return app


OPENAI_NOT_IMPLEMENTED = (
    ("POST", "/v1/videos/{video_id}/remix", "remix"),
    ("POST", "/v1/videos/edits", "edit"),
    ("POST", "/v1/videos/extensions", "extend"),
    ("POST", "/v1/videos/characters", "create_character"),
    ("GET", "/v1/videos/characters/{character_id}", "get_character"),
)
"""Routes of the OpenAI videos API that this server does not implement: each
answers 501 ``not_implemented`` saying so (not a 404 that reads as a wrong URL),
with ``x-should-retry: false`` so the OpenAI SDK does not retry it as a 5xx."""


def _path_parameter(name: str) -> dict:
    """An OpenAPI path parameter (its schema built by call: a ``{"type": ...}`` literal reads as a protocol event)."""
    return {"name": name, "in": "path", "required": True, "schema": dict(type="string")}


def _not_implemented(method: str, path: str, call: str):
    message = (
        f"{method} {path} (the OpenAI SDK's videos.{call}) exists in the OpenAI API but is not implemented by "
        "this server; it makes videos from a prompt, or restyles an input video (POST /v1/videos, its "
        "input_reference), and changes the prompt of one playing (WS /v1/realtime/video)"
    )

    async def answer() -> JSONResponse:
        """Not implemented here: 501 not_implemented."""
        return _error(501, "not_implemented", message, headers={"x-should-retry": "false"})

    return answer


def _serve_with(app: FastAPI, engine: EngineClient, store: JobStore, settings: ServerSettings) -> None:
    """What the routes use, once the engine is up: its client, the capacity
    condition, the metrics, the drainer and the jobs (``app.state``)."""
    app.state.engine = engine
    app.state.capacity = asyncio.Condition()
    app.state.metrics = Metrics(
        worker_up=lambda: engine.alive,
        memory=lambda: (engine.ready.session_memory_bytes if engine.ready else None, engine.held_state_bytes()),
        engine_stats=lambda: engine.stats,
        worker_pid=lambda: engine.worker_pid,
    )
    app.state.drainer = Drainer(engine, app.state.capacity, settings.shutdown_grace_s)
    app.state.jobs = JobManager(
        engine,
        settings,
        engine.ready.pipeline,
        app.state.capacity,
        app.state.metrics,
        app.state.drainer,
        store,
        prompt_policy=app.state.prompt_policy,
    )


def _default_refused(defaults: SessionGeometry, limits: ModelLimits, settings: ServerSettings) -> str | None:
    """Why this server's frame bounds (``max_width``, ``max_height``) admit no
    session at all (below the smallest frame the model makes), else None: such
    a server is refused at start, in one line. Bounds below the model's default
    session only are logged: every request that gives no size is refused, which
    a server may mean (its sessions asking for smaller frames)."""
    side = limits.size_multiple
    for name, bound, value in (
        ("max_width", settings.max_width, defaults.width),
        ("max_height", settings.max_height, defaults.height),
    ):
        if bound < side:
            return (
                f"{name} {bound} is below the smallest frame the model makes, {side}x{side}: no session could be served"
            )
        if value > bound:
            log.warning(
                "%s %d is below the model's default session, %dx%d: sessions must ask for a smaller size",
                name,
                bound,
                defaults.width,
                defaults.height,
            )
    return None


def _cannot_start(app: FastAPI, error: Exception | str) -> StartupFailed:
    """The start fails for ``error``'s reason, which ``rtvideo serve`` says in one line (rtvideo/server/startup.py)."""
    app.state.start_failure = str(error)
    return StartupFailed(str(error))


async def _create(request: Request, body: JobRequest):
    if request.app.state.drainer.draining:
        raise HTTPException(503, detail={"code": "shutting_down", "message": "the server is shutting down"})
    try:
        return await request.app.state.jobs.create(body, request.scope.get(INPUT_REFERENCE))
    except RequestError as error:
        raise HTTPException(422, detail={"code": "invalid_request", "message": str(error)}) from None
    except PromptRefused as error:
        raise HTTPException(400, detail={"code": "prompt_refused", "message": str(error)}) from None
    except JobsFullError as error:
        retry = {"Retry-After": str(math.ceil(error.retry_after_s))}
        raise HTTPException(429, detail={"code": error.code, "message": error.message}, headers=retry) from None


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _not_found(video_id: str) -> HTTPException:
    return HTTPException(404, detail={"code": "not_found", "message": f"no video {video_id!r}"})


def _content(video: VideoObject, path: Path, background: BackgroundTask | None = None) -> Response:
    """The video's file as the answer (``Content-Disposition`` names it ID.mp4 or ID.bin)."""
    suffix = "mp4" if video.format == "fmp4" else "bin"
    headers = {"Content-Disposition": f'attachment; filename="{video.id}.{suffix}"'}
    return VideoFile(path, media_type=CONTENT_TYPES[video.format], headers=headers, background=background)


UNAUTHORIZED = {"code": "unauthorized", "message": "a valid API key is required"}
"""The error of a /v1/ request without the API key: a route's, or a path that names none."""

ERROR_MEANINGS = {
    400: "the server's prompt policy refused one of its prompts; the message names the field (prompt_refused)",
    401: "an API key is configured and the request did not present it (unauthorized)",
    404: "no such video (not_found)",
    409: "the video is not completed yet (not_ready)",
    413: "the request body is over max_request_bytes (body_too_large)",
    416: "a Range none of whose ranges lies within the video (range_not_satisfiable); Content-Range gives its size",
    422: "the request was refused; the message names the field (invalid_request)",
    429: "too many jobs kept or waiting (too_many_jobs, queue_full); see Retry-After",
    499: "the client left before the answer; the job was cancelled (client_closed)",
    500: "the job did not complete: its own error code",
    501: "a route of the OpenAI videos API this server does not implement (not_implemented)",
    503: "no worker can take it (engine_unavailable; Retry-After while one restarts), the server drains, "
    "or the job store's disk failed (storage_unavailable)",
}
VIDEO_CONTENT = {
    200: {
        "description": "The video: MP4 for fmp4; for raw and jpeg the chunk payloads, concatenated",
        "content": {"video/mp4": {}, "application/octet-stream": {}},
    },
    206: {
        "description": "The bytes a Range asked for (several ranges: multipart/byteranges)",
        "content": {"video/mp4": {}, "application/octet-stream": {}, "multipart/byteranges": {}},
    },
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
        where = ".".join(str(p) for p in e["loc"] if p not in ("body", "query")) or "body"
        if e["type"] == "json_invalid":
            at = e["loc"][1] if len(e["loc"]) > 1 else "?"
            parts.append(f"body: not valid JSON ({e.get('ctx', {}).get('error', e['msg'])}) at character {at}")
        elif where == "body" and e["type"] == "model_attributes_type":
            given = e.get("input")
            unparsed = isinstance(given, bytes) or (isinstance(given, str) and "json" not in (content_type or ""))
            if unparsed:  # not parsed: the content type was not JSON (a JSON string is a str too, parsed)
                got = f"content-type {content_type}" if content_type else "no content-type"
                parts.append(f"body: expected a JSON object with content-type: application/json, got {got}")
            else:
                parts.append(f"body: expected a JSON object, got {type(e.get('input')).__name__}")
        else:
            parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def engine_unavailable_response(error: EngineDeadError, now: EngineDeadError | None = None) -> JSONResponse:
    """503 ``engine_unavailable`` saying ``error``; with ``Retry-After`` while a fresh
    worker is starting: by ``error``, or by ``now`` (what the engine says at the
    answer: a call that failed as the worker died is answered once its restart began)."""
    headers = None
    restarting = next((e for e in (error, now) if isinstance(e, EngineRestartingError)), None)
    if restarting is not None:
        headers = {"Retry-After": str(math.ceil(restarting.retry_after_s))}
    return _error(503, "engine_unavailable", str(error), headers)
