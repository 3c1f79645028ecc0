"""From engine results to protocol events: one ``SessionOutput`` per session.

API process, shared by the WebSocket endpoint and HTTP jobs. Chunks are
encoded off the event loop (``asyncio.to_thread``), one at a time per session
so fragments stay in order; frames past the requested ``num_frames`` are
trimmed from the last chunk. The replay body of a finished session is built
here from the engine's applied-interaction log, and says whether posting it
reproduces the frames bit for bit (``exact``): not when a chunk sent ran in a
forward batched with other sessions' rows, or with stream batch
(``inexact_reasons``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from rtvideo.engine.mailbox import EVENT_ID_WINDOW, IdWindow
from rtvideo.engine.messages import (
    ChunkReady,
    InteractionApplied,
    InteractionQueued,
    InteractionRejected,
    InteractionSuperseded,
    ResultMessage,
    SessionDone,
    SessionFailed,
)
from rtvideo.server.dispatch import TypeDispatcher
from rtvideo.server.events import (
    ChunkMetadata,
    ErrorEvent,
    InteractionAppliedEvent,
    InteractionQueuedEvent,
    InteractionSupersededEvent,
    SessionDoneEvent,
)
from rtvideo.server.media import make_encoder
from rtvideo.server.metrics import Metrics, SessionClock
from rtvideo.server.schemas import EffectiveConfig


@dataclass
class MediaChunk:
    metadata: dict[str, Any]  # the video.chunk_metadata event
    payload: bytes
    compute_s: float  # the worker's pipeline time for it
    fps: float  # the session's
    init_length: int = 0  # bytes of the payload that are the fmp4 init segment (the session's first chunk)
    frames: np.ndarray | None = None  # what was encoded: (n, height, width, 3) uint8, trimmed to num_frames

    @property
    def media_end_seconds(self) -> float:
        """Where the chunk's media ends, in session seconds."""
        return self.metadata["media_start_seconds"] + self.metadata["num_frames"] / self.fps


