"""The server's real answers are what its own /openapi.json documents: every
status code is listed for its route, every content type too, and every JSON
body validates against the documented schema (typed models, closed: a field
the schema does not name fails). Driven over HTTP against ``rtvideo serve``."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import jsonschema
import pytest

KEY = "answers-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}


@pytest.fixture(scope="module")
def served():
    from tests.e2e.conftest import start_server, stop_server

    server = start_server("--api-key", KEY, pipeline={"step_time_s": 0.002, "width": 64, "height": 64})
    spec = httpx.get(f"{server.http}/openapi.json").json()
    yield server, spec
    stop_server(server)


def check(spec: dict, method: str, route: str, answer: httpx.Response) -> dict | None:
    """``answer`` is documented for ``method route``; its JSON body (returned) validates."""
    operation = spec["paths"][route][method]
    documented = operation["responses"].get(str(answer.status_code))
    assert documented is not None, f"{method} {route} answered {answer.status_code}, not documented: {answer.text}"
    media_type = answer.headers["content-type"].split(";")[0]
    assert media_type in documented.get("content", {}), (method, route, answer.status_code, media_type)
    if media_type != "application/json":
        return None
    body = answer.json()
    schema = {**documented["content"][media_type]["schema"], "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(body)
    return body


def wait_for(http: str, video_id: str, *statuses: str) -> dict:
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{http}/v1/videos/{video_id}", headers=AUTH).json())["status"] not in statuses:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    return job


def test_real_answers_match_the_documented_schema(served):
    server, spec = served
    http = server.http
    get = lambda path, **kw: httpx.get(http + path, headers=kw.pop("headers", AUTH), **kw)  # noqa: E731

    models = check(spec, "get", "/v1/models", get("/v1/models"))
    assert models["data"][0]["defaults"]["width"] == 64
    check(spec, "get", "/v1/models", get("/v1/models", headers={}))  # 401

    body = {
        "prompt": "a windmill",
        "num_chunks": 4,
        "format": "fmp4",
        "interactions": [{"at_chunk": 2, "prompt": "a storm", "transition_chunks": 2}],
    }
    created = check(spec, "post", "/v1/videos", httpx.post(f"{http}/v1/videos", json=body, headers=AUTH))
    assert created["interactions"][0]["status"] == "pending"
    wait_for(http, created["id"], "completed")
    done = check(spec, "get", "/v1/videos/{video_id}", get(f"/v1/videos/{created['id']}"))
    assert done["interactions"][0]["status"] == "applied"
    content = get(f"/v1/videos/{created['id']}/content")
    check(spec, "get", "/v1/videos/{video_id}/content", content)
    assert content.headers["content-type"] == "video/mp4"

    long = httpx.post(f"{http}/v1/videos", json={**body, "num_chunks": 1000, "format": "raw"}, headers=AUTH).json()
    wait_for(http, long["id"], "in_progress")
    check(spec, "get", "/v1/videos/{video_id}/content", get(f"/v1/videos/{long['id']}/content"))  # 409
    listed = check(spec, "get", "/v1/videos", get("/v1/videos"))
    assert [job["id"] for job in listed["data"]] == [long["id"], created["id"]]
    gone = httpx.delete(f"{http}/v1/videos/{long['id']}", headers=AUTH)
    deleted = check(spec, "delete", "/v1/videos/{video_id}", gone)
    assert deleted == {"id": long["id"], "object": "video.deleted", "deleted": True, "status": "cancelled"}
    check(spec, "get", "/v1/videos/{video_id}", get(f"/v1/videos/{long['id']}"))  # 404 now

    for refused in (
        httpx.post(f"{http}/v1/videos", json={**body, "num_chunks": 10**6}, headers=AUTH),
        httpx.post(f"{http}/v1/videos", content=b'{"prompt": "p", "num_chunks": }', headers=JSON),
        httpx.post(f"{http}/v1/videos", json={**body, "width": "wide"}, headers=AUTH),
    ):
        error = check(spec, "post", "/v1/videos", refused)
        assert refused.status_code == 422 and error["error"]["code"] == "invalid_request"
    sync = httpx.post(f"{http}/v1/videos/sync", json={**body, "format": "raw"}, headers=AUTH, timeout=60)
    check(spec, "post", "/v1/videos/sync", sync)
    assert sync.headers["content-type"] == "application/octet-stream"


def test_refusals_name_the_field_that_was_sent(served):
    server, _ = served
    cases = [
        ({"prompt": "p", "num_chunks": 100_000}, "num_chunks: at most"),
        ({"prompt": "p", "seconds": 7200}, "seconds: at most"),
        ({"prompt": "p", "num_frames": 10**9}, "num_frames: at most"),
    ]
    for body, start in cases:
        refused = httpx.post(f"{server.http}/v1/videos", json=body, headers=AUTH)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 422 and message.startswith(start), message
        assert "max_frames" in message, message
    bad_json = httpx.post(f"{server.http}/v1/videos", content=b'{"prompt": "p", "num_chunks": }', headers=JSON)
    assert bad_json.json()["error"]["message"] == "body: not valid JSON (Expecting value) at character 30"
    text = httpx.post(f"{server.http}/v1/videos", content=b"prompt=p", headers={**AUTH, "content-type": "text/plain"})
    assert "content-type: application/json" in text.json()["error"]["message"]
    form = httpx.post(f"{server.http}/v1/videos", data={"prompt": "p", "seconds": "x"}, headers=AUTH)  # a body too
    assert form.status_code == 422 and form.json()["error"]["message"].startswith("seconds:")


def test_json_sent_as_a_form_says_to_add_the_content_type(served):
    """``curl -d '{...}'`` without a content type posts the JSON urlencoded (one
    form field whose name is the JSON): the answer says what to add, not that
    prompt is missing."""
    server, spec = served
    expected = (
        "body: this is JSON sent as a form (content-type application/x-www-form-urlencoded, what curl -d sends "
        "unless told); add -H 'content-type: application/json'"
    )
    form = {**AUTH, "content-type": "application/x-www-form-urlencoded"}
    for body in (b'{"prompt": "p", "num_chunks": 2}', b' [{"prompt": "p"}]', b'{"prompt": "a & b = c"}'):
        refused = httpx.post(f"{server.http}/v1/videos", content=body, headers=form)
        assert check(spec, "post", "/v1/videos", refused)["error"] == {"code": "invalid_request", "message": expected}
    if shutil.which("curl") is not None:  # what curl itself sends
        command = ["curl", "-sS", f"{server.http}/v1/videos", "-H", f"Authorization: Bearer {KEY}"]
        ran = subprocess.run([*command, "-d", '{"prompt": "p", "num_chunks": 2}'], capture_output=True, text=True)
        assert json.loads(ran.stdout)["error"]["message"] == expected, ran
    fields = httpx.post(f"{server.http}/v1/videos", data={"prompt": "p", "num_chunks": "1"}, headers=AUTH)
    assert fields.status_code == 202, fields.text  # a real form is still a body


def test_openai_routes_not_implemented_answer_as_documented(served):
    server, spec = served
    for method, route, path in [
        ("post", "/v1/videos/{video_id}/remix", "/v1/videos/video_x/remix"),
        ("post", "/v1/videos/edits", "/v1/videos/edits"),
        ("post", "/v1/videos/extensions", "/v1/videos/extensions"),
        ("post", "/v1/videos/characters", "/v1/videos/characters"),
        ("get", "/v1/videos/characters/{character_id}", "/v1/videos/characters/char_x"),
    ]:
        answer = httpx.request(method, server.http + path, json={"prompt": "p"}, headers=AUTH)
        error = check(spec, method, route, answer)["error"]
        assert answer.status_code == 501 and answer.headers["x-should-retry"] == "false"
        assert error["code"] == "not_implemented" and "is not implemented by this server" in error["message"]
        assert check(spec, method, route, httpx.request(method, server.http + path))["error"]["code"] == "unauthorized"


def _bounds(spec: dict, schema_name: str, field: str) -> dict:
    """The numeric branch of ``field`` in component ``schema_name``."""
    prop = spec["components"]["schemas"][schema_name]["properties"][field]
    return next(branch for branch in prop.get("anyOf", [prop]) if branch.get("type") in ("integer", "number"))


def test_the_schema_carries_the_served_models_own_bounds(served, tiny_server):
    """The stub takes even sizes up to its max and its own steps; the tiny causal
    Wan, multiples of 16 up to 1280 (the server's max_width here: 640) and 1-4
    steps. A request past them is refused as the schema says it would be."""
    server, spec = served
    names = [
        name for name, s in spec["components"]["schemas"].items() if "num_inference_steps" in s.get("properties", {})
    ]
    assert names
    width = _bounds(spec, names[0], "width")
    assert width["multipleOf"] == 2 and width["minimum"] == 2
    tiny = tiny_server  # --max-width 640
    tiny_spec = httpx.get(f"{tiny.http}/openapi.json").json()
    for name in names:
        width = _bounds(tiny_spec, name, "width")
        assert (width["multipleOf"], width["minimum"], width["maximum"]) == (16, 16, 640)
        assert _bounds(tiny_spec, name, "height")["maximum"] == 1280
        steps = _bounds(tiny_spec, name, "num_inference_steps")
        assert (steps["minimum"], steps["maximum"]) == (1, 4)
    for body, field in (({"width": 40}, "width"), ({"num_inference_steps": 5}, "num_inference_steps")):
        answer = httpx.post(f"{tiny.http}/v1/videos", json={"prompt": "p", "num_chunks": 1, **body}, timeout=30)
        assert answer.status_code == 422 and field in answer.json()["error"]["message"]
