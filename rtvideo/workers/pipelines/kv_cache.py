"""A session's self-attention KV cache: sink frames plus a rolling window.

Worker process; tensors live on the model's device. One ``SessionKVCache`` per
session, preallocated at its full size when the session opens, so memory is
constant however long the stream runs. Keys are stored *before* RoPE: the
attention processor ropes them at cache-relative positions on every read
(sinks first, then the window, then the chunk being computed), so positions
never exceed ``sink + window + chunk`` frames and never run off the RoPE
table, however many chunks the session makes.

Layout per layer: ``[batch, (capacity_frames + tail_frames) * tokens_per_frame,
heads, head_dim]``, frames in time order: the first ``sink_frames`` frames ever
committed stay; after them the most recent frames, oldest first. The
``tail_frames`` after the held frames are a workspace: a forward writes its
chunk's values there, in place (``values_with``), so attention reads [held,
chunk] as one contiguous span of the store instead of a concatenated copy
per layer per forward, at an address that does not change from forward to
forward (what a captured chunk step needs). A commit overwrites that span
with the chunk's clean values as before.

A cache holds the layers it is given (``layers``): all of them on one rank,
a rank's own block range when the transformer is split over ranks. Every
rank commits every chunk, so their ``frames`` agree.

Stream batch (a session with chunks in flight at once): each denoise pass of
a chunk also keeps its keys and values *provisionally* (``stage_provisional``,
replacing the chunk's earlier ones), until the chunk's commit replaces them
with its clean ones. A later chunk of the session attends to the committed
frames, then to the provisional frames of the chunks before it that are
still in flight, in order (``read_provisional``; its own positions come after
them: ``frames_before``). They live outside the preallocated store: at most
the chunks in flight, one chunk's worth each.
"""

from __future__ import annotations

import itertools

import torch

_uids = itertools.count()


