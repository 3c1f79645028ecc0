"""The decode stage spread over the pipeline ranks: each session decodes on one rank.

Worker processes. With ``EngineConfig.pp_decode`` ``spread`` (``auto`` on a
CPU), a session's committed chunks are decoded by the rank it was given when
its first chunk committed: the one with the fewest sessions, a follower on a
tie (rank 0 also embeds, steps the sampler and plans). On a CPU the ranks are
processes sharing the cores, and a VAE decode is many small kernels: two
decode threads in rank 0's process beside its ring thread spent about 40 %
more CPU per chunk than one decode alone (they share one interpreter), while
decodes in two processes ran side by side at full speed; and a follower's
own thread mostly waits for its part of the ring.

``RankDecodeStage`` (rank 0) has ``workers.decode_stage.DecodeStage``'s
interface and takes its place in the executor. A session placed on rank 0
decodes on a local lane as before; one placed on rank r: the committed
chunk's clean latent (``ModelRunner.hand_off_decode``) goes to rank r in a
``DECODE`` frame, and a thread per follower waits for its ``DECODED``
frames and hands each ``DecodeResult`` on, as a local lane would. A
session's chunks decode on one rank, in order, and come back in order on one
connection. While a session that is stopping has decodes out on a rank, a
``CANCEL`` frame tells that rank, which abandons the decode between latent
frames, as a local lane does.

``DecodeServer`` (a follower) decodes on a thread of its own: each request
with the rank's copy of the session (``Follower.states``: its decoder's cache
is there), through ``pipeline.decode_latent``. The engine releases a session
only once its decodes came back, so a release never takes a session from
under a decode.

A follower's connection closing (the rank died) ends the group through
``RankGroup.on_death``, as a dead rank seen anywhere does: every session
fails as the worker's death, and the group restarts as one.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable

import torch

from engine.plan import ChunkOutput, DecodeResult
from workers.decode_stage import DecodeStage
from workers.parallel.link import LinkTimeout, Message
from workers.parallel.sockets import CANCEL, DECODE, DECODED, RankSockets
from workers.pipelines.base import Abandoned, abandon_when
from workers.runner import ModelRunner

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a waiting receiver looks for stopping sessions to cancel


def can_spread(pipeline) -> bool:
    """Whether ``pipeline`` can decode a chunk on another rank than the one that made it."""
    return hasattr(pipeline, "decode_input") and hasattr(pipeline, "decode_latent")


class RankDecodeStage:
    def __init__(self, runner: ModelRunner, on_done: Callable[[DecodeResult], None], group) -> None:
        """``group``: the ``RankGroup`` (its sockets, its world, ``on_death``)."""
        self._runner = runner
        self._group = group
        self._sockets: RankSockets = group.sockets
        self._on_done = on_done
        self._local = DecodeStage(runner, self._decoded_here, lanes=1)
        self._rank_of: dict[str, int] = {}  # session -> the rank decoding it (the submitting thread's)
        self._lock = threading.Lock()
        self._out: dict[int, dict[str, deque[int]]] = {rank: {} for rank in range(1, group.world)}  # chunks out
        self._cancelled: set[str] = set()  # sessions a CANCEL went out for
        self._closing = threading.Event()
        self.decodes = [0] * group.world  # chunks decoded, per rank
        self._receivers = [
            threading.Thread(target=self._receive, args=(rank,), name=f"decoded-from-{rank}", daemon=True)
            for rank in range(1, group.world)
        ]
        for thread in self._receivers:
            thread.start()

    def submit(self, session_id: str, chunk_index: int) -> None:
        rank = self._rank_of.get(session_id)
        if rank is None:
            rank = self._rank_of[session_id] = self._place()
        if rank == 0:
            self._local.submit(session_id, chunk_index)
            return
        value = self._runner.hand_off_decode(session_id, chunk_index)
        if isinstance(value, DecodeResult):
            self._on_done(value)
            return
        with self._lock:
            self._out[rank].setdefault(session_id, deque()).append(chunk_index)
        try:
            message = Message({"session": session_id, "chunk": chunk_index}, [value])
            self._sockets.post(rank, DECODE, chunk_index, message)
        except Exception as error:  # the rank is gone: its receiver ends the group
            self._came_back(rank, session_id)
            self._on_done(DecodeResult(session_id, chunk_index, None, 0.0, f"rank {rank}: decode not sent: {error}"))

    def forget(self, session_id: str) -> None:
        """The session was released: its rank may take another."""
        self._rank_of.pop(session_id, None)
        self._local.forget(session_id)
        with self._lock:
            self._cancelled.discard(session_id)

    def close(self) -> None:
        """Decode what rank 0 has, stop waiting for the others (the group is ending)."""
        self._closing.set()
        self._local.close()
        for thread in self._receivers:
            thread.join(2 * POLL_S + 1.0)

    def _place(self) -> int:
        """The rank with the fewest sessions; a follower before rank 0 on a tie."""
        load = [0] * self._group.world
        for rank in self._rank_of.values():
            load[rank] += 1
        order = [*range(1, self._group.world), 0]
        return min(order, key=lambda rank: load[rank])

    def _decoded_here(self, result: DecodeResult) -> None:
        self.decodes[0] += result.chunk is not None
        self._on_done(result)

    def _came_back(self, rank: int, session_id: str) -> None:
        """The oldest chunk of ``session_id`` out on ``rank`` is back (or lost)."""
        self._runner.decode_returned(session_id)
        with self._lock:
            out = self._out[rank]
            out[session_id].popleft()
            if not out[session_id]:
                del out[session_id]

    def _receive(self, rank: int) -> None:
        """Rank ``rank``'s decoded chunks, until the stage closes."""
        while not self._closing.is_set():
            try:
                _, message = self._sockets.take(rank, (DECODED,), None, POLL_S, "decoded chunk")
            except LinkTimeout:
                self._cancel_stopping(rank)
                continue
            except Exception as error:
                if not self._closing.is_set() and not self._group.closing:
                    self._lost(rank, error)
                return
            header = message.header
            sid, chunk_index = header["session"], int(header["chunk"])
            chunk = None
            if header.get("frames") is not None:
                count, width, height = header["frames"]
                chunk = ChunkOutput(count, width, height, message.tensors[0].numpy().tobytes())
            self._came_back(rank, sid)
            self.decodes[rank] += chunk is not None
            self._on_done(
                DecodeResult(sid, chunk_index, chunk, float(header["ms"]), header.get("error"), header["cancelled"])
            )

    def _cancel_stopping(self, rank: int) -> None:
        is_stopping = self._runner.is_stopping
        if is_stopping is None:
            return
        with self._lock:
            stopping = [sid for sid in self._out[rank] if sid not in self._cancelled and is_stopping(sid)]
            self._cancelled.update(stopping)
        for sid in stopping:
            try:
                self._sockets.post(rank, CANCEL, 0, Message({"session": sid}, []))
            except Exception:  # the rank is gone; the next take says so
                pass

    def _lost(self, rank: int, error: BaseException) -> None:
        """The rank is gone: the group ends (its sessions fail as the worker's
        death, ``worker_died``, not as decode errors of their own)."""
        self._group.on_death(f"pipeline rank {rank} lost: {type(error).__name__}: {error}")


