"""Captured denoise steps: a chunk's denoise forward replayed as a CUDA graph.

Worker process. Once a session's KV window is full, every denoise forward of
its chunks has the same shapes, reads the same buffers and differs only in
three inputs (the latent, the timestep, the conditioning). On a GPU the
forward is thousands of small kernel launches from Python; captured once as
a CUDA graph it is one launch. ``StepGraphs`` keeps the captured forwards,
one per ``StepKey``:

- each row's session cache (``SessionKVCache.uid``), in row order: its
  stores' addresses are in the graph (one row: the chunk's values are written
  in place after the held ones);
- each row's roped-key buffers (``RopedKeys.workspace``, by their
  ``serial``): the graph reads the held keys there (one row: and writes the
  chunk's after them);
- the frames each cache holds: the RoPE positions and the attention span;
- the latent's and the conditioning's shapes (the rows) and the dtype;
- its kind: ``denoise`` (the output is the prediction) or ``commit`` (the
  chunks' clean pass, which writes every layer's keys and values into each
  cache's stores and has no output).

A key is captured on its ``after_uses``-th use (its first uses run eagerly:
the shapes of a window still filling are each used for one chunk only, and a
capture costs a forward); the graphs kept are bounded (``most``, least
recently used dropped first), and ``forget`` drops a cache's (one let go
for good: a released session's cache kept for the next session keeps its
graphs, ``causal_wan_graphs.KeptCaches``). Whatever is not captured runs
eagerly (``fallbacks``).

A capture that fails never fails its step: the first failure is logged with
its cause (``failure``), the graphs held are dropped and every later step of
the pipeline runs eagerly (``capture_failures``, exported as a metric). Each
capture is rehearsed first under ``capture_rules.CaptureRules``, so a step
that reads a value back to the host, has a data-dependent size or draws random
numbers is named before the capture begins, on a GPU and on a CPU alike.

Before each replay the caller refreshes what the graph reads but does not
compute (the held keys roped for the cache's current version), copies the
inputs into the graph's static ones (``run``), and takes a copy of the output
(the next replay overwrites it; a caller that uses it at once may take the
graph's own, ``copy=False``). Forwards of one row or of several (sessions
of one size batched) over every block are captured; stream batch and
pipeline ranks run eagerly. The capture itself is ``Capture``'s:
``CudaGraphCapture`` on a GPU; ``EagerReplay`` runs the same function over
the same static buffers (CPU: how the keying and the buffers are tested).

Wired by the pipeline option ``cuda_graphs`` (``step_graphs_for``):
``CausalWanPipeline.forward`` and ``commit`` route through ``run`` the
forwards whose shapes and buffers are static (every row's window full,
every block, nothing staged or provisional: ``causal_wan_graphs``);
everything else stays eager.
``cuda_graphs: "eager"`` selects ``EagerReplay``: the same static-buffer
path with no capture, on any device (tests, debugging).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from rtvideo.workers.pipelines.base import abandon_when
from rtvideo.workers.pipelines.capture_rules import rehearse

log = logging.getLogger(__name__)

Output = torch.Tensor | tuple[torch.Tensor, ...]
Replay = Callable[[], Output]


@dataclass(frozen=True)
class StepKey:
    """What a captured denoise forward is specific to (see the module's docstring)."""

    caches: tuple[int, ...]  # each row's SessionKVCache.uid
    workspaces: tuple[int, ...]  # each row's RopedKeys entry serial: its roped-key buffers' identity
    held_frames: tuple[int, ...]
    latent_shape: tuple[int, ...]
    text_shape: tuple[int, ...]
    dtype: str
    kind: str = "denoise"  # or "commit": the chunk's clean pass, whose output is its keys and values


class Capture(Protocol):
    def capture(self, function: Replay) -> Replay:
        """``function`` (which reads only static tensors) as a replayable step."""
        ...


class CudaGraphCapture:
    """Capture on a CUDA device: a rehearsal under ``CaptureRules`` on a side
    stream (``CaptureBreak`` names an operator no graph can hold before the
    capture begins), one warm-up run there (lazy library state and compiled
    code are made outside the graph), then the capture, into one memory
    pool shared by every graph (they replay one at a time on the loop's thread,
    and each output is copied before the next replay)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, function: Replay) -> Replay:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        # No abandon point fires inside: a capture is not left half made (the
        # caller checked just before; a replay has no block boundaries either).
        try:
            with abandon_when(None), torch.cuda.stream(self.stream):
                rehearse(function)
                function()  # compiled code and lazy library state made on this stream, outside the graph
        finally:  # a rehearsal that broke off left kernels queued there: the eager step after it waits for them
            current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the decode stage's thread keeps using the device meanwhile
        with (
            abandon_when(None),
            torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"),
        ):
            output = function()

        def replay() -> Output:
            graph.replay()
            return output

        replay.graph = graph  # type: ignore[attr-defined]  # kept alive with the replay
        return replay


class EagerReplay:
    """No capture: each replay runs the function again over the same static
    buffers. What a CPU runs to test the keying, the static inputs and the
    copies of ``StepGraphs`` with the very forward a GPU captures. The
    "capture" rehearses the function once under ``CaptureRules``, so a step
    no CUDA graph could hold raises ``CaptureBreak`` here as on a GPU."""

    def capture(self, function: Replay) -> Replay:
        with abandon_when(None):
            rehearse(function)
        return function


@dataclass
class _Captured:
    inputs: dict[str, torch.Tensor]  # the static inputs the replay reads
    replay: Replay


class StepGraphs:
    """The captured denoise forwards of one pipeline (one loop thread)."""

    def __init__(self, capture: Capture, most: int = 8, after_uses: int = 2) -> None:
        if most < 1 or after_uses < 1:
            raise ValueError(f"need most >= 1 and after_uses >= 1, got {most} and {after_uses}")
        self.capture = capture
        self.most = most
        self.after_uses = after_uses
        self.graphs: OrderedDict[StepKey, _Captured] = OrderedDict()  # least recently used first
        self.uses: Counter[StepKey] = Counter()  # uses of keys not captured (yet)
        self.captures = self.replays = self.fallbacks = self.evictions = self.capture_failures = 0
        self.failure: str | None = None  # the first capture's failure: every step eager since

    def run(
        self,
        key: StepKey,
        inputs: Mapping[str, torch.Tensor],
        forward: Callable[[Mapping[str, torch.Tensor]], Output],
        copy: bool = True,
    ) -> Output:
        """``forward(inputs)`` (a tensor or a tuple of them): eagerly while
        ``key`` is not captured, then by replaying its capture with ``inputs``
        copied into its static ones. The result is the caller's: a copy when
        replayed, unless ``copy`` is false (then the graph's own output, which
        its next replay overwrites: the caller is done with it before). A
        capture that fails runs this step eagerly, and every later one."""
        if self.failure is not None:
            self.fallbacks += 1
            return forward(inputs)
        captured = self.graphs.get(key)
        if captured is None:
            self.uses[key] += 1
            if self.uses[key] < self.after_uses:
                self.fallbacks += 1
                return forward(inputs)
            del self.uses[key]
            statics = {name: tensor.clone() for name, tensor in inputs.items()}
            try:
                replay = self.capture.capture(lambda: forward(statics))
            except Exception as error:  # any failure of a capture: the step runs eagerly (Abandoned is no Exception)
                self._give_up(key, error)
                self.fallbacks += 1
                return forward(inputs)
            captured = self.graphs[key] = _Captured(statics, replay)
            self.captures += 1
            while len(self.graphs) > self.most:
                self.graphs.popitem(last=False)
                self.evictions += 1
        else:
            self.graphs.move_to_end(key)
            for name, tensor in inputs.items():
                captured.inputs[name].copy_(tensor)
        self.replays += 1
        output = captured.replay()
        if not copy:
            return output
        return output.clone() if isinstance(output, torch.Tensor) else tuple(t.clone() for t in output)

    def _give_up(self, key: StepKey, error: Exception) -> None:
        self.capture_failures += 1
        rows = len(key.caches)
        self.failure = f"capturing a {key.kind} step of {rows} row(s) failed: {type(error).__name__}: {error}"
        log.warning("cuda_graphs: %s; every step of this worker runs eagerly from now on", self.failure)
        self.graphs.clear()
        self.uses.clear()

    def forget(self, cache: int) -> None:
        """Drop every graph and count that reads the cache ``cache`` (its
        session is released), those of the batches it was a row of too."""
        for key in [key for key in self.graphs if cache in key.caches]:
            del self.graphs[key]
        for key in [key for key in self.uses if cache in key.caches]:
            del self.uses[key]

    def figures(self) -> dict[str, int]:
        """Counts since start: captures made, replays, eager runs of keys not
        captured (or after a failed capture), graphs dropped to stay within
        ``most``, captures that failed (at most 1: the first stops capturing),
        and graphs held."""
        return {
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "evictions": self.evictions,
            "capture_failures": self.capture_failures,
            "held": len(self.graphs),
        }


CudaGraphsOption = bool | Literal["eager"]


def step_graphs_for(option: CudaGraphsOption, device: torch.device) -> StepGraphs | None:
    """The pipeline option ``cuda_graphs``: ``False``, none (every forward
    eager); ``True``, CUDA graphs, refused (``ValueError`` naming the option and
    the device) where the device is not a GPU; ``"eager"``, ``EagerReplay``: the
    captured-step path (keys, static inputs, copies) with each replay run
    eagerly, on any device: a test and debug mode, no faster than eager."""
    if option is False:
        return None
    if option == "eager":
        return StepGraphs(EagerReplay())
    if option is not True:
        raise ValueError(f'cuda_graphs must be true, false or "eager", got {option!r}')
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graphs: CUDA graphs need a CUDA device; this pipeline runs on {device} "
            '(cuda_graphs: "eager" runs the same static-buffer path without capture, for tests)'
        )
    return StepGraphs(CudaGraphCapture(device))
