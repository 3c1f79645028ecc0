"""The server -> client events of ``WS /v1/realtime/video``, as pydantic models.

API process. ``rtvideo.server.output`` and ``rtvideo.server.realtime`` build every event
through these, so each one has a checked shape; ``.wire()`` gives the JSON
object sent on the socket (optional fields left out when unset).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class VideoStart(_Event):
    type: Literal["video.start"] = "video.start"
    request_id: str
    format: str
    config: dict[str, Any]  # the effective parameters after defaults
    role: Literal["controller", "spectator"] = "controller"
    controller_id: str | None = None  # this connection's id among the session's controllers
    resumed: bool | None = None  # true on a connection that resumed the session
    resume_token: str | None = None  # to the controller that started (or resumed) the session
    watch_token: str | None = None  # to controllers: spectators join with ?watch=
    control_token: str | None = None  # to controllers of a shared_control session: ?control=


class ChunkMetadata(_Event):
    type: Literal["video.chunk_metadata"] = "video.chunk_metadata"
    request_id: str
    kind: Literal["media", "trailer"] = "media"
    transport_chunk_index: int
    generation_chunk_index: int
    num_frames: int
    first_frame_index: int
    media_start_seconds: float
    byte_length: int
    started_event_ids: list[str]
    active_event_ids: list[str]
    completed_event_ids: list[str]
    compute_ms: float  # the worker's pipeline time for this chunk
    input_frame_indexes: list[int] | None = None  # video to video: the client frames it was made from, in order
    input_frames_dropped: int | None = None  # video to video: input frames dropped so far in the session


class InteractionQueuedEvent(_Event):
    type: Literal["session.interaction.queued"] = "session.interaction.queued"
    request_id: str
    event_id: str
    in_progress_chunk_index: int | None
    expected_chunk_index: int
    duplicate: bool

    def wire(self) -> dict[str, Any]:
        return self.model_dump()  # in_progress_chunk_index is null between chunks, not absent


class InteractionAppliedEvent(_Event):
    type: Literal["session.interaction.applied"] = "session.interaction.applied"
    request_id: str
    event_id: str
    generation_chunk_index: int
    first_frame_index: int
    media_start_seconds: float
    queued_to_applied_ms: float
    transition_chunks: int
    chunks_in_flight: int
    controller: str | None = None  # the controller that sent it


class InteractionSupersededEvent(_Event):
    type: Literal["session.interaction.superseded"] = "session.interaction.superseded"
    request_id: str
    event_id: str
    by_event_id: str
    controller: str | None = None  # the controller that sent the replaced one
    by_controller: str | None = None  # the controller whose event won


class SessionPong(_Event):
    type: Literal["session.pong"] = "session.pong"
    request_id: str


class SessionDoneEvent(_Event):
    type: Literal["session.done"] = "session.done"
    request_id: str
    chunks: int
    frames: int
    stopped: bool
    reason: str
    replay: dict[str, Any]  # a POST /v1/videos body that regenerates this session


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str
    message: str
    fatal: bool = False
    request_id: str | None = None
    event_id: str | None = None
    frame_index: int | None = None  # an input frame refused: its index (absent when it had none)
