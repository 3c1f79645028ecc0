"""The public schema: pydantic models for every client event and request.

API process. ``VideoRequest`` is shared by the WebSocket ``session.start`` and
``POST /v1/videos`` (which adds scheduled ``interactions``). ``resolve``
turns a request into the engine's ``StartSession`` plus the effective
configuration echoed to the client, checking the server's limits; every
error names the offending field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rtvideo.engine.limits import (
    DECODERS,
    INPUT_FORMATS,
    INPUT_KINDS,
    MAX_INFERENCE_STEPS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_TRANSITION_CHUNKS,
    PROMPT_CHANGE_MODES,
)
from rtvideo.engine.messages import Interaction, ScheduledInteraction, SessionGeometry, StartSession, VideoInput
from rtvideo.server.settings import ServerSettings
from rtvideo.server.video_input import HEADER_BYTES

FORMAT_ALIASES = {"m4s": "fmp4"}
DEFAULT_INPUT_STRENGTH = 0.5
"""A job's ``input_strength`` when it gives an ``input_reference`` and no strength."""
DEFAULT_JOB_SECONDS = 4.0
"""A job's length when its request gives none of num_frames, num_chunks, seconds
(the OpenAI API's default); a realtime session's is "until stopped"."""


def _not_blank(prompt: str) -> str:
    """A prompt's check beyond its length: not blank (a field validator's)."""
    if not prompt.strip():
        raise ValueError("must not be blank")
    return prompt


