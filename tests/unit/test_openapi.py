"""The OpenAPI description (/openapi.json, rendered at /docs) tells the truth:
errors in the shape the server answers, media types of the video routes, and
a description for every request field."""

from __future__ import annotations

import json

import pytest

from server.app import create_app
from server.settings import ServerSettings


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
