"""Bad input gets its documented error, and a session streaming beside it is
unharmed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.client import Realtime, interaction, open_realtime

START = {"type": "session.start", "prompt": "a lantern", "format": "raw"}


async def first_message_fails(url: str, message: str | bytes) -> tuple[dict, int]:
    async with open_realtime(url) as ws:
        client = Realtime(ws)
        await client.send(message)
        got = await client.rest(timeout=15)
    [error] = got.of("error")
    return error, got.close_code


FIRST_MESSAGE_CASES = [
    ("not json at all", "invalid_json", "JSON"),
    ("[1, 2, 3]", "invalid_message", "list"),
    (json.dumps({"type": "session.dance"}), "unknown_type", "session.dance"),
    (json.dumps({"type": "session.start"}), "invalid_event", "prompt"),
    (json.dumps({**START, "width": "wide"}), "invalid_event", "width"),
    (json.dumps({**START, "width": -32}), "invalid_event", "width"),
    # Types strictly: no string for a number, no number for a boolean, no fraction for an integer.
    (json.dumps({**START, "width": "64"}), "invalid_event", "width: Input should be a valid integer"),
    (json.dumps({**START, "width": 64.0}), "invalid_event", "width: Input should be a valid integer"),
    (json.dumps({**START, "shared_control": 1}), "invalid_event", "shared_control: Input should be a valid boolean"),
    (json.dumps({**START, "height": 100_000}), "invalid_request", "height"),
    (json.dumps({**START, "num_inference_steps": 0}), "invalid_event", "num_inference_steps"),
    (json.dumps({**START, "format": "gif"}), "invalid_event", "format"),
    (json.dumps({**START, "num_frames": 10**9}), "invalid_request", "num_frames"),
    (json.dumps({**START, "num_frames": 4, "seconds": 2}), "invalid_event", "num_frames"),
    (json.dumps({**START, "colour": "blue"}), "invalid_event", "colour"),
    (json.dumps({**START, "negative_prompt": "blurry"}), "invalid_request", "negative_prompt"),
    (json.dumps({**START, "prompt_change": "melt"}), "invalid_event", "prompt_change"),
    (json.dumps({**START, "transition_chunks": 65}), "invalid_event", "transition_chunks"),
    (
        json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}}),
        "start_required",
        "session.interaction",
    ),
    (b"\x00\x01binary", "binary_not_supported", "JSON"),
    ("[" * 1000 + "]" * 1000, "invalid_message", "JSON nested 1000 levels deep; at most 32"),
    ('{"type": "session.start", "prompt": "p", "x": ' + "[" * 40 + "]" * 40 + "}", "invalid_message", "41 levels"),
    ('{"type": "session.start", "prompt": "p", "seconds": Infinity}', "invalid_event", "seconds"),
    ('{"type": "session.start", "prompt": "p", "fps": NaN}', "invalid_event", "fps"),
    (json.dumps({**START, "seconds": 1e308}), "invalid_request", "seconds: at most"),
    # The default length limit, 4800 frames, is five minutes at 16 fps.
    (json.dumps({**START, "seconds": 300.1}), "invalid_request", "seconds: at most 300 s at 16 fps"),
    (json.dumps({**START, "num_frames": 4801}), "invalid_request", "max_frames is 4800 frames"),
]


@pytest.mark.parametrize(("message", "code", "names"), FIRST_MESSAGE_CASES)
async def test_bad_first_messages_are_fatal_with_1008(server, message, code, names):
    error, close_code = await first_message_fails(server.ws, message)
    assert error["code"] == code and error["fatal"] is True
    assert names in error["message"]
    assert close_code == 1008


@pytest.mark.parametrize("message", ["hello", "[1]", b"\x00", json.dumps({"type": "start"})])
async def test_a_first_message_that_is_no_event_quotes_a_session_start_that_works(server, message):
    """Plain text (or anything that is not an event) as the first message: the
    error ends with a session.start to send instead, and it starts a session."""
    error, close_code = await first_message_fails(server.ws, message)
    assert close_code == 1008
    head, example = error["message"].split("; begin with a JSON text message like ")
    assert head.startswith(("the first message is not JSON (", "clients send", "a message must", "unknown message"))
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(example)  # as the error gives it, text
        assert (await client.until("video.start"))["config"]["prompt"] == "a red circle moving right"
        await client.send({"type": "session.stop"})
        assert (await client.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_bad_first_messages_leave_a_streaming_session_unharmed(server):
    async with open_realtime(server.ws) as bystander_ws:
        bystander = Realtime(bystander_ws)
        await bystander.send({**START, "prompt": "bystander", "max_lead_seconds": None})
        await bystander.until("video.start")
        await bystander.next()
        for message, code, _ in FIRST_MESSAGE_CASES:
            error, close_code = await first_message_fails(server.ws, message)
            assert (error["code"], close_code) == (code, 1008)
        before = len(bystander.received.chunks)
        for _ in range(3):
            await bystander.next()
        assert len(bystander.received.chunks) > before
        assert server.health()["sessions"] == 1  # only the bystander: no refused start left a session
        await bystander.send({"type": "session.stop"})
        assert (await bystander.rest()).of("session.done")[0]["reason"] == "stopped"


async def test_bad_messages_during_a_session_are_not_fatal_and_harm_no_one(server):
    async with open_realtime(server.ws) as bystander_ws, open_realtime(server.ws) as ws:
        bystander = Realtime(bystander_ws)
        await bystander.send({**START, "prompt": "bystander"})
        await bystander.until("video.start")

        client = Realtime(ws)
        await client.send(START)
        await client.until("video.start")
        await client.send(interaction("ok", "e"))
        await client.until("session.interaction.queued")
        cases = [
            ("not json", "invalid_json"),
            ("[]", "invalid_message"),
            (json.dumps({"type": "nope"}), "unknown_type"),
            (json.dumps({"type": "session.interaction", "interaction": {"event": {}}}), "invalid_interaction"),
            (
                json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": ""}}}),
                "invalid_interaction",
            ),
            (
                json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "  "}}}),
                "invalid_interaction",
                "interaction.event.prompt: Value error, must not be blank",  # the wire's field, by the server
            ),
            (json.dumps({"type": "session.playback", "position_seconds": "1.5"}), "invalid_event", "a valid number"),
            (
                json.dumps(
                    {"type": "session.interaction", "interaction": {"event_id": "e", "event": {"prompt": "other"}}}
                ),
                "event_id_conflict",
            ),
            (json.dumps(START), "session_already_started"),
            (b"\x00\x01", "binary_not_supported"),
            (json.dumps({"type": "session.playback", "position_seconds": -1}), "invalid_event"),
            ('{"type": "session.playback", "position_seconds": Infinity}', "invalid_event"),
            ("[" * 1000 + "]" * 1000, "invalid_message"),
            # Brackets inside a string are not nesting: this one is parsed (and its event id reused).
            (json.dumps({**interaction("[" * 40, "e")}), "event_id_conflict"),
        ]
        for raw, code, *names in cases:
            await client.send(raw)
            error = await client.until("error")
            assert error["code"] == code, (raw, error)
            assert error["fatal"] is False
            assert all(name in error["message"] for name in names), (raw, error)
        # The session still works: a valid interaction is queued and applied.
        await client.send(
            {"type": "session.interaction", "interaction": {"event_id": "f", "event": {"prompt": "fine"}}}
        )
        await client.until("session.interaction.applied")
        await client.send({"type": "session.stop"})
        got = await client.rest()
        assert got.of("session.done")[0]["reason"] == "stopped"

        before = len(bystander.received.chunks)
        await bystander.next()
        await bystander.next()
        assert len(bystander.received.chunks) > before
        await bystander.send({"type": "session.stop"})
        assert (await bystander.rest()).of("session.done")


async def test_a_huge_message_closes_with_1009(make_server):
    server = make_server("--max-message-bytes", "4096")
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send(START)
        await client.until("video.start")
        await client.send(json.dumps({"type": "session.ping", "pad": "x" * 10_000}))
        got = await client.rest()
    assert got.close_code == 1009
    for _ in range(100):  # the session behind it is freed
        if server.health()["sessions"] == 0:
            break
        await asyncio.sleep(0.05)
    assert server.health()["sessions"] == 0


async def test_no_start_in_time_is_an_error_then_1008(make_server):
    server = make_server("--start-timeout-s", "0.3")
    async with open_realtime(server.ws) as ws:
        got = await Realtime(ws).rest()
    assert got.of("error")[0]["code"] == "start_timeout" and got.close_code == 1008


@pytest.mark.parametrize("negative", [None, "", "  "])
async def test_a_blank_negative_prompt_is_no_negative_prompt(server, negative):
    async with open_realtime(server.ws) as ws:
        client = Realtime(ws)
        await client.send({**START, "num_chunks": 1, "negative_prompt": negative})
        started = await client.until("video.start")
        got = await client.rest()
    assert started["config"]["negative_prompt"] == (negative or "")
    assert got.of("session.done") and not got.of("error")


def test_a_job_with_a_negative_prompt_is_refused_naming_the_field(server):
    body = {"prompt": "a lantern", "num_chunks": 1, "format": "raw", "negative_prompt": "blurry"}
    refused = httpx.post(f"{server.http}/v1/videos", json=body)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_request"
    assert refused.json()["error"]["message"].startswith("negative_prompt: ")
    assert "classifier-free guidance" in refused.json()["error"]["message"]
