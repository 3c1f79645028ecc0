"""The operator's prompt policy through the server as a subprocess, with real
clients: a refused start closes naming the field and the reason; a refused
interaction is answered on its own and the session streams on and takes the
next prompt; a job with one refused scheduled prompt is answered 400 and
nothing is kept; each refusal is counted where it came; a policy file that cannot be used
stops ``rtvideo serve`` in one line before anything loads."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.client import Chunk, interaction
from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_live_sessions import dial, fatal
from tests.e2e.test_realtime import metric, scrape
from tests.e2e.test_serve import serve

REASON = "storms are not served here"
START = {
    "type": "session.start",
    "prompt": "a lighthouse",
    "width": 32,
    "height": 24,
    "format": "raw",
    "max_lead_seconds": None,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "policy.json"
    policy.write_text(json.dumps({"deny": [r"\bstorms?\b"], "reason": REASON}))
    running = start_server("--prompt-policy", str(policy), pipeline={"step_time_s": 0.005})
    yield running
    stop_server(running)


def refusals(server, where: str) -> float:
    return metric(scrape(server), "rtvideo_prompts_refused_total", where=where)


async def test_a_refused_start_closes_naming_the_field_and_the_reason(server):
    before = scrape(server)
    received = await fatal(server.ws, {**START, "prompt": "a Storm at sea"})
    [error] = received.of("error")
    assert (error["code"], error["fatal"]) == ("prompt_refused", True)
    assert error["message"] == f"prompt: refused by this server's prompt policy: {REASON}"
    assert received.close_code == 1008 and not received.of("video.start")
    after = scrape(server)
    for name, labels in (("rtvideo_prompts_refused_total", {"where": "start"}),
                         ("rtvideo_session_rejections_total", {"reason": "prompt_refused"})):  # fmt: skip
        assert metric(after, name, **labels) == metric(before, name, **labels) + 1, name


async def test_a_refused_interaction_is_answered_alone_and_the_session_takes_the_next(server):
    counted = refusals(server, "interaction")
    client = await dial(server.ws)
    await client.send(START)
    await client.until("video.start")
    await client.send(interaction("a storm", "refused"))
    await client.send(interaction("a calm sea", "taken"))
    answers, applied = {}, None
    while applied is None:
        item = await client.next()
        if isinstance(item, Chunk):
            continue
        if item["type"] in ("error", "session.interaction.queued"):
            answers[item["event_id"]] = item
        elif item["type"] == "session.interaction.applied":
            applied = item
    refused = answers["refused"]
    assert (refused["code"], refused["fatal"]) == ("prompt_refused", False), refused
    assert refused["message"] == f"interaction.event.prompt: refused by this server's prompt policy: {REASON}"
    assert answers["taken"]["type"] == "session.interaction.queued" and applied["event_id"] == "taken"
    while not (chunks := client.received.chunks) or (
        chunks[-1].metadata["generation_chunk_index"] < applied["generation_chunk_index"]
    ):
        await client.next()  # the session streams on to the chunk the taken prompt begins at
    await client.send({"type": "session.stop"})
    assert (await client.rest()).of("session.done")[0]["reason"] == "stopped"
    assert refusals(server, "interaction") == counted + 1


def test_a_job_with_a_refused_scheduled_prompt_is_answered_400_and_nothing_is_kept(server):
    job = {"prompt": "a lighthouse", "width": 32, "height": 24, "interactions": [{"at_chunk": 1, "prompt": "storms"}]}
    before, counted = httpx.get(f"{server.http}/v1/videos", timeout=10).json()["data"], refusals(server, "job")
    response = httpx.post(f"{server.http}/v1/videos", json=job, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json() == {
        "error": {
            "code": "prompt_refused",
            "message": f"interactions[0].prompt: refused by this server's prompt policy: {REASON}",
        }
    }
    assert httpx.get(f"{server.http}/v1/videos", timeout=10).json()["data"] == before
    assert refusals(server, "job") == counted + 1
    documented = httpx.get(f"{server.http}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert "prompt_refused" in documented[path]["post"]["responses"]["400"]["description"], path
    taken = httpx.post(f"{server.http}/v1/videos", json={**job, "interactions": []}, timeout=30)
    assert taken.status_code == 202, taken.text  # accepted: the same job without the refused prompt


def test_a_policy_that_cannot_be_used_stops_the_server_in_one_line(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"deny": ["(unclosed"]}))
    ran = serve("--model", "stub", "--prompt-policy", str(policy))
    assert ran.returncode != 0 and ran.stdout == ""
    [line] = ran.stderr.splitlines()
    assert line.startswith(f"rtvideo serve: --prompt-policy {policy}: deny[0] '(unclosed' is no regex"), line
    missing = serve("--model", "stub", "--prompt-policy", "no_such_module:check")
    assert missing.stderr.splitlines() == [
        "rtvideo serve: --prompt-policy no_such_module:check: cannot be imported "
        "(ModuleNotFoundError: No module named 'no_such_module')"
    ], missing.stderr
