"""What a CUDA graph cannot capture (``capture_rules``), and a capture that fails.

The rules see every operator a function runs: the operators no graph can hold
(a value read back to the host, a data-dependent size, random numbers) are
named, plain arithmetic and in-place copies pass. ``StepGraphs`` rehearses each
capture under them (``EagerReplay`` on this CPU, ``CudaGraphCapture``'s warm-up
run on a GPU). A capture that fails, for that reason or any other, runs the step
eagerly, says why once and keeps every later step eager. The causal Wan
pipeline's own captured forwards pass the rules (``tests/model/test_captured_step_graphs.py``
streams them through ``EagerReplay``); a pipeline whose capture fails makes the
eager pipeline's frames bit for bit.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rtvideo.engine.messages import StartSession
from rtvideo.workers.chunk_driver import ChunkDriver
from rtvideo.workers.pipelines.capture_rules import CaptureBreak, CaptureRules, rehearse
from rtvideo.workers.pipelines.causal_wan import build
from rtvideo.workers.pipelines.step_graphs import EagerReplay, StepGraphs, StepKey

X = torch.arange(12, dtype=torch.float32).reshape(3, 4)


@pytest.mark.parametrize(
    ("step", "named"),
    [
        (lambda: X.sum().item(), "_local_scalar_dense"),
        (lambda: X * 2 if X.max() > 3 else X, "is_nonzero|_local_scalar_dense"),  # an `if` on a tensor
        (lambda: X.nonzero(), "nonzero"),
        (lambda: X[X > 3], "boolean mask"),
        (lambda: X.clone().index_put_((X > 3,), torch.tensor(0.0)), "boolean mask"),  # x[mask] = v
        (lambda: X.repeat_interleave(torch.tensor([1, 2, 1]), dim=0), "repeats by a tensor"),
        (lambda: torch.unique(X), "unique"),
        (lambda: X + torch.randn_like(X), "random"),
        (lambda: torch.equal(X, X), "equal"),
    ],
)
def test_the_rules_name_what_no_graph_can_hold(step, named):
    with pytest.raises(CaptureBreak, match=named):
        rehearse(step)


def test_the_rules_let_a_forwards_own_work_through():
    out = torch.empty(3, 4)

    def step():
        y = torch.nn.functional.layer_norm(X @ X.T @ X, (4,)) * torch.tensor(0.5)  # a 0-d host scalar: legal
        out.copy_(torch.where(y > 0, y, -y))  # a mask used as a mask, not as an index: static size
        return out[:, 1:].contiguous()

    assert torch.equal(rehearse(step), step())


def _on_meta(make):
    with torch.device("meta"):
        return make()


@pytest.mark.parametrize(
    "step",
    [
        lambda: torch.ones(2, device="meta") + torch.tensor([1.0, 2.0]).to("meta"),
        lambda: torch.empty((), device="meta").copy_(torch.tensor(3.0)),  # 0-d: CUDA refuses it too
        lambda: torch.ones(2, device="meta") * torch.tensor(0.5, device="meta"),  # made below the dispatcher
        lambda: torch.as_tensor([0.0, 1.0], device="meta"),
        lambda: torch.ones(2, device="meta").new_tensor([1.0, 2.0]),  # on its tensor's device
        lambda: _on_meta(lambda: torch.tensor([1.0, 2.0])),  # on the device a context sets
    ],
)
def test_a_copy_from_the_host_to_a_device_is_named(step):
    """The meta device stands in for a GPU: not the host, so a copy to it from
    host memory is one a capture cannot hold, however it is written."""
    with pytest.raises(CaptureBreak, match="host"):
        rehearse(step)


def test_host_scalars_and_data_already_on_the_device_pass():
    on_device = torch.ones(2, device="meta")

    def step():
        return torch.as_tensor(on_device, device="meta") * torch.tensor(0.5)  # no copy: a kernel's scalar

    assert rehearse(step).shape == (2,)


def _key(kind: str = "denoise") -> StepKey:
    return StepKey((1,), (1,), (3,), (1, 4), (1, 2), "torch.float32", kind)


def test_a_step_that_breaks_the_rules_runs_eagerly_and_says_why_once(caplog):
    graphs = StepGraphs(EagerReplay(), after_uses=2)
    ran = []

    def forward(inputs):
        ran.append(float(inputs["x"].sum()))  # a read back: no graph can hold it
        return inputs["x"] * 2

    x = torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="rtvideo.workers.pipelines.step_graphs"):
        results = [graphs.run(_key(), {"x": x * n}, forward) for n in range(1, 5)]
    assert [r.tolist() for r in results] == [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0], [8.0, 8.0]]
    assert ran == [2.0, 4.0, 6.0, 8.0]  # each step ran once, eagerly (the rehearsal stopped at the read)
    figures = graphs.figures()
    assert figures["capture_failures"] == 1 and figures["captures"] == 0 and figures["held"] == 0
    assert figures["fallbacks"] == 4 and figures["replays"] == 0
    assert "CaptureBreak" in graphs.failure and "_local_scalar_dense" in graphs.failure
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("cuda_graphs: capturing a denoise step of 1 row(s) failed: CaptureBreak")
    assert "every step of this worker runs eagerly from now on" in line


class _CaptureFails:
    """A capture that raises as a GPU's does when its stream cannot be captured."""

    def __init__(self) -> None:
        self.tries = 0

    def capture(self, function):
        self.tries += 1
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


