"""Refusals name the field the client sent, in that field's unit, and say which
server limit was hit (``resolve`` for lengths; ``describe_body_errors`` for a
body that is not a JSON object)."""

from __future__ import annotations

import json

import pytest

from rtvideo.engine.client.errors import EngineDeadError, EngineRestartingError
from rtvideo.engine.messages import SessionGeometry
from rtvideo.server.app import describe_body_errors, engine_unavailable_response
from rtvideo.server.schemas import JobRequest, RequestError, resolve
from rtvideo.server.settings import ServerSettings

# The tiny model's shape: 9 frames in chunk 0, then 12 a chunk, 16 fps.
TINY = SessionGeometry(
    width=64, height=64, fps=16.0, num_inference_steps=4, first_chunk_frames=9, frames_per_chunk=12,
    num_chunks=None, transition_chunks=0,
)  # fmt: skip
SETTINGS = ServerSettings(max_frames=93)  # exactly 8 chunks


def refusal(**fields) -> str:
    with pytest.raises(RequestError) as caught:
        resolve(JobRequest(prompt="p", **fields), "job", TINY, SETTINGS, "tiny", paced=False)
    return str(caught.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"num_chunks": 9}, "num_chunks: at most 8 chunks (9 frames, then 12 a chunk), asked for 9;"),
        ({"num_chunks": 100_000}, "num_chunks: at most 8 chunks"),
        ({"seconds": 7200}, "seconds: at most 5.8125 s at 16 fps, asked for 7200;"),
        ({"num_frames": 94}, "num_frames: at most 93, asked for 94;"),
    ],
)
def test_a_length_past_max_frames_names_the_field_that_was_sent(fields, expected):
    message = refusal(**fields)
    assert message.startswith(expected), message
    assert message.endswith("this server's max_frames is 93 frames (rtvideo serve --max-frames)")


def test_lengths_at_the_limit_are_accepted():
    for fields in ({"num_chunks": 8}, {"num_frames": 93}, {"seconds": 93 / 16}):
        _, config = resolve(JobRequest(prompt="p", **fields), "job", TINY, SETTINGS, "tiny", paced=False)
        assert (config.num_frames, config.num_chunks) == (93, 8), fields


def test_a_body_that_is_not_a_json_object_says_what_was_wrong():
    bad_json = [
        {"type": "json_invalid", "loc": ("body", 18), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}
    ]
    assert describe_body_errors(bad_json) == "body: not valid JSON (Expecting value) at character 18"
    form = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be ...", "input": b"prompt=x"}]
    assert describe_body_errors(form, "application/x-www-form-urlencoded") == (
        "body: expected a JSON object with content-type: application/json, "
        "got content-type application/x-www-form-urlencoded"
    )
    listed = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be ...", "input": [1]}]
    assert describe_body_errors(listed) == "body: expected a JSON object, got list"
    field = [{"type": "int_parsing", "loc": ("body", "interactions", 0, "at_chunk"), "msg": "Input should be an int"}]
    assert describe_body_errors(field) == "interactions.0.at_chunk: Input should be an int"


def test_a_job_without_a_length_is_four_seconds_and_a_session_runs_until_stopped():
    from rtvideo.server.schemas import DEFAULT_JOB_SECONDS

    request = JobRequest(prompt="p")
    _, job = resolve(request, "job", TINY, ServerSettings(), "tiny", paced=False, default_seconds=DEFAULT_JOB_SECONDS)
    assert (job.num_frames, job.num_chunks) == (64, 6)  # 9 + 5 x 12 = 69 frames made, the last chunk trimmed to 7
    _, session = resolve(request, "session", TINY, ServerSettings(), "tiny")
    assert (session.num_frames, session.num_chunks) == (None, None)
    with pytest.raises(RequestError, match=r"^seconds: none of num_frames, num_chunks, seconds was given, so the job"):
        resolve(request, "job", TINY, ServerSettings(max_frames=50), "tiny", paced=False, default_seconds=4.0)


def test_a_call_cut_short_by_a_death_is_told_to_retry_once_the_restart_began():
    """The 503 names what failed the call; ``Retry-After`` comes from the error,
    or from what the engine says at the answer (a fresh worker on its way)."""
    died = EngineDeadError("worker process 41 died (SIGKILL)")
    restarting = EngineRestartingError("the worker is restarting (it died); retry in 3 s", 2.2)
    for now, retry in ((restarting, "3"), (None, None), (EngineDeadError("the restart budget is spent"), None)):
        answer = engine_unavailable_response(died, now)
        assert answer.status_code == 503 and answer.headers.get("retry-after") == retry
        assert json.loads(answer.body)["error"] == {"code": "engine_unavailable", "message": str(died)}
    assert engine_unavailable_response(restarting).headers["retry-after"] == "3"


def test_frame_bounds_that_admit_no_session_refuse_the_start_and_below_the_default_are_warned_of(caplog):
    from rtvideo.engine.messages import ModelLimits
    from rtvideo.server.app import _default_refused

    limits = ModelLimits(size_multiple=16, max_size=1280, max_inference_steps=4, max_fps=60.0)
    assert _default_refused(TINY, limits, ServerSettings()) is None and not caplog.records
    assert _default_refused(TINY, limits, ServerSettings(max_width=2)) == (
        "max_width 2 is below the smallest frame the model makes, 16x16: no session could be served"
    )
    assert _default_refused(TINY, limits, ServerSettings(max_height=48)) is None  # a 48-row server: sizes asked for
    assert "max_height 48 is below the model's default session, 64x64: sessions must ask for a smaller size" in (
        caplog.text
    )
