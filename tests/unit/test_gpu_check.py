"""``scripts/gpu-check``'s own logic, on any machine: its steps in order, each
one's JSON line gathered into ``summary.json``, a failed step named and the
rest run, the budget skipping what it cannot fit, and ``GPU_CHECK_ONLY``
running just the steps named. The measurements are stood in for by an
interpreter that prints a summary line (or fails, for the FP8 variant) and
an ``nvidia-smi`` that prints a line: what is tested is the script, which a
GPU machine runs once per lease and cannot debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
STEPS = [
    "gpu",
    "versions",
    "wan-bf16",
    "wan-versus-combined",
    "wan-fastest-sessions",
    "tests",
    *(
        f"wan-versus-{variant}"
        for variant in (
            "tiny-decoder",
            "fp8",
            "cuda-graphs",
            "commit-from-last-step",
            "cudnn-attention",
            "flash-attention",
            "fused-elementwise",
            "short-window",
            "vae-float32",
            "cudnn-benchmark",
            "compile",
        )
    ),
    "tiny-gpu",
    "tests-matrix",
]
GPU_TIER_FIRST = ["test_wan_on_gpu.py", "test_device_info_on_gpu.py", "test_attention_backend_on_gpu.py"]
GPU_TIER_LAST = ["test_fused_elementwise_on_gpu.py", "test_config_matrix_on_gpu.py"]
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:2] == ["-"]:  # the script's own summary code
    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
args = " ".join(sys.argv[1:])
if "--versus fp8 " in args:
    print("quantize fp8: refused here")
    sys.exit(3)
print("a log line")
print(json.dumps({{"args": args, "argv": sys.argv[1:]}}))
"""


@pytest.fixture
def machine(tmp_path):
    """A folder to run in, with the stand-in interpreter and ``nvidia-smi`` on the path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771 MiB, 580.159.03, 1980 MHz'\n")
    for tool in (python, smi):
        tool.chmod(0o755)
    return tmp_path


def run_check(machine: Path, out: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "PATH": f"{machine / 'bin'}:{os.environ['PATH']}",
        "PYTHON": str(machine / "bin" / "python"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), out], cwd=machine, env=environment, capture_output=True, text=True, timeout=60
    )


def rerun(steps: list[str]) -> str:
    """The check's last line when ``steps`` failed or were skipped."""
    return f'== to run them alone: GPU_CHECK_ONLY="{" ".join(steps)}" scripts/gpu-check OUTDIR'


def test_every_step_runs_in_order_and_a_failed_one_is_named_with_the_command_to_rerun_it(machine):
    gpu_tier = machine / "tests" / "gpu"
    gpu_tier.mkdir(parents=True)
    for name in GPU_TIER_FIRST + ["test_new_on_gpu.py"] + GPU_TIER_LAST:
        (gpu_tier / name).touch()
    result = run_check(machine, "out")
    started = [line.split(":")[0][3:] for line in result.stdout.splitlines() if line.startswith("== ") and ": " in line]
    assert list(dict.fromkeys(started))[: len(STEPS)] == STEPS
    assert result.returncode == 1, result.stdout + result.stderr  # the exit status counts the failed steps
    summary = json.loads((machine / "out" / "summary.json").read_text())
    assert summary["failed"] == ["wan-versus-fp8"] and summary["skipped_for_time"] == []
    assert summary["wan-versus-fp8"] is None
    assert summary["wan-bf16"]["args"].startswith(
        "-m rtvideo.bench.pipeline --preset wan2.1-1.3b --width 832 --height 480"
    )
    assert "--sessions 2,3 --with tiny-decoder,cuda-graphs,fp8" in summary["wan-fastest-sessions"]["args"]
    # the tier's files in the order of what they tell, a file the script does not know before the last ones
    files = [f"tests/gpu/{name}" for name in GPU_TIER_FIRST + ["test_new_on_gpu.py", GPU_TIER_LAST[0]]]
    assert f"--durations=10 {' '.join(files)} -k not test_wan_1_3b_pipeline" in summary["tests"]["args"]
    assert summary["tests-matrix"]["args"].endswith("--durations=10 tests/gpu/test_config_matrix_on_gpu.py")
    assert set(summary) == {"failed", "skipped_for_time", *STEPS}
    assert (
        result.stdout.splitlines()[-1]
        == '== to run them alone: GPU_CHECK_ONLY="wan-versus-fp8" scripts/gpu-check OUTDIR'
    )


def test_the_budget_skips_what_it_cannot_fit_and_the_summary_is_still_written(machine):
    result = run_check(machine, "out", GPU_CHECK_BUDGET_S="29")  # under the 30 s a step needs
    summary = json.loads((machine / "out" / "summary.json").read_text())
    assert summary["skipped_for_time"] == STEPS and summary["failed"] == []
    assert result.returncode == 0
    assert (
        result.stdout.splitlines()[-1]
        == f'== to run them alone: GPU_CHECK_ONLY="{" ".join(STEPS)}" scripts/gpu-check OUTDIR'
    )


def test_only_the_steps_named_run_and_a_rerun_into_the_same_folder_keeps_only_its_own_figures(machine):
    run_check(machine, "out")
    result = run_check(machine, "out", GPU_CHECK_ONLY="wan-bf16 tiny-gpu")
    summary = json.loads((machine / "out" / "summary.json").read_text())
    assert set(summary) == {"failed", "skipped_for_time", "wan-bf16", "tiny-gpu"}
    assert result.returncode == 0 and "to run them alone" not in result.stdout


def test_every_bench_the_check_runs_is_one_the_bench_takes(machine):
    """Each step's bench command, as the script writes it (the tiny decoder's file
    named too), parses with ``rtvideo bench pipeline``'s own options: a renamed
    option or variant fails here, not in a GPU lease."""
    from rtvideo.bench.pipeline import build_parser

    run_check(machine, "out", TINY_DECODER="/weights/taew2_1.safetensors")
    summary = json.loads((machine / "out" / "summary.json").read_text())
    benches = {
        step: figures["argv"][2:]
        for step, figures in summary.items()
        if isinstance(figures, dict) and figures["argv"][:2] == ["-m", "rtvideo.bench.pipeline"]
    }
    assert {"wan-bf16", "wan-versus-combined", "wan-fastest-sessions", "tiny-gpu"} <= set(benches)
    assert len(benches) == 4 + 11 - 1  # wan-versus-fp8 failed (the stand-in refuses it): no figures
    parser = build_parser()
    for step, argv in benches.items():
        args = parser.parse_args(argv)
        if step.startswith("wan-"):
            assert (args.preset, args.width, args.height) == ("wan2.1-1.3b", 832, 480), step
        if step.startswith(("wan-versus-", "wan-fastest-")):  # the default's bf16 run keeps the full decoder
            assert args.tiny_decoder == "/weights/taew2_1.safetensors", step
        if step.startswith("wan-versus-"):
            assert args.versus == step.removeprefix("wan-versus-") and args.rounds == 2, step
    assert benches["wan-fastest-sessions"][-4:-2] == ["--with", "tiny-decoder,cuda-graphs,fp8"]
    assert parser.parse_args(benches["wan-fastest-sessions"]).sessions == (2, 3)