def test_after_a_failed_capture_the_graphs_held_are_dropped_and_nothing_is_captured_again():
    graphs = StepGraphs(EagerReplay(), after_uses=1)
    x = torch.ones(2)
    graphs.run(_key("denoise"), {"x": x}, lambda inputs: inputs["x"] + 1)
    assert graphs.figures()["held"] == 1
    failing = graphs.capture = _CaptureFails()
    assert graphs.run(_key("commit"), {"x": x}, lambda inputs: inputs["x"] + 2).tolist() == [3.0, 3.0]
    assert graphs.run(_key("denoise"), {"x": x}, lambda inputs: inputs["x"] + 1).tolist() == [2.0, 2.0]
    assert graphs.run(_key("other"), {"x": x}, lambda inputs: inputs["x"] + 3).tolist() == [4.0, 4.0]
    assert failing.tries == 1 and graphs.figures()["held"] == 0 and graphs.figures()["capture_failures"] == 1
    assert "RuntimeError: CUDA error: operation not permitted" in graphs.failure


def test_a_pipeline_whose_capture_fails_makes_the_eager_frames_and_reports_it():
    span = {"sink_frames": 3, "window_frames": 3}
    eager = build("tiny", device="cpu", warm_up_chunks=0, **span)
    failing = build("tiny", device="cpu", warm_up_chunks=0, cuda_graphs="eager", **span)
    failing.step_graphs.capture = _CaptureFails()
    start = StartSession(session_id="s", prompt="a red fox", seed=4, width=32, height=32)
    frames = {}
    for name, pipeline in (("eager", eager), ("failing", failing)):
        driver = ChunkDriver(pipeline, max_rows=1)
        driver.open(start)
        frames[name] = [c.payload for c in driver.run(["s"], 5)["s"]]
        driver.release("s")
    assert frames["failing"] == frames["eager"]
    figures = failing.graph_figures()
    assert figures["capture_failures"] == 1 and figures["captures"] == 0 and figures["replays"] == 0
    assert figures["fallbacks"] > 4  # every full-window step since ran eagerly


def test_a_rehearsal_runs_compiled_code_as_its_source_and_leaves_it_compiled():
    """``torch.compile`` cannot run under a dispatch mode, and a try marks the
    function skipped, so that its next call (``fullgraph``) fails: the rehearsal
    runs it as its Python source, and it still compiles and runs after."""

    def scaled(x):
        return torch.nn.functional.silu(x) * 2 + 1

    compiled = torch.compile(scaled, fullgraph=True, backend="eager")
    assert torch.equal(rehearse(lambda: compiled(X)), scaled(X))
    assert torch.equal(compiled(X), scaled(X))
    with pytest.raises(CaptureBreak, match="_local_scalar_dense"):
        rehearse(lambda: compiled(X).sum().item())


def test_a_steady_eager_chunk_never_makes_the_host_wait_on_the_device():
    """Without captured steps too: a chunk over a full window (boundary, denoise
    steps, commit, decode) reads nothing back and sizes nothing by the data, so
    on a GPU the host runs ahead queueing kernels and the device never idles on
    it. Its noise is drawn on the host (seeded per session) and copied in: allowed."""
    span = {"sink_frames": 3, "window_frames": 3}
    pipeline = build("tiny", device="cpu", warm_up_chunks=0, **span)
    driver = ChunkDriver(pipeline, max_rows=1)
    driver.open(StartSession(session_id="s", prompt="a red fox", seed=2, width=32, height=32))
    driver.run(["s"], 3)  # the window fills
    with torch.compiler.set_stance("force_eager"), CaptureRules(host_waits_only=True):
        chunks = driver.run(["s"], 2)["s"]
    assert len(chunks) == 2
    with pytest.raises(CaptureBreak, match="the host waits on the device"), CaptureRules(host_waits_only=True):
        torch.ones(3).sum().item()