class SessionKVCache:
    def __init__(
        self,
        layers: range | int,
        sink_frames: int,
        window_frames: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device,
        tail_frames: int = 0,
    ) -> None:
        if sink_frames < 0 or window_frames < 1 or tail_frames < 0:
            raise ValueError("need sink_frames >= 0, window_frames >= 1 and tail_frames >= 0")
        self.sink_frames = sink_frames
        self.window_frames = window_frames
        self.capacity = sink_frames + window_frames
        self.tail_frames = tail_frames
        self.tokens_per_frame = tokens_per_frame
        shape = (batch, (self.capacity + tail_frames) * tokens_per_frame, heads, head_dim)
        self.layers = range(layers) if isinstance(layers, int) else layers
        self.layout = self.layout_of(
            layers, sink_frames, window_frames, tokens_per_frame, heads, head_dim, batch, dtype, device, tail_frames
        )
        """What a cache of these stores is: a released session's cache serves another of the same layout."""
        self.keys = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.layers}
        self.values = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.layers}
        self.uid = next(_uids)  # unique for the process's lifetime (unlike id())
        self.version = 0  # bumped whenever what ``read`` returns changes
        self.frames = 0  # frames held now
        self.committed_frames = 0  # frames ever committed
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._provisional: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # chunk -> layer -> k, v

    @staticmethod
    def layout_of(
        layers: range | int,
        sink_frames: int,
        window_frames: int,
        tokens_per_frame: int,
        heads: int,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device: torch.device,
        tail_frames: int = 0,
    ) -> tuple:
        """The ``layout`` of a cache made with these arguments (the constructor's)."""
        layers = range(layers) if isinstance(layers, int) else layers
        spans = (sink_frames, window_frames, tail_frames, tokens_per_frame, heads, head_dim, batch)
        return (tuple(layers), spans, dtype, torch.device(device))

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The held (un-roped) keys and values of ``layer``, in time order."""
        end = self.frames * self.tokens_per_frame
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def values_with(self, layer: int, values: torch.Tensor) -> torch.Tensor | None:
        """Layer ``layer``'s held values followed by ``values`` (one row: the chunk
        being computed, [1, tokens, heads, head_dim]) as one contiguous view of
        the store, ``values`` copied into the span after the held frames; None
        when that span is too short (more tokens than ``tail_frames`` hold while
        the cache is full) or the cache has more than one row."""
        store = self.values[layer]
        start = self.frames * self.tokens_per_frame
        end = start + values.shape[1]
        if store.shape[0] != 1 or values.shape[0] != 1 or end > store.shape[1]:
            return None
        store[:, start:end].copy_(values)
        return store[:, :end]

    def tail(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``tokens`` tokens after the held frames in layer ``layer``'s key
        and value stores (views): where a captured commit pass writes its
        chunk's keys and values, to be ``stage``d from there (so its graph holds
        no output of its own). ``ValueError`` when the stores end before."""
        start = self.frames * self.tokens_per_frame
        keys, values = self.keys[layer], self.values[layer]
        if start + tokens > keys.shape[1]:
            raise ValueError(
                f"{tokens} tokens after {self.frames} held frames overrun the store's {keys.shape[1]} "
                f"(tail_frames {self.tail_frames})"
            )
        return keys[:, start : start + tokens], values[:, start : start + tokens]

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep one layer's keys and values of the chunk being committed."""
        self._staged[layer] = (keys, values)

    def check_staged(self) -> None:
        """``RuntimeError`` unless every layer held has a chunk staged (``commit`` can run)."""
        if self._staged.keys() != self.keys.keys():
            raise RuntimeError(f"commit needs every layer staged, got {len(self._staged)} of {len(self.keys)}")

    def commit(self, num_frames: int) -> None:
        """Append the staged chunk (``num_frames`` frames) to every layer held, evicting
        the oldest window frames when full."""
        self.check_staged()
        if num_frames > self.window_frames:
            raise ValueError(f"a chunk of {num_frames} frames does not fit a window of {self.window_frames}")
        t = self.tokens_per_frame
        overflow = max(0, self.frames + num_frames - self.capacity)
        keep_from = self.sink_frames + overflow  # first window frame that survives
        for layer, (keys, values) in self._staged.items():
            for store, new in ((self.keys[layer], keys), (self.values[layer], values)):
                if overflow:
                    survivors = store[:, keep_from * t : self.frames * t].clone()
                    store[:, self.sink_frames * t : self.sink_frames * t + survivors.shape[1]] = survivors
                start = (self.frames - overflow) * t
                store[:, start : start + num_frames * t] = new
        self._staged.clear()
        self.frames = self.frames - overflow + num_frames
        self.committed_frames += num_frames
        self.version += 1

    def stage_provisional(self, chunk_index: int, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep one layer's keys and values of chunk ``chunk_index`` as its latest
        denoise pass left them, for the later chunks in flight to attend to."""
        self._provisional.setdefault(chunk_index, {})[layer] = (keys, values)

    def read_provisional(self, chunk_index: int, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The provisional (un-roped) keys and values of ``layer`` of the chunks
        before ``chunk_index`` still in flight, in chunk order; None when none."""
        before = [self._provisional[c][layer] for c in sorted(self._provisional) if c < chunk_index]
        if not before:
            return None
        if len(before) == 1:
            return before[0]
        return torch.cat([k for k, _ in before], dim=1), torch.cat([v for _, v in before], dim=1)

    def frames_before(self, chunk_index: int) -> int:
        """The frames chunk ``chunk_index`` attends to before itself: the held ones,
        then the provisional ones of the chunks in flight before it."""
        pending = 0
        for chunk, layers in self._provisional.items():
            if chunk < chunk_index and layers:
                pending += next(iter(layers.values()))[0].shape[1] // self.tokens_per_frame
        return self.frames + pending

    def drop_provisional(self, chunk_index: int) -> None:
        """Chunk ``chunk_index`` is committed: its provisional keys and values go."""
        self._provisional.pop(chunk_index, None)

    def reset(self) -> None:
        """Forget everything held (hard reset and re-cache)."""
        self.frames = 0
        self._staged.clear()
        self._provisional.clear()
        self.version += 1

    def take_staged(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The staged keys and values, in layer order, no longer staged (a
        captured commit pass hands them out of its graph, then ``stage``s them)."""
        staged = [self._staged[layer] for layer in self.layers if layer in self._staged]
        self._staged.clear()
        return staged

    def recycle(self) -> None:
        """Hold nothing, as a new cache of the same layout does: a released
        session's stores kept for the next session (their addresses stay, what
        they held is never read again: every read stops at ``frames``)."""
        self.reset()
        self.committed_frames = 0

    @classmethod
    def empty(cls, device: torch.device) -> SessionKVCache:
        """A cache of no layers (what a released session holds once its stores went to another)."""
        return cls(0, 0, 1, 1, 1, 1, 1, torch.float32, device)

    def free(self) -> None:
        """Drop the tensors (the session is released); ``nbytes`` is 0 after."""
        self.keys, self.values = {}, {}
        self.reset()

    def nbytes(self) -> int:
        held = [*self.keys.values(), *self.values.values()]
        held += [t for layers in self._provisional.values() for kv in layers.values() for t in kv]
        return sum(t.numel() * t.element_size() for t in held)
