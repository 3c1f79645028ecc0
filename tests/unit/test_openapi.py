"""The OpenAPI description (/openapi.json, rendered at /docs) tells the truth:
errors in the shape the server answers, media types of the video routes, and
a description for every request field."""

from __future__ import annotations

import json

import pytest

from rtvideo.server.app import create_app
from rtvideo.server.settings import ServerSettings


@pytest.fixture(scope="module")
def spec() -> dict:
    return create_app(ServerSettings(model="stub")).openapi()  # the engine starts with the app's lifespan only


def test_errors_are_documented_in_the_shape_the_server_answers(spec):
    assert "HTTPValidationError" not in json.dumps(spec)  # FastAPI's {"detail": [...]}, which the server never sends
    error = spec["components"]["schemas"]["ErrorBody"]
    assert error["properties"]["error"]["$ref"].endswith("/ErrorDetail")
    for path, operations in spec["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            codes = {int(code) for code in operation["responses"] if int(code) >= 400}
            assert 401 in codes, (method, path)
            for code in codes:
                schema = operation["responses"][str(code)]["content"]["application/json"]["schema"]
                assert schema["$ref"].endswith("/ErrorBody"), (method, path, code)
    create = spec["paths"]["/v1/videos"]["post"]["responses"]
    assert {"202", "413", "422", "429", "503"} <= set(create)


def test_video_routes_say_what_they_serve(spec):
    for path, method in (("/v1/videos/{video_id}/content", "get"), ("/v1/videos/sync", "post")):
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        assert set(content) == {"video/mp4", "application/octet-stream"}


def test_every_request_field_is_described(spec):
    for name in ("JobRequest", "ScheduledPrompt"):
        properties = spec["components"]["schemas"][name]["properties"]
        assert [field for field, schema in properties.items() if not schema.get("description")] == [], name
    width = spec["components"]["schemas"]["JobRequest"]["properties"]["width"]["description"]
    assert "multiple of 16" in width


def test_every_json_answer_of_the_api_is_a_typed_model(spec):
    """No untyped ``{}`` bodies: each 2xx JSON answer of a /v1/ route names a model
    whose fields are all listed and closed (tests/e2e/test_api_answers.py checks
    the server's real answers against these)."""
    schemas = spec["components"]["schemas"]
    typed = {}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                json_body = response.get("content", {}).get("application/json")
                if not path.startswith("/v1/") or not code.startswith("2") or json_body is None:
                    continue
                ref = json_body["schema"].get("$ref", "")
                assert ref.startswith("#/components/schemas/"), (method, path, code, json_body)
                typed[(method, path)] = ref.rsplit("/", 1)[1]
    assert typed == {
        ("get", "/v1/models"): "ModelList",
        ("post", "/v1/videos"): "VideoObject",
        ("get", "/v1/videos"): "VideoList",
        ("get", "/v1/videos/{video_id}"): "VideoObject",
        ("delete", "/v1/videos/{video_id}"): "DeletedVideo",
    }
    video = schemas["VideoObject"]
    assert video["additionalProperties"] is False and set(video["required"]) == set(video["properties"])
    outcomes = video["properties"]["interactions"]["items"]["discriminator"]["mapping"]
    assert set(outcomes) == {"pending", "applied", "superseded", "rejected"}
    applied = schemas["AppliedPrompt"]["properties"]
    assert {"generation_chunk_index", "first_frame_index", "media_start_seconds"} <= set(applied)
    for name in ("VideoObject", "AppliedPrompt", "ModelCard"):
        properties = schemas[name]["properties"]
        undescribed = [f for f, s in properties.items() if not s.get("description") and f not in GENERIC_FIELDS]
        assert undescribed == [], name


# Fields whose name says it all (and is explained once, in the request's schema).
GENERIC_FIELDS = {"object", "width", "height", "fps", "seed"}
