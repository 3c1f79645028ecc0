"""Model-independent checks of control messages, run by the worker's control plane.

Each check raises ``ValueError`` whose text names the offending field, so the
refusal the client receives says exactly what was wrong. Pipeline-specific
limits (sizes, step counts) are checked by the pipeline's ``describe``.
"""

from __future__ import annotations

from rtvideo.engine.limits import (
    DECODERS,
    INPUT_FORMATS,
    INPUT_KINDS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_TRANSITION_CHUNKS,
    PROMPT_CHANGE_MODES,
)
from rtvideo.engine.messages import Interaction, SessionGeometry, StartSession, VideoInput


def check_prompt(prompt: str, field: str) -> None:
    if not prompt.strip():
        raise ValueError(f"{field} must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"{field} is longer than {MAX_PROMPT_CHARS} characters")


def check_transition(value: int | None, field: str) -> None:
    if value is not None and not 0 <= value <= MAX_TRANSITION_CHUNKS:
        raise ValueError(f"{field} must be between 0 and {MAX_TRANSITION_CHUNKS}, got {value}")


def check_interaction(interaction: Interaction) -> None:
    check_prompt(interaction.prompt, "interaction.prompt")
    check_transition(interaction.transition_chunks, "interaction.transition_chunks")


def check_input(given: VideoInput) -> None:
    """A session's input stream, model-independent: its kind, format, a strength
    from 0 to 1, a positive size and rate. (Whether the model can encode it, and
    at which size, is its ``describe``'s to say.)"""
    if given.kind not in INPUT_KINDS:
        raise ValueError(f"input.kind must be one of {', '.join(INPUT_KINDS)}, got {given.kind!r}")
    if given.format not in INPUT_FORMATS:
        raise ValueError(f"input.format must be one of {', '.join(INPUT_FORMATS)}, got {given.format!r}")
    if not 0.0 <= given.strength <= 1.0:
        raise ValueError(f"input.strength must be between 0 and 1, got {given.strength}")
    for name, value in (("width", given.width), ("height", given.height)):
        if value < 1:
            raise ValueError(f"input.{name} must be >= 1, got {value}")
    if not 0.0 < given.fps < float("inf"):
        raise ValueError(f"input.fps must be > 0, got {given.fps}")


def check_geometry(geometry: SessionGeometry, what: str) -> None:
    """A session shape a model described (``what`` says whose, e.g. the model's
    default session): sizes of at least 2, a finite rate > 0, at least one step,
    chunks of at least one frame. The server divides by these: a model that
    declares otherwise is refused at start rather than failing each session."""
    for name, value, least in (
        ("width", geometry.width, 2),
        ("height", geometry.height, 2),
        ("num_inference_steps", geometry.num_inference_steps, 1),
        ("first_chunk_frames", geometry.first_chunk_frames, 1),
        ("frames_per_chunk", geometry.frames_per_chunk, 1),
    ):
        if value < least:
            raise ValueError(f"{what}: {name} must be >= {least}, got {value}")
    if not 0.0 < geometry.fps < float("inf"):
        raise ValueError(f"{what}: fps must be a finite number > 0, got {geometry.fps}")
    if geometry.num_chunks is not None and geometry.num_chunks < 1:
        raise ValueError(f"{what}: num_chunks must be >= 1 or unset, got {geometry.num_chunks}")
    check_transition(geometry.transition_chunks, f"{what}: transition_chunks")


def check_start(start: StartSession) -> None:
    if not start.session_id:
        raise ValueError("session_id must not be empty")
    check_prompt(start.prompt, "prompt")
    if not 0 <= start.seed <= MAX_SEED:
        raise ValueError(f"seed must be between 0 and {MAX_SEED}, got {start.seed}")
    if start.prompt_change not in PROMPT_CHANGE_MODES:
        raise ValueError(f"prompt_change must be one of {', '.join(PROMPT_CHANGE_MODES)}, got {start.prompt_change!r}")
    if start.decoder is not None and start.decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {start.decoder!r}")
    if start.num_chunks is not None and start.num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {start.num_chunks}")
    check_transition(start.transition_chunks, "transition_chunks")
    if start.input is not None:
        check_input(start.input)
    if start.max_lead_seconds is not None and not start.max_lead_seconds > 0:
        raise ValueError(f"max_lead_seconds must be > 0 or null, got {start.max_lead_seconds}")
    seen_chunks: set[int] = set()
    seen_ids: set[str] = set()
    for i, item in enumerate(start.scheduled):
        where = f"scheduled[{i}]"
        if item.at_chunk < 0:
            raise ValueError(f"{where}.at_chunk must be >= 0, got {item.at_chunk}")
        if start.num_chunks is not None and item.at_chunk >= start.num_chunks:
            raise ValueError(f"{where}.at_chunk {item.at_chunk} is past the last chunk ({start.num_chunks - 1})")
        if item.at_chunk in seen_chunks:
            raise ValueError(f"{where}.at_chunk {item.at_chunk} is scheduled twice")
        if not item.event_id or item.event_id in seen_ids:
            raise ValueError(f"{where}.event_id must be present and unique")
        seen_chunks.add(item.at_chunk)
        seen_ids.add(item.event_id)
        check_prompt(item.interaction.prompt, f"{where}.prompt")
        check_transition(item.interaction.transition_chunks, f"{where}.transition_chunks")
