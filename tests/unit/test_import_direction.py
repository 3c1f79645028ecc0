"""The house's import direction, by process: server -> engine <- workers; the tools on top.

- ``rtvideo/server/`` (the API process) and ``rtvideo/engine/client/`` (the engine's API side)
  import no torch and nothing of ``workers``, ``bench``, ``training`` or ``cli``;
- the engine core (``rtvideo/engine/`` outside ``rtvideo/engine/client/``, in worker rank 0)
  imports neither ``rtvideo.engine.client`` nor ``server``, nor torch;
- ``rtvideo/workers/`` imports nothing of ``server`` or the tools;
- ``rtvideo/bench/``, ``rtvideo/training/`` and ``rtvideo/cli/`` are tools: they may import the rest,
  ``cli`` everything, and nothing imports ``cli``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rtvideo"
TORCH = ("torch", "diffusers", "transformers")


def own(*names: str) -> tuple[str, ...]:
    """The package's modules ``names`` (``"engine.client"``), by their import names."""
    return tuple(f"rtvideo.{name}" for name in names)


TOOLS = own("bench", "training", "cli")
FORBIDDEN = {
    "server": (*own("workers"), *TOOLS, *TORCH),
    "engine/client": (*own("server", "workers"), *TOOLS, *TORCH),
    "engine": (*own("engine.client", "server", "workers"), *TOOLS, *TORCH),
    "workers": (*own("server", "engine.client"), *TOOLS),
    "bench": own("cli", "training"),
    "training": own("server", "engine.client", "bench", "cli"),
}
"""Each folder's ``.py`` files (``engine``: those outside ``rtvideo/engine/client/``) and
the modules they may not import: a name and everything under it."""


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (a function's lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def sources(folder: str) -> list[Path]:
    paths = sorted((PACKAGE / folder).rglob("*.py"))
    if folder == "engine":
        paths = [p for p in paths if (PACKAGE / "engine" / "client") not in p.parents]
    assert paths, f"no Python files under rtvideo/{folder}/"
    return paths


def against(names: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_against_the_direction(folder):
    offenders = {str(p.relative_to(ROOT)): against(imported(p), FORBIDDEN[folder]) for p in sources(folder)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_nothing_imports_the_command_line():
    folders = ("server", "engine", "workers", "bench", "training")
    offenders = {
        str(p.relative_to(ROOT)): against(imported(p), own("cli")) for folder in folders for p in sources(folder)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_an_import_against_the_direction(tmp_path):
    """The scan finds a lazy import of the engine's API side inside a function (it can fail)."""
    module = tmp_path / "core.py"
    module.write_text("def f():\n    from rtvideo.engine.client.heartbeat import Heartbeat\n    import torch.nn\n")
    found = against(imported(module), FORBIDDEN["engine"])
    assert found == ["rtvideo.engine.client.heartbeat", "rtvideo.engine.client.heartbeat.Heartbeat", "torch.nn"]


NOT_ON_THE_API_SIDE = (*TORCH, *own("workers", "bench", "training"))
API_SIDE_LOADS = f"""
import sys
import rtvideo.cli.main, rtvideo.engine.client.engine_client, rtvideo.server.app
try:
    rtvideo.cli.main.main(["serve", "--model", "/nonexistent/model"])  # every import of serve, then the model check
except SystemExit as stop:
    assert "no such directory" in str(stop), stop
else:
    raise AssertionError("rtvideo serve started without a model")
assert "rtvideo.server.app" in sys.modules and "uvicorn" in sys.modules, sorted(sys.modules)
bad = sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in {NOT_ON_THE_API_SIDE!r}))
print("loaded:", bad)
sys.exit(1 if bad else 0)
"""


def test_the_api_side_and_rtvideo_serve_load_no_torch():
    """In a fresh interpreter: the server's app, the engine client and what
    ``rtvideo serve`` imports before it starts (run up to its model check)
    load no torch and nothing of ``workers``, ``bench`` or ``training``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RTVIDEO_")}
    result = subprocess.run(
        [sys.executable, "-c", API_SIDE_LOADS], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
