"""docs/PROTOCOL.md names everything a client can meet, as the code defines it.

Every name is read from the code, not from a list kept here: the client event
schemas (``rtvideo.server.schemas``), the server event models (``rtvideo.server.events``) and
any event built as a plain dict, every error code passed to an error helper or
an engine refusal in ``rtvideo/server/`` and ``rtvideo/engine/``, the close codes of the
realtime endpoint, and the app's routes. A name counts as documented when it
appears inside a code span (backticks) of the page, or, for close codes, as a
number anywhere in it. Adding any of these without documenting it fails here.
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "PROTOCOL.md"
SCANNED = ("server", "engine")  # packages whose error codes can reach a client


# -- the page ---------------------------------------------------------------------


def code_spans(text: str) -> list[str]:
    """The contents of every inline code span and fenced block of a Markdown page."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return fenced + inline


def undocumented(names: set[str], text: str) -> list[str]:
    """The names that appear in no code span of ``text`` as a whole word: not
    inside a longer word, and not followed by a dot (``session.done.replay``
    is not ``session.done``); a path prefix is fine (``interaction.event``)."""
    spans = code_spans(text)
    missing = []
    for name in sorted(names):
        word = re.compile(r"(?<!\w)" + re.escape(name) + r"(?![\w.])")
        if not any(word.search(span) for span in spans):
            missing.append(name)
    return missing


# -- pydantic models ----------------------------------------------------------------


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models inside a type annotation (through unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def model_fields(models: list[type[BaseModel]]) -> set[str]:
    """Every field name of ``models`` and of the models nested in their fields."""
    names: set[str] = set()
    seen: set[type[BaseModel]] = set()
    todo = list(models)
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(name)
            todo += _models_in(info.annotation)
    return names


def literal_values(model: type[BaseModel], field: str) -> set[str]:
    annotation = model.model_fields[field].annotation
    assert typing.get_origin(annotation) is typing.Literal, f"{model.__name__}.{field} is not a Literal"
    return set(typing.get_args(annotation))


def client_event_models() -> list[type[BaseModel]]:
    from rtvideo.server.schemas import ClientEvent

    return _models_in(ClientEvent)


def server_event_models() -> list[type[BaseModel]]:
    import rtvideo.server.events

    return [
        value
        for value in vars(rtvideo.server.events).values()
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == rtvideo.server.events.__name__
        and "type" in value.model_fields
    ]


# -- source scanning ----------------------------------------------------------------


def _strings(node: ast.AST | None) -> set[str]:
    """String constants an expression can evaluate to (constants and conditional branches)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _strings(node.body) | _strings(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_strings(value) for value in node.values))
    return set()


def _signatures(tree: ast.Module) -> dict[str, list[list[str]]]:
    """Callable name -> positional parameters (``self``/``cls`` dropped) of every
    function, method or class ``__init__`` that takes a parameter named ``code``."""
    found: dict[str, list[list[str]]] = {}
    for node in ast.walk(tree):
        targets: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            targets.append((node.name, node))
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    targets.append((node.name, item))
        for name, function in targets:
            params = [a.arg for a in function.args.posonlyargs + function.args.args]
            if params and params[0] in ("self", "cls"):
                params = params[1:]
            if "code" in params or "code" in [a.arg for a in function.args.kwonlyargs]:
                found.setdefault(name, []).append(params)
    return found


def error_codes_in(sources: dict[str, str]) -> set[str]:
    """Every error code string in ``sources`` (name -> Python text): an argument in
    the ``code`` position of a call to a function or class defined there (the
    calling module's own definition first), a
    ``code=`` keyword, the value of a ``"code"`` key in a dict literal, or a
    value assigned to a variable named ``code``."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    local = {name: _signatures(tree) for name, tree in trees.items()}
    imported: dict[str, list[list[str]]] = {}
    for signatures in local.values():
        for name, params in signatures.items():
            imported.setdefault(name, []).extend(params)
    codes: set[str] = set()
    for module, tree in trees.items():
        defined_here = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                # A name defined in this module means that definition (``_reject`` differs
                # between modules); otherwise any definition in the scanned sources.
                candidates = local[module].get(callee, []) if callee in defined_here else imported.get(callee, [])
                for params in candidates:
                    if "code" in params and params.index("code") < len(node.args):
                        codes |= _strings(node.args[params.index("code")])
                for keyword in node.keywords:
                    if keyword.arg == "code":
                        codes |= _strings(keyword.value)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "code":
                        codes |= _strings(value)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "code" for t in targets):
                    codes |= _strings(node.value)
    return codes


def dict_event_types_in(sources: dict[str, str]) -> set[str]:
    """``type`` values of events built as dict literals (``{"type": "..."}``)."""
    found: set[str] = set()
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "type":
                        found |= _strings(value)
    return {kind for kind in found if not kind.startswith(ASGI_PREFIXES)}


ASGI_PREFIXES = ("http.", "websocket.", "lifespan.")  # the server's own ASGI messages, not protocol events


def close_codes_in(sources: dict[str, str]) -> set[int]:
    """Integers bound to names ``CLOSE_*`` (``A, B = 1000, 1008`` included)."""
    found: set[int] = set()
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                names, values = [target], [node.value]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    names, values = target.elts, node.value.elts
                for name, value in zip(names, values, strict=False):
                    if (
                        isinstance(name, ast.Name)
                        and name.id.startswith("CLOSE_")
                        and isinstance(value, ast.Constant)
                        and isinstance(value.value, int)
                    ):
                        found.add(value.value)
    return found


def package_sources(*packages: str) -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for package in packages
        for path in (ROOT / "rtvideo" / package).rglob("*.py")
    }