class _Strict(BaseModel):
    # Field docstrings become the descriptions in the OpenAPI schema (/docs).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class VideoRequest(_Strict):
    """What a client asks for. Lengths: at most one of ``num_frames``,
    ``num_chunks``, ``seconds``; none means "until stopped" for a realtime
    session and ``DEFAULT_JOB_SECONDS`` (4 s) for a job."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    """What the video shows at first (not blank)."""
    _prompt_not_blank = field_validator("prompt")(_not_blank)
    model: str | None = None
    """The served model's id (GET /v1/models); another one is refused. Null: the served one."""
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    """Only for a model that samples with classifier-free guidance; the models served
    today do not, and refuse a non-blank one (null or "" is no negative prompt)."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Same seed, parameters and prompt changes: the same frames."""
    width: int | None = Field(None, ge=2)
    """Frame width in pixels; null: the model's default. At most the server's max_width,
    and what the model allows (causal Wan: a multiple of 16)."""
    height: int | None = Field(None, ge=2)
    """Frame height in pixels; null: the model's default (causal Wan: a multiple of 16)."""
    fps: float | None = Field(None, gt=0, le=120, allow_inf_nan=False)
    """Frames per second of the media; null: the model's default (causal Wan: at most 60)."""
    num_frames: int | None = Field(None, ge=1)
    """Total frames (the last chunk is trimmed). At most one of num_frames, num_chunks,
    seconds; none of them: until stopped (a realtime session), 4 seconds (a job, as
    the OpenAI API: round(4 x fps) frames)."""
    num_chunks: int | None = Field(None, ge=1)
    """Length in chunks (the first chunk may be shorter: see frames_per_chunk in the answer)."""
    seconds: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Length in seconds of media: round(seconds x fps) frames (the last chunk is trimmed).
    A job that gives no length gets 4; a realtime session runs until stopped."""
    num_inference_steps: int | None = Field(None, ge=1, le=MAX_INFERENCE_STEPS)
    """Denoise steps per chunk; null: the model's default. The model bounds it (causal Wan: 1-4)."""
    format: Literal["fmp4", "m4s", "jpeg", "raw"] = "fmp4"
    """Media format: fmp4 (fragmented MP4, H.264; m4s is an alias), jpeg, or raw RGB frames."""
    transition_chunks: int = Field(0, ge=0, le=MAX_TRANSITION_CHUNKS)
    """Default for prompt changes: blend the new prompt in over this many chunks (0 or 1: a cut)."""
    prompt_change: Literal[PROMPT_CHANGE_MODES] = "soft"
    """What a prompt change does to the model's cache: soft keeps it, recache re-encodes
    it under the new prompt, reset starts afresh."""
    max_lead_seconds: float | None = Field(2.0, gt=0, allow_inf_nan=False)
    """Pacing: how far generated media may run ahead of the viewer (null: no pacing).
    Jobs are never paced."""
    decoder: Literal[DECODERS] | None = None
    """What makes the frames: full (the model's VAE decoder) or tiny (the tiny
    streaming decoder, where the server has its weights); null: the server's
    (rtvideo serve --decoder)."""

    @model_validator(mode="after")
    def _one_length(self) -> VideoRequest:
        given = [name for name in ("num_frames", "num_chunks", "seconds") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of num_frames, num_chunks, seconds (got {', '.join(given)})")
        return self


class ScheduledPrompt(_Strict):
    at_chunk: int = Field(ge=0)
    """The chunk the prompt takes effect at (less than the job's chunk count; one a chunk)."""
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    """The new prompt."""
    _prompt_not_blank = field_validator("prompt")(_not_blank)
    transition_chunks: int | None = Field(None, ge=0, le=MAX_TRANSITION_CHUNKS)
    """Chunks to blend it in over; null: the request's transition_chunks."""


class JobRequest(VideoRequest):
    """``POST /v1/videos``: a finite request, with prompt changes fixed in advance."""

    interactions: list[ScheduledPrompt] = Field(default_factory=list, max_length=1000)
    """Prompt changes fixed in advance, one a chunk at most; the job object says where each one landed."""

    @field_validator("interactions")
    @classmethod
    def _one_a_chunk(cls, interactions: list[ScheduledPrompt]) -> list[ScheduledPrompt]:
        first: dict[int, int] = {}
        for i, item in enumerate(interactions):
            if (earlier := first.setdefault(item.at_chunk, i)) != i:
                raise ValueError(f"interactions[{earlier}] and [{i}] both change the prompt at chunk {item.at_chunk}")
        return interactions

    exact: bool | None = None
    """Ignored: what a session.done replay body says of the session it came from
    (accepted so that body posts as it is)."""
    inexact_reason: str | None = Field(None, max_length=2000)
    """Ignored, as exact is."""
    size: str | None = Field(None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$")
    """WIDTHxHEIGHT, as the OpenAI SDK sends it (e.g. "64x64"): the same as width and
    height, which it must not contradict."""
    input_reference: Any = None
    """An input video to restyle (video to video), as the OpenAI SDK sends it: a file
    field of a multipart/form-data body, decoded and resampled to the job's size and
    fps. A JSON body cannot carry it (refused)."""
    input_strength: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    """With input_reference: how far the video departs from it, 0 (the input as the
    model reconstructs it) to 1 (its content ignored); null: 0.5."""

    @model_validator(mode="after")
    def _size(self) -> JobRequest:
        if self.input_reference is not None:
            raise ValueError(
                "input_reference: send the input video as a file field of a multipart/form-data body "
                "(what the OpenAI SDK's input_reference does); a JSON body cannot carry it"
            )
        if self.size is not None:
            width, height = (int(side) for side in self.size.split("x"))
            for name, side, given in (("width", width, self.width), ("height", height, self.height)):
                if side < 2:
                    raise ValueError(f"size: {name} {side} is less than 2")
                if given is not None and given != side:
                    raise ValueError(f"size: {self.size} says {name} {side}, but {name} is {given}")
            self.width, self.height = width, height
        return self


# -- WebSocket client events ---------------------------------------------------------


class VideoInputSpec(_Strict):
    """A realtime session's input video (video to video): the client sends its
    frames as binary WebSocket frames, and the model restyles them under the
    prompt. The session's width, height and fps are the input's (a request that
    gives them must give the same)."""

    kind: Literal[INPUT_KINDS]
    """What the input is: video (a stream of frames)."""
    strength: float = Field(ge=0, le=1, allow_inf_nan=False)
    """How far the output departs from the input: 0 returns the input (as the model
    reconstructs it), 1 ignores its content (text to video)."""
    format: Literal[INPUT_FORMATS] = "jpeg"
    """How each frame's image travels: jpeg, or raw (width x height x 3 bytes of uint8 RGB)."""
    width: int = Field(ge=2)
    """Width of the frames sent, in pixels: the session's width."""
    height: int = Field(ge=2)
    """Height of the frames sent, in pixels: the session's height."""
    fps: float = Field(gt=0, le=120, allow_inf_nan=False)
    """Frames per second the client captures: the session's fps."""

    def engine(self) -> VideoInput:
        return VideoInput(
            kind=self.kind,
            strength=self.strength,
            format=self.format,
            width=self.width,
            height=self.height,
            fps=self.fps,
        )


class SessionStartEvent(VideoRequest):
    type: Literal["session.start"]
    shared_control: bool = False
    """Let further controllers join with video.start's control_token (shared steering)."""
    input: VideoInputSpec | None = None
    """An input video to restyle (video to video), its frames sent as binary frames;
    null: video from the prompt alone."""


class InteractionBody(_Strict):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    _prompt_not_blank = field_validator("prompt")(_not_blank)


class InteractionPayload(_Strict):
    event_id: str | None = Field(None, min_length=1, max_length=200)
    event: InteractionBody
    transition_chunks: int | None = Field(None, ge=0, le=MAX_TRANSITION_CHUNKS)


class SessionInteractionEvent(_Strict):
    type: Literal["session.interaction"]
    interaction: InteractionPayload


class SessionPlaybackEvent(_Strict):
    type: Literal["session.playback"]
    position_seconds: float = Field(ge=0, allow_inf_nan=False)


class SessionPingEvent(_Strict):
    type: Literal["session.ping"]


class SessionStopEvent(_Strict):
    type: Literal["session.stop"]


class SessionResumeEvent(_Strict):
    type: Literal["session.resume"]
    request_id: str = Field(min_length=1, max_length=200)
    resume_token: str = Field(min_length=1, max_length=200)
    last_chunk_index: int = Field(ge=-1)


ClientEvent = Annotated[
    SessionStartEvent
    | SessionResumeEvent
    | SessionInteractionEvent
    | SessionPlaybackEvent
    | SessionPingEvent
    | SessionStopEvent,
    Field(discriminator="type"),
]
CLIENT_EVENT_TYPES = (
    "session.start",
    "session.resume",
    "session.interaction",
    "session.playback",
    "session.ping",
    "session.stop",
)


def describe_validation_error(error: ValidationError) -> str:
    """One line naming each bad field: ``width: Input should be ... ; prompt: Field required``."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"] if p not in CLIENT_EVENT_TYPES) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


# -- HTTP answers --------------------------------------------------------------------
# What the /v1/ routes answer, as the OpenAPI schema documents it. Routes return
# these models, so the server cannot answer a field the schema does not name
# (extra="forbid" also makes the schema say additionalProperties: false), and
# tests/e2e/test_first_contact.py validates real answers against /openapi.json.


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ErrorDetail(_Answer):
    code: str
    """A stable machine-readable code (docs/PROTOCOL.md lists them)."""
    message: str
    """What was wrong, for people, naming the field where there is one."""


class ErrorBody(_Answer):
    """Every error the HTTP API answers: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


class _ScheduledPromptAnswer(_Answer):
    at_chunk: int
    """The chunk it was scheduled for, as asked."""
    prompt: str
    """The prompt, as asked."""
    transition_chunks: int | None
    """The blend length asked for; null: the request's transition_chunks."""


class PendingPrompt(_ScheduledPromptAnswer):
    """Not reached yet."""

    status: Literal["pending"]
    """pending: the job has not reached its chunk yet."""


class AppliedPrompt(_ScheduledPromptAnswer):
    """Took effect: where, in chunks, frames and media time."""

    status: Literal["applied"]
    """applied: the prompt took effect."""
    generation_chunk_index: int
    """The chunk whose first frame the new prompt starts at."""
    first_frame_index: int
    """That frame's index in the video."""
    media_start_seconds: float
    """That frame's time in the video, in seconds (match it with a player's clock)."""


class SupersededPrompt(_ScheduledPromptAnswer):
    """Replaced before it took effect."""

    status: Literal["superseded"]
    """superseded: another prompt replaced it at the same boundary."""
    by_event_id: str
    """The one that replaced it."""


class RejectedPrompt(_ScheduledPromptAnswer):
    """Refused by the model."""

    status: Literal["rejected"]
    """rejected: it never took effect; error says why."""
    error: ErrorDetail


ScheduledPromptOutcome = Annotated[
    PendingPrompt | AppliedPrompt | SupersededPrompt | RejectedPrompt, Field(discriminator="status")
]


class VideoObject(_Answer):
    """A /v1/videos job: its request, its state, and where each scheduled prompt landed."""

    id: str
    """video_..."""
    object: Literal["video"]
    model: str
    """The served model that makes it."""
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    """queued (waiting for the engine, or not begun yet), in_progress, completed
    (its video is ready), failed (error says why; interrupted_by_restart when the
    server stopped before it finished), cancelled (deleted while it ran: only a
    DELETE answer says it)."""
    progress: int = Field(ge=0, le=100)
    """Chunks done over chunks, in percent."""
    created_at: int
    """Unix seconds."""
    completed_at: int | None
    """Unix seconds; null until the job ends."""
    expires_at: int | None
    """Unix seconds: when the finished job and its video are deleted (completed_at +
    job_ttl_s); null until the job ends."""
    error: ErrorDetail | None
    """Why it failed; null otherwise."""
    seconds: str
    """The video's length in seconds of media (num_frames / fps), as a decimal string
    (the OpenAI SDK's type)."""
    size: str
    """WIDTHxHEIGHT (the OpenAI SDK's form of width and height)."""
    format: Literal["fmp4", "jpeg", "raw"]
    """The media format of /content."""
    num_frames: int
    """Frames in the video (the first chunk may be shorter than the others: see GET /v1/models)."""
    num_chunks: int
    """Chunks the engine runs for it."""
    width: int
    height: int
    fps: float
    seed: int
    prompt: str
    """The prompt the job began with."""
    interactions: list[ScheduledPromptOutcome]
    """Each scheduled prompt as asked, with where it landed (or why not)."""
    inference_time_s: float
    """The worker's pipeline time for the chunks so far, in seconds."""
    exact: bool
    """Whether posting this request again regenerates the same bytes: true while
    every chunk so far ran alone; false once one ran in a forward batched with
    other sessions' rows, or with stream batch (inexact_reason says which)."""
    inexact_reason: str | None
    """Why exact is false; null when it is true."""
    input_strength: float | None
    """A job made from an input_reference: its input_strength (0.5 when the request
    gave none); null for a job made from its prompt alone."""

    @model_validator(mode="before")
    @classmethod
    def _stored_before_input_strength(cls, data: Any) -> Any:
        """A job stored by an earlier server, which did not report input_strength,
        reads null rather than failing to load."""
        if isinstance(data, dict) and "input_strength" not in data:
            return {**data, "input_strength": None}
        return data


class VideoList(_Answer):
    """A page of the jobs kept, in creation order (newest first unless order=asc)."""

    object: Literal["list"]
    data: list[VideoObject]
    first_id: str | None
    """The first job of this page; null when the page is empty."""
    last_id: str | None
    """The last job of this page: pass it as after= for the next page; null when the page is empty."""
    has_more: bool
    """Whether more jobs follow this page."""


class DeletedVideo(_Answer):
    """A job that was stopped if it ran, and forgotten."""

    id: str
    object: Literal["video.deleted"]
    """What the OpenAI SDK's VideoDeleteResponse expects."""
    deleted: Literal[True]
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    """Its status when it was deleted (cancelled if it had not finished)."""


class ModelDefaults(_Answer):
    width: int
    height: int
    fps: float
    num_inference_steps: int
    first_chunk_frames: int
    """Frames in chunk 0."""
    frames_per_chunk: int
    """Frames in every later chunk."""


class ModelCard(_Answer):
    id: str
    """The model's id: what a request's model field may name."""
    object: Literal["model"]
    owned_by: Literal["rtvideo"]
    """Who serves it: always rtvideo (the field OpenAI-style model lists carry)."""
    defaults: ModelDefaults
    """What a request that leaves these out gets."""
    prompts: list[str]
    """Prompts this model knows and draws (a demo model trained on synthetic
    scenes lists its captions); the bundled page suggests them. Empty when the
    model names none: any prompt is taken either way."""


class ModelList(_Answer):
    """The one model this server serves."""

    object: Literal["list"]
    data: list[ModelCard]


# -- resolution ----------------------------------------------------------------------


class RequestError(ValueError):
    """A request the server refuses; the message names the field."""


@dataclass(frozen=True)
class EffectiveConfig:
    """What a session or job runs with, defaults filled in: echoed in
    ``video.start.config``, kept on a job, and the base of the replay body."""

    model: str
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    fps: float
    num_frames: int | None  # None: until stopped
    num_chunks: int | None
    first_chunk_frames: int
    frames_per_chunk: int
    num_inference_steps: int
    format: str  # canonical: fmp4, jpeg or raw
    transition_chunks: int
    prompt_change: str
    max_lead_seconds: float | None  # None: not paced (always for a job)
    decoder: str = "full"  # full or tiny
    input: dict[str, Any] | None = None  # the input video (kind, strength, format, width, height, fps); None: none

    def wire(self) -> dict[str, Any]:
        return asdict(self)


def _frames_asked(
    request: VideoRequest, fps: float, first: int, per: int, max_frames: int, default_seconds: float | None
) -> int | None:
    """The frame count the request's length comes to: ``default_seconds`` of media
    when it gives none (None: until stopped). Past the server's ``max_frames`` the
    error names the field the client sent (``num_frames``, ``num_chunks`` or
    ``seconds``), in that field's unit, and says which server limit it hit."""
    limit = f"this server's max_frames is {max_frames} frames (rtvideo serve --max-frames)"
    given = (request.num_frames, request.num_chunks, request.seconds)
    if default_seconds is not None and all(length is None for length in given):
        num_frames = max(1, round(default_seconds * fps))
        if num_frames > max_frames:
            raise RequestError(
                f"seconds: none of num_frames, num_chunks, seconds was given, so the job is {default_seconds:g} s "
                f"({num_frames} frames at {fps:g} fps), past {limit}; give a shorter length"
            )
        return num_frames
    if request.seconds is not None:
        if request.seconds * fps > max_frames:  # checked before rounding: a huge float has no int
            most = max_frames / fps
            raise RequestError(f"seconds: at most {most:g} s at {fps:g} fps, asked for {request.seconds:g}; {limit}")
        return max(1, round(request.seconds * fps))
    if request.num_chunks is not None:
        num_frames = first + (request.num_chunks - 1) * per
        if num_frames > max_frames:
            most = 1 + (max_frames - first) // per if max_frames >= first else 0
            raise RequestError(
                f"num_chunks: at most {most} chunks ({first} frames, then {per} a chunk), "
                f"asked for {request.num_chunks}; {limit}"
            )
        return num_frames
    if request.num_frames is not None and request.num_frames > max_frames:
        raise RequestError(f"num_frames: at most {max_frames}, asked for {request.num_frames}; {limit}")
    return request.num_frames


def resolve(
    request: VideoRequest,
    session_id: str,
    defaults: SessionGeometry,
    settings: ServerSettings,
    model: str,
    paced: bool = True,
    default_seconds: float | None = None,
    video_input: VideoInput | None = None,
) -> tuple[StartSession, EffectiveConfig]:
    """The engine start for ``request`` and the effective configuration to echo.
    ``paced`` False (request mode) runs at full speed whatever ``max_lead_seconds`` says;
    ``default_seconds`` is the length of a request that gives none (None: until stopped).
    ``video_input`` (video to video) gives the session's width, height and fps, which
    the request must leave out or give the same (``input_geometry``)."""
    if request.model is not None and request.model != model:
        raise RequestError(f"model: this server serves {model!r}, not {request.model!r}")
    width, height, fps, named = input_geometry(request, video_input, defaults)
    if width > settings.max_width:
        raise RequestError(f"{named['width']}: at most {settings.max_width}, got {width}")
    if height > settings.max_height:
        raise RequestError(f"{named['height']}: at most {settings.max_height}, got {height}")
    first, per = defaults.first_chunk_frames, defaults.frames_per_chunk
    num_frames = _frames_asked(request, fps, first, per, settings.max_frames, default_seconds)
    num_chunks = None if num_frames is None else 1 + max(0, math.ceil((num_frames - first) / per))
    scheduled = []
    for i, item in enumerate(getattr(request, "interactions", [])):
        if num_chunks is not None and item.at_chunk >= num_chunks:
            raise RequestError(f"interactions.{i}.at_chunk: {item.at_chunk} is past the last chunk ({num_chunks - 1})")
        interaction = Interaction(prompt=item.prompt, transition_chunks=item.transition_chunks)
        scheduled.append(
            ScheduledInteraction(at_chunk=item.at_chunk, event_id=f"scheduled-{i}", interaction=interaction)
        )
    start = StartSession(
        session_id=session_id,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt or "",
        seed=request.seed,
        width=width,
        height=height,
        fps=fps,
        num_chunks=num_chunks,
        num_inference_steps=request.num_inference_steps,
        transition_chunks=request.transition_chunks,
        prompt_change=request.prompt_change,
        max_lead_seconds=request.max_lead_seconds if paced else None,
        decoder=request.decoder,
        input=video_input,
        scheduled=tuple(scheduled),
        reports_delivery=paced,  # a live session's server reports each chunk it wrote; a job's has no client
    )
    config = EffectiveConfig(
        model=model,
        prompt=request.prompt,
        negative_prompt=request.negative_prompt or "",
        seed=request.seed,
        width=width,
        height=height,
        fps=fps,
        num_frames=num_frames,
        num_chunks=num_chunks,
        first_chunk_frames=first,
        frames_per_chunk=per,
        num_inference_steps=request.num_inference_steps or defaults.num_inference_steps,
        format=FORMAT_ALIASES.get(request.format, request.format),
        transition_chunks=request.transition_chunks,
        prompt_change=request.prompt_change,
        max_lead_seconds=request.max_lead_seconds if paced else None,
        decoder=request.decoder or settings.decoder,
        input=None if video_input is None else msgspec.structs.asdict(video_input),
    )
    return start, config


def check_input_message(video_input: VideoInput | None, settings: ServerSettings) -> None:
    """A realtime session's raw input frame, with its header, fits in one WebSocket
    message (``max_message_bytes``); ``RequestError`` naming ``input.format`` otherwise."""
    if video_input is None or video_input.format != "raw":
        return
    width, height = video_input.width, video_input.height
    size = HEADER_BYTES + width * height * 3
    if size > settings.max_message_bytes:
        raise RequestError(
            f"input.format: a raw {width}x{height} frame is {size} bytes with its header, past this server's "
            f"max_message_bytes ({settings.max_message_bytes}); send jpeg frames, or a smaller size"
        )


def input_geometry(
    request: VideoRequest, video_input: VideoInput | None, defaults: SessionGeometry
) -> tuple[int, int, float, dict[str, str]]:
    """The session's width, height and fps, and the field each is named by in an
    error: the request's (the model's defaults where it gives none), or, with an
    input video, the input's (``input.width`` ...): the model restyles frames at
    the session's own size and rate, so a request that gives one of them must
    give the input's, else ``RequestError`` naming both."""
    if video_input is None:
        named = {"width": "width", "height": "height", "fps": "fps"}
        return (
            request.width or defaults.width,
            request.height or defaults.height,
            request.fps or defaults.fps,
            named,
        )
    for name in ("width", "height", "fps"):
        given, theirs = getattr(request, name), getattr(video_input, name)
        if given is not None and given != theirs:
            raise RequestError(
                f"input.{name}: {theirs:g} differs from the session's {name} ({given:g}); the model restyles frames "
                f"at the session's own size and rate: give the same {name}, or leave {name} out to take the input's"
            )
    named = {"width": "input.width", "height": "input.height", "fps": "input.fps"}
    return video_input.width, video_input.height, video_input.fps, named
