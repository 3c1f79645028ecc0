"""A long ``rtvideo`` command's progress (``rtvideo.engine.progress``), run as a user runs it:
a bar on stderr when stderr is a terminal (a pseudo-terminal here), its stdout
unchanged, the JSON summary still its last line; nothing of it with ``--json``
or where stderr is not a terminal (a pipe, as in CI and these tests)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import termios
import threading

from tests.support import ROOT, RTVIDEO, last_json, run_rtvideo

EVAL = ("eval-demo", "--ground-truth", "--trials", "4", "--long-streams", "1", "--long-chunks", "8")
CHUNKS = 4 * 6 + 1 * 8  # every chunk judged: the switched streams' six each, the long one's eight


def on_a_terminal(*argv: str) -> tuple[int, str, str]:
    """``rtvideo ARGV`` with stderr on a pseudo-terminal of 24x100: its exit
    status, its stdout and what it drew on the terminal."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    drawn = bytearray()

    def read() -> None:  # until the terminal's last writer has gone (EIO on Linux, or EOF)
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:
                return
            if not data:
                return
            drawn.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with subprocess.Popen(
            [*RTVIDEO, *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=secondary,
        ) as process:
            os.close(secondary)
            secondary = None
            out, _ = process.communicate(timeout=120)
        reader.join(timeout=30)
    finally:
        if secondary is not None:
            os.close(secondary)
        os.close(primary)
    return process.returncode, out.decode(), drawn.decode(errors="replace")


def test_on_a_terminal_a_command_draws_its_progress_and_its_summary_stays_last():
    status, out, drawn = on_a_terminal(*EVAL)
    assert status == 0, drawn
    assert "eval-demo:" in drawn and f"{CHUNKS}/{CHUNKS}" in drawn and "chunk/s" in drawn
    lines = out.splitlines()
    assert last_json(out)["chunks_judged"] == CHUNKS  # the summary, last
    assert any(line.startswith("colour ") for line in lines[:-1])  # the bars' lines as before
    assert "eval-demo:" not in out and "\r" not in out  # nothing of the bar on stdout


def test_with_json_on_a_terminal_nothing_is_drawn():
    status, out, drawn = on_a_terminal(*EVAL, "--json")
    assert status == 0, drawn
    assert drawn == ""
    assert len(out.splitlines()) == 1 and json.loads(out)["chunks_judged"] == CHUNKS


def test_where_stderr_is_not_a_terminal_nothing_is_drawn():
    result = run_rtvideo(*EVAL, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert last_json(result.stdout)["chunks_judged"] == CHUNKS
