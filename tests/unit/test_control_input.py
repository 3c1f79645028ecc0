"""The control plane keeps a video-to-video session's input frames for their
boundaries, in chunk order, and fails the session (``invalid_input``, naming
the fault) for frames it does not take; under pipeline ranks as on one rank."""

from __future__ import annotations

import pytest

from rtvideo.engine.config import EngineConfig
from rtvideo.engine.control import ControlPlane
from rtvideo.engine.limits import MAX_INPUT_CHUNKS_AHEAD
from rtvideo.engine.messages import SessionGeometry, SessionStarted, StartSession, SubmitInput, VideoInput

GEOMETRY = SessionGeometry(
    width=6,
    height=4,
    fps=16.0,
    num_inference_steps=2,
    first_chunk_frames=3,
    frames_per_chunk=2,
    num_chunks=None,
    transition_chunks=0,
)
INPUT = VideoInput(strength=0.5, format="raw", width=6, height=4, fps=16.0)


def _control(pp: int = 1) -> tuple[ControlPlane, list]:
    sent: list = []
    return ControlPlane(EngineConfig(pp=pp), lambda start: GEOMETRY, sent.append), sent


def _frames(index: int, count: int | None = None, width: int = 6, height: int = 4, extra: int = 0) -> SubmitInput:
    count = (3 if index == 0 else 2) if count is None else count
    data = bytes(count * width * height * 3 + extra)
    return SubmitInput(session_id="s", chunk_index=index, count=count, height=height, width=width, frames=data)


def test_frames_are_kept_in_order_for_their_boundaries():
    control, sent = _control()
    control.handle(StartSession(session_id="s", prompt="p", input=INPUT))
    assert isinstance(sent[0], SessionStarted)
    assert control.inputs_through("s") == 0 and control.take_input("s", 0) is None
    control.handle(_frames(0))
    control.handle(_frames(1))
    assert control.inputs_through("s") == 2 and control.fault("s") is None
    assert control.take_input("s", 0) == _frames(0)
    assert control.take_input("s", 0) is None  # handed over once
    assert control.take_input("s", 1) == _frames(1)


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (_frames(0, count=2), "chunk 0 takes 3 input frames of 6x4 ([3, 4, 6, 3]), got 2 of 6x4"),
        (_frames(0, width=8), "chunk 0 takes 3 input frames of 6x4 ([3, 4, 6, 3]), got 3 of 8x4"),
        (_frames(0, extra=5), "chunk 0's input frames are 221 bytes; 3 uint8 RGB frames of 6x4 are 216"),
        (_frames(1), "input frames for chunk 1 came out of order: chunk 0's come next"),
    ],
)
def test_frames_it_does_not_take_fail_the_session_naming_the_fault(message, says):
    control, _ = _control()
    control.handle(StartSession(session_id="s", prompt="p", input=INPUT))
    seen, _ = control.pacing_state()
    control.handle(message)
    assert control.fault("s") == ("invalid_input", f"session s: {says}")
    assert control.wait(seen, timeout=0) is True  # the loop is woken to end it
    control.handle(_frames(0))  # nothing more is taken from a failed session
    assert control.inputs_through("s") == 0


def test_a_repeated_chunk_fails_the_session():
    control, _ = _control()
    control.handle(StartSession(session_id="s", prompt="p", input=INPUT))
    control.handle(_frames(0))
    control.handle(_frames(0))
    said = "session s: input frames for chunk 0 already came: chunk 1's come next"
    assert control.fault("s") == ("invalid_input", said)


def test_frames_for_a_session_without_an_input_fail_it():
    control, _ = _control()
    control.handle(StartSession(session_id="s", prompt="p"))
    assert control.inputs_through("s") is None
    control.handle(_frames(0))
    code, message = control.fault("s")
    assert code == "invalid_input" and "opened without an input: it takes no frames" in message


def test_frames_for_no_session_are_dropped():
    control, sent = _control()
    control.handle(_frames(0))
    assert sent == [] and control.fault("s") is None


def test_pipeline_ranks_take_an_input_at_start():
    """The split pipeline decides (the ring runner's ``describe``): the control
    plane admits an input under pipeline ranks as on one rank."""
    control, sent = _control(pp=2)
    control.handle(StartSession(session_id="s", prompt="p", input=INPUT))
    assert isinstance(sent[0], SessionStarted)
    control.handle(_frames(0))
    assert control.inputs_through("s") == 1 and control.fault("s") is None


def test_frames_past_the_chunks_that_may_wait_fail_the_session():
    """At most ``MAX_INPUT_CHUNKS_AHEAD`` chunks' frames wait, counted from the
    chunk about to begin: the next one past them fails the session, naming it."""
    control, _ = _control()
    control.handle(StartSession(session_id="s", prompt="p", input=INPUT))
    for index in range(MAX_INPUT_CHUNKS_AHEAD):
        control.handle(_frames(index))
    assert control.fault("s") is None and control.inputs_through("s") == MAX_INPUT_CHUNKS_AHEAD
    control.handle(_frames(MAX_INPUT_CHUNKS_AHEAD))
    said = (
        "session s: input frames for chunk 4 came 4 chunks ahead of the chunk about to begin (0); "
        "at most 4 chunks of input may wait"
    )
    assert MAX_INPUT_CHUNKS_AHEAD == 4 and control.fault("s") == ("invalid_input", said)
