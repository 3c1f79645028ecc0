"""The OpenAPI document with the served model's own bounds in it.

API process. The request schemas (``rtvideo/server/schemas.py``) carry what holds
for any model: a width of at least 2, 1-64 denoise steps. The worker says
what the loaded model takes (``WorkerReady.limits``: causal Wan wants sizes
that are multiples of 16, up to 1280, and 1-4 steps), and ``with_limits``
writes that into every schema with those fields, beside the server's own
``max_width`` / ``max_height``, so a client generated from ``/openapi.json``
refuses what the server would refuse. The worker's bound on a frame's area
(``ModelLimits.max_pixels``, measured for real time unless ``max_pixels`` is
set) is a product of two fields, which a schema cannot bound: it is said in
their descriptions.
"""

from __future__ import annotations

from typing import Any

from rtvideo.engine.messages import ModelLimits
from rtvideo.server.settings import ServerSettings


def with_limits(schema: dict[str, Any], limits: ModelLimits | None, settings: ServerSettings) -> dict[str, Any]:
    """``schema`` (modified in place, and returned) with ``limits`` and the
    server's size limits on every ``width``, ``height``, ``num_inference_steps``
    and ``fps`` property of its component schemas."""
    if limits is None:
        return schema
    bounds = {
        "width": {
            "multipleOf": limits.size_multiple,
            "minimum": limits.size_multiple,
            "maximum": min(settings.max_width, limits.max_size),
        },
        "height": {
            "multipleOf": limits.size_multiple,
            "minimum": limits.size_multiple,
            "maximum": min(settings.max_height, limits.max_size),
        },
        "num_inference_steps": {"minimum": 1, "maximum": limits.max_inference_steps},
        "fps": {"exclusiveMinimum": 0, "maximum": limits.max_fps},
    }
    area = _area_note(limits)
    for component in schema.get("components", {}).get("schemas", {}).values():
        for name, property_schema in component.get("properties", {}).items():
            if name in bounds:
                _bound(property_schema, bounds[name])
            if name in ("width", "height") and area:
                property_schema["description"] = f"{property_schema.get('description', '')} {area}".strip()
    return schema


def _area_note(limits: ModelLimits) -> str:
    """The worker's frame-area bound in words (a product of two fields, which a
    JSON schema cannot bound), or "" when there is none."""
    if limits.max_pixels is None:
        return ""
    why = " (what this server measured it runs in real time)" if limits.max_pixels_derived else ""
    return f"Width x height: at most {limits.max_pixels} pixels{why}."


def _bound(property_schema: dict[str, Any], bounds: dict[str, float]) -> None:
    """Set ``bounds`` on the numeric alternative(s) of a property: the property
    itself, or the branches of its ``anyOf`` (an optional field)."""
    branches = property_schema.get("anyOf", [property_schema])
    for branch in branches:
        if branch.get("type") in ("integer", "number"):
            for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf"):
                branch.pop(key, None)
            branch.update(bounds)