class SessionOutput:
    """``metrics`` counts frames and interactions; ``clock`` (realtime sessions
    only) also times the deliveries. A chunk goes through ``chunk``; every other
    session result through ``event`` (realtime) or ``count`` (request mode), each
    dispatched by the result's type."""

    def __init__(
        self, request_id: str, config: EffectiveConfig, metrics: Metrics, clock: SessionClock | None = None
    ) -> None:
        self.request_id = request_id
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._queued: dict[str, InteractionQueued] = {}
        self.encoder = make_encoder(config.format, config.width, config.height, config.fps)
        self.transport_index = 0
        self.frames_sent = 0
        self.chunks_sent = 0
        self.compute_ms = 0.0  # pipeline time of the chunks sent, from the worker
        self.inexact: dict[str, str] = {}  # why a replay would not be bit-exact: kind -> the first instance
        if config.input is not None and clock is not None:  # a job's request carries its input file; a replay not
            self.inexact["input"] = "the frames were made from the session's input video, which a replay does not carry"
        # event_id -> the controller that sent it (realtime sessions), for the newest ids, as the mailbox keeps them
        self.senders: IdWindow[str | None] = IdWindow(EVENT_ID_WINDOW)
        # The non-media session results (what a session's handle yields besides ChunkReady), by type.
        self._events: TypeDispatcher[dict[str, Any]] = TypeDispatcher(
            "SessionOutput.event",
            {
                InteractionQueued: self._queued_event,
                InteractionApplied: self._applied_event,
                InteractionSuperseded: self._superseded_event,
                InteractionRejected: self._rejected_event,
                SessionDone: self._done_event,
                SessionFailed: self._failed_event,
            },
        )
        self._counts: TypeDispatcher[None] = TypeDispatcher(
            "SessionOutput.count",
            {
                InteractionQueued: self._count_queued,
                InteractionApplied: self._count_applied,
                InteractionSuperseded: self._count_superseded,
                InteractionRejected: self._count_rejected,
                SessionDone: self._count_nothing,
                SessionFailed: self._count_nothing,
            },
        )

    async def chunk(self, ready: ChunkReady, taken: tuple[tuple[int, ...], int] | None = None) -> MediaChunk | None:
        """Encode one chunk; None when every frame of it is past ``num_frames``.
        ``taken`` (a session with an input): the client frame indexes the chunk
        was made from, and the input frames dropped so far in the session, for
        its metadata."""
        frames = np.frombuffer(ready.payload, dtype=np.uint8).reshape(ready.num_frames, ready.height, ready.width, 3)
        limit = self.config.num_frames
        if limit is not None:
            frames = frames[: max(0, limit - ready.first_frame_index)]
        if len(frames) == 0:
            return None
        self._note_exactness(ready)
        payload = await asyncio.to_thread(self.encoder.encode, frames, ready.first_frame_index)
        timing = ready.timing
        compute_ms = timing.boundary_ms + timing.denoise_ms + timing.decode_ms
        self.compute_ms += compute_ms
        if self.clock is None:  # request mode: no delivery clock, but the same compute and frame counts
            self.metrics.frames.inc(len(frames))
            self.metrics.compute.observe(compute_ms / 1000.0)
        metadata = ChunkMetadata(
            request_id=self.request_id,
            transport_chunk_index=self.transport_index,
            generation_chunk_index=ready.generation_chunk_index,
            num_frames=len(frames),
            first_frame_index=ready.first_frame_index,
            media_start_seconds=ready.media_start_seconds,
            byte_length=len(payload),
            started_event_ids=list(ready.started_event_ids),
            active_event_ids=list(ready.active_event_ids),
            completed_event_ids=list(ready.completed_event_ids),
            compute_ms=compute_ms,
            input_frame_indexes=None if taken is None else list(taken[0][: len(frames)]),
            input_frames_dropped=None if taken is None else taken[1],
        ).wire()
        init_length = len(self.init_segment) if self.chunks_sent == 0 else 0
        self.transport_index += 1
        self.frames_sent += len(frames)
        self.chunks_sent += 1
        return MediaChunk(metadata, payload, compute_ms / 1000.0, self.config.fps, init_length, frames)

    @property
    def init_segment(self) -> bytes:
        """The fmp4 init segment once the first chunk was encoded (b"" for the other formats)."""
        return getattr(self.encoder, "init", b"")

    def _note_exactness(self, ready: ChunkReady) -> None:
        """Note what makes a chunk sent depend on more than its session's own
        parameters (the first chunk of each kind), for ``replay``'s ``exact``."""
        timing, index = ready.timing, ready.generation_chunk_index
        if not timing.batch_exact and "batched" not in self.inexact:
            self.inexact["batched"] = (
                f"chunk {index} ran in a forward batched with {timing.batch_rows - 1} other session(s)' rows, "
                "which rounds differently from a forward of one row (values may differ by 1 level)"
            )
        if timing.chunks_in_flight > 1 and "stream_batch" not in self.inexact:
            self.inexact["stream_batch"] = (
                f"chunk {index} began while {timing.chunks_in_flight - 1} chunk(s) before it were still being "
                "denoised (stream batch): what it saw of them depends on scheduling"
            )

    @property
    def exact(self) -> bool:
        """Whether every chunk sent so far ran alone, without stream batch: its
        replay (the same request) then regenerates the same bytes."""
        return not self.inexact

    @property
    def inexact_reason(self) -> str | None:
        return "; ".join(self.inexact.values()) or None

    def delivered(self, chunk: MediaChunk) -> None:
        """A realtime chunk was written to the client's socket: only now is it
        delivered, for the delivery clock and ``/metrics``."""
        frames = chunk.metadata["num_frames"]
        self.clock.chunk(chunk.metadata["media_start_seconds"], frames / chunk.fps, frames, chunk.compute_s)

    def event(self, message: ResultMessage) -> dict[str, Any]:
        """The protocol event for a non-media session result (an interaction's
        answer or outcome, the session's end), counted on /metrics first
        (``count``). ``UnhandledMessageError`` for any other type (a chunk goes
        through ``chunk``)."""
        self.count(message)
        return self._events(message)

    def _queued_event(self, message: InteractionQueued) -> dict[str, Any]:
        return InteractionQueuedEvent(
            request_id=self.request_id,
            event_id=message.event_id,
            in_progress_chunk_index=message.in_progress_chunk_index,
            expected_chunk_index=message.expected_chunk_index,
            duplicate=message.duplicate,
        ).wire()

    def _applied_event(self, message: InteractionApplied) -> dict[str, Any]:
        return InteractionAppliedEvent(
            request_id=self.request_id,
            event_id=message.event_id,
            generation_chunk_index=message.generation_chunk_index,
            first_frame_index=message.first_frame_index,
            media_start_seconds=message.media_start_seconds,
            queued_to_applied_ms=message.queued_to_applied_ms,
            transition_chunks=message.transition_chunks,
            chunks_in_flight=message.chunks_in_flight,
            controller=self.senders.get(message.event_id),
        ).wire()

    def _superseded_event(self, message: InteractionSuperseded) -> dict[str, Any]:
        return InteractionSupersededEvent(
            request_id=self.request_id,
            event_id=message.event_id,
            by_event_id=message.by_event_id,
            controller=self.senders.get(message.event_id),
            by_controller=self.senders.get(message.by_event_id),
        ).wire()

    def _rejected_event(self, message: InteractionRejected) -> dict[str, Any]:
        return error_event(message.code, message.message, request_id=self.request_id, event_id=message.event_id)

    def _done_event(self, message: SessionDone) -> dict[str, Any]:
        return SessionDoneEvent(
            request_id=self.request_id,
            chunks=self.chunks_sent,
            frames=self.frames_sent,
            stopped=message.stopped,
            reason=message.reason,
            replay=self.replay(message),
        ).wire()

    def _failed_event(self, message: SessionFailed) -> dict[str, Any]:
        return error_event(message.code, message.message, request_id=self.request_id, fatal=True)

    def count(self, message: ResultMessage) -> None:
        """Count an interaction outcome on /metrics (queued, applied, ...); the
        session's end counts nothing here. Latency and lag are observed for
        interactions that were queued while the session ran, not for prompts
        scheduled at a chunk in advance (request mode), which wait for their
        chunk by design. ``UnhandledMessageError`` for a type that is no
        non-media session result."""
        self._counts(message)

    def _count_queued(self, message: InteractionQueued) -> None:
        self.metrics.interactions.labels("queued").inc()
        if not message.duplicate:  # a repeat's original is the one that applies
            self._queued[message.event_id] = message

    def _count_applied(self, message: InteractionApplied) -> None:
        self.metrics.interactions.labels("applied").inc()
        queued = self._queued.pop(message.event_id, None)
        if queued is not None:
            self.metrics.interaction_latency.observe(message.queued_to_applied_ms / 1000.0)
            in_progress = queued.in_progress_chunk_index
            reference = queued.expected_chunk_index - 1 if in_progress is None else in_progress
            self.metrics.interaction_lag.observe(message.generation_chunk_index - reference)

    def _count_superseded(self, message: InteractionSuperseded) -> None:
        self.metrics.interactions.labels("superseded").inc()
        self._queued.pop(message.event_id, None)  # it never applies

    def _count_rejected(self, message: InteractionRejected) -> None:
        self.metrics.interactions.labels("rejected").inc()

    def _count_nothing(self, message: SessionDone | SessionFailed) -> None:
        """The session's end: counted by whoever ends the session (``sessions`` on /metrics)."""

    def replay(self, done: SessionDone) -> dict[str, Any]:
        """A ``POST /v1/videos`` body that regenerates the frames sent: bit for bit
        when ``exact`` (else ``inexact_reason`` says why not; both are ignored
        when the body is posted)."""
        c = self.config
        exactness = {"exact": self.exact} if self.exact else {"exact": False, "inexact_reason": self.inexact_reason}
        return {
            "prompt": c.prompt,
            "negative_prompt": c.negative_prompt,
            "seed": c.seed,
            "width": c.width,
            "height": c.height,
            "fps": c.fps,
            "num_frames": self.frames_sent,
            "num_inference_steps": c.num_inference_steps,
            "format": c.format,
            "transition_chunks": c.transition_chunks,
            "prompt_change": c.prompt_change,
            "decoder": c.decoder,
            "interactions": [
                {"at_chunk": a.at_chunk, "prompt": a.prompt, "transition_chunks": a.transition_chunks}
                for a in done.applied
                if a.at_chunk < self.chunks_sent
            ],
            **exactness,
        }


def error_event(
    code: str,
    message: str,
    *,
    request_id: str | None = None,
    event_id: str | None = None,
    fatal: bool = False,
    frame_index: int | None = None,
) -> dict[str, Any]:
    return ErrorEvent(
        code=code, message=message, fatal=fatal, request_id=request_id, event_id=event_id, frame_index=frame_index
    ).wire()
