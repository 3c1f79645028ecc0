"""The project installs one top-level package, ``rtvideo``: an environment that
holds it gains no generic name (``server``, ``engine``, ``cli``...) that another
distribution could own, and ``python -m rtvideo`` is the command."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = ("server", "engine", "workers", "cli", "bench", "training")


def installed_packages() -> list[str]:
    """The packages pyproject.toml's discovery rule picks, found as setuptools finds them at install."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return find_namespace_packages(where=str(ROOT), include=find["include"], exclude=find.get("exclude", ()))


def test_every_installed_package_is_under_rtvideo():
    packages = installed_packages()
    assert [p for p in packages if p != "rtvideo" and not p.startswith("rtvideo.")] == []
    assert {f"rtvideo.{name}" for name in PROCESSES} <= set(packages)


def test_no_other_package_sits_at_the_root():
    """A folder of Python modules next to ``rtvideo/`` would be a second top-level
    name the moment the discovery rule picked it up."""
    beside = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py")) and p.name != "rtvideo")
    assert beside == ["tests"]


def test_python_dash_m_rtvideo_is_the_command():
    result = subprocess.run(
        [sys.executable, "-m", "rtvideo", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: rtvideo") and "serve" in result.stdout