# -- the checks ---------------------------------------------------------------------

DOC_TEXT = DOC.read_text()


def test_every_client_event_type_is_documented():
    from rtvideo.server.schemas import CLIENT_EVENT_TYPES

    types_ = set(CLIENT_EVENT_TYPES)
    for model in client_event_models():
        types_ |= literal_values(model, "type")
    assert "session.start" in types_
    assert undocumented(types_, DOC_TEXT) == []


def test_every_client_field_is_documented():
    from rtvideo.server.schemas import JobRequest

    fields = model_fields(client_event_models() + [JobRequest])
    assert {"prompt", "position_seconds", "event_id", "at_chunk"} <= fields
    assert undocumented(fields, DOC_TEXT) == []


def test_every_server_event_type_is_documented():
    models = server_event_models()
    types_ = set().union(*(literal_values(model, "type") for model in models))
    types_ |= dict_event_types_in(package_sources("server"))
    assert {"video.start", "video.chunk_metadata", "error"} <= types_
    assert undocumented(types_, DOC_TEXT) == []


def test_every_server_event_field_is_documented():
    fields = model_fields(server_event_models())
    assert {"expected_chunk_index", "duplicate", "compute_ms", "replay"} <= fields
    assert undocumented(fields, DOC_TEXT) == []


def test_every_field_of_the_effective_config_is_documented():
    from dataclasses import fields

    from rtvideo.server.schemas import EffectiveConfig

    names = {f.name for f in fields(EffectiveConfig)}
    assert {"first_chunk_frames", "frames_per_chunk", "max_lead_seconds"} <= names
    assert undocumented(names, DOC_TEXT) == []


def test_every_error_code_is_documented():
    codes = error_codes_in(package_sources(*SCANNED))
    # The scan must see codes of every kind of source, or it proves nothing.
    assert {"unknown_type", "server_full", "worker_died", "pipeline_error", "not_found"} <= codes
    assert undocumented(codes, DOC_TEXT) == []


def test_every_close_code_is_documented():
    closes = close_codes_in(package_sources("server"))
    assert {1000, 1008, 1011, 1013} <= closes
    missing = [code for code in sorted(closes) if not re.search(rf"(?<!\d){code}(?!\d)", DOC_TEXT)]
    assert missing == []


def test_every_route_is_documented():
    from fastapi.routing import APIRoute, APIWebSocketRoute

    from rtvideo.server.app import create_app
    from rtvideo.server.settings import ServerSettings

    app = create_app(ServerSettings())  # routes only: the engine starts with the lifespan, not here
    names = set()
    for route in app.routes:
        if isinstance(route, APIWebSocketRoute):
            names.add(f"WS {route.path}")
        elif isinstance(route, APIRoute):
            names |= {f"{method} {route.path}" for method in route.methods}
    assert "POST /v1/videos" in names
    missing = [name for name in sorted(names) if f"`{name}`" not in DOC_TEXT]
    assert missing == []


# -- the scanner finds what it should -------------------------------------------------


def test_the_code_scan_finds_a_code_given_in_any_of_its_forms():
    source = """
def refuse(status, code, message): ...
class Refusal(Exception):
    def __init__(self, code, message): ...
class Handler:
    def _deny(self, sid, code, message): ...
    def run(self):
        refuse(400, "by_position", "m")
        self._deny("s", "by_method" if x else "by_branch", "m")
        raise Refusal("by_class", "m")
        send(Failed(code="by_keyword"))
        body = {"error": {"code": "by_dict", "message": "m"}}
        code = "by_assignment"
        refuse(400, variable, "not a constant")
"""
    found = error_codes_in({"example.py": source})
    assert found == {
        "by_position",
        "by_method",
        "by_branch",
        "by_class",
        "by_keyword",
        "by_dict",
        "by_assignment",
    }


def test_a_name_counts_only_inside_a_code_span_and_as_a_whole_word():
    text = 'The new_code appears in prose. `error{code: "documented"}`, `session.done.replay`, `a.event`.'
    names = {"new_code", "documented", "session.done", "session.done.replay", "event", "even"}
    assert undocumented(names, text) == ["even", "new_code", "session.done"]


def test_models_nested_in_fields_are_walked():
    class Inner(BaseModel):
        deep: int

    class Outer(BaseModel):
        type: typing.Literal["x"]
        items: list[Inner] | None = None

    assert model_fields([Outer]) == {"type", "items", "deep"}


NOT_LIMITS = {
    "host",
    "port",
    "model",
    "pipeline_options",
    "decoder",
    "quantize",
    "group_chunk_steps",
    "overlap_decode",
    "decode_nice",
    "cpu_threads",
    "api_key",
    "pp",
    "slo_first_chunk_s",
    "stream_batch",
    "worker_listen",
    "log_level",
    "prompt_policy",
}


def test_every_server_limit_is_in_the_limits_table():
    """docs/SERVER.md lists every limit option with its default and what a client gets past it."""
    from dataclasses import fields

    from rtvideo.server.settings import ServerSettings

    server_doc = (ROOT / "docs" / "SERVER.md").read_text()
    table = server_doc[server_doc.index("## Limits") :].split("\n## ")[0]
    limits = {f.name for f in fields(ServerSettings)} - NOT_LIMITS
    assert {"max_sessions", "max_request_bytes", "job_ttl_s"} <= limits
    assert [name for name in sorted(limits) if f"`{name}`" not in table] == []