class DecodeServer:
    """A follower's decode thread: the chunks rank 0 sends it, decoded with this
    rank's copy of each session."""

    def __init__(self, pipeline, states: dict, sockets: RankSockets) -> None:
        """``states``: the follower's sessions (``Follower.states``), read here."""
        self._pipeline = pipeline
        self._states = states
        self._sockets = sockets
        self._cancelled: set[str] = set()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="decode", daemon=True)
        self._thread.start()

    def forget(self, session_id: str) -> None:
        """The session was released (the follower's thread)."""
        self._cancelled.discard(session_id)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(2 * POLL_S + 1.0)

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                kind, message = self._sockets.take(0, (DECODE, CANCEL), None, POLL_S, "decode request")
            except LinkTimeout:
                continue
            except Exception:  # rank 0 is gone: this process ends with it
                return
            sid = message.header["session"]
            if kind == CANCEL:
                self._cancelled.add(sid)
                continue
            reply = self._decode(sid, int(message.header["chunk"]), message.tensors[0])
            try:
                self._sockets.post(0, DECODED, reply.header["chunk"], reply)
            except Exception:
                return

    def _decode(self, sid: str, chunk_index: int, clean: torch.Tensor) -> Message:
        header = {"session": sid, "chunk": chunk_index, "frames": None, "error": None, "cancelled": False}
        began = time.perf_counter()
        tensors: list[torch.Tensor] = []
        session = self._states.get(sid)
        try:
            if session is None:
                raise RuntimeError(f"session {sid} is not open on rank {self._sockets.rank}")
            if sid in self._cancelled or self._cancel_arrived(sid):
                raise Abandoned
            with abandon_when(lambda: self._cancel_arrived(sid)):
                chunk = self._pipeline.decode_latent(session, clean)
            header["frames"] = [chunk.num_frames, chunk.width, chunk.height]
            with warnings.catch_warnings():  # a read-only buffer: only read, into the frame sent
                warnings.simplefilter("ignore", UserWarning)
                tensors = [torch.frombuffer(chunk.payload, dtype=torch.uint8)]
        except Abandoned:
            header["cancelled"] = True
        except Exception as error:
            header["error"] = f"rank {self._sockets.rank}: decode failed: {type(error).__name__}: {error}"
        header["ms"] = (time.perf_counter() - began) * 1000.0
        return Message(header, tensors)

    def _cancel_arrived(self, sid: str) -> bool:
        """Whether a cancel for ``sid`` came (taking the ones that have arrived)."""
        while True:
            try:
                _, message = self._sockets.take(0, (CANCEL,), None, 0.0, "cancel")
            except LinkTimeout:
                break
            self._cancelled.add(message.header["session"])
        return sid in self._cancelled
