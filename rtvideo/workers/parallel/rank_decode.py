"""The decode stage over the pipeline ranks: each session decodes on one rank, or on two.

Worker processes. With ``EngineConfig.pp_decode`` ``spread``, a session's
committed chunks are decoded by the rank it was given when its first chunk
committed: the one with the fewest sessions, a follower on a tie (rank 0 also
embeds, steps the sampler and plans). With ``split``, every session's
decoder is split over two ranks: its first stages on rank 0, on a lane of
their own, and the rest
on the follower the session was given (the one with the fewest), a latent
frame at a time, so that one session's decode, which is causal from chunk to
chunk and cannot be shared out, keeps two processes busy; where the decoder
changes rank is ``rtvideo.workers.parallel.partition.split_decoder``'s choice, from
measured stage times. On a CPU the ranks are
processes sharing the cores, and a VAE decode is many small kernels whose
Python overhead is most of its cost: a thread that decodes beside a rank's
ring thread takes the interpreter lock from it, and decodes in two processes
run side by side at full speed. A split decode keeps both processes busy
with one session, but goes a latent frame at a time, while a whole decode
can take a chunk's frames in one decoder pass where that is exact and
faster (``CausalWanPipeline``). So ``auto`` on a CPU spreads the sessions
whole, which made more frames per second than splitting them in 20 of 24
rounds side by side with four sessions (1.09x at the median) and in 12 of
13 with one exact session; with stream batch (one session filling the
ring) neither led (the split ahead in 6 of 10 rounds), and the whole
decodes took a quarter less CPU for the same frames (docs/ENGINE.md).
The front lane (and a follower's back) decode the chunks of a round as one
batch (below).

``RankDecodeStage`` (rank 0) has ``rtvideo.workers.decode_stage.DecodeStage``'s
interface and takes its place in the executor. A session placed on rank 0
decodes on a local lane as before (batching what waits on it where the
pipeline batches decodes); one placed on rank r: the committed
chunk's clean latent (``RunnerSessions.hand_off_decode``) goes to rank r in a
``DECODE`` frame (``rtvideo.engine.messages.DecodeWhole``), and a thread per follower
waits for its ``DECODED`` frames (``Decoded``) and hands each
``DecodeResult`` on, as a local lane would. Every frame's header is a typed
message of ``rtvideo.engine.messages``, encoded by ``rtvideo.engine.transport``; one that is
not what its frame must carry is a ``BadMessage`` naming what is wrong
(``RankSockets.take``). A session's chunks decode on one rank, in order, and
come back in order on one connection. While a session that is stopping has
decodes out on a rank, a ``CANCEL`` frame (``DecodeCancel``) tells that rank,
which abandons the decode between latent frames, as a local lane does; once
the session is released, a ``CANCEL`` that says ``ended`` follows it on the
same connection, so a cancel that reached the follower late never outlives
its session (``forget``).

A split decode: rank 0's front lane takes the chunk's clean latent, runs the
front stages of each latent frame (``pipeline.decode_front``) and sends each
activation in a ``DECODE`` frame (``DecodeFront``, with its ``part``), then
one last ``DECODE`` frame that ends the chunk (``DecodeFrontEnd``: its front
time, or that it was abandoned, or failed). However a chunk's decode ends, the follower answers it
with exactly one ``DECODED`` frame, once the last frame came: so rank 0's
front is done with the session by the time the engine learns the decode is
back (and may release the session).

Split chunks batch: the front lane holds what waits on it until a round of
the sessions' chunks has come (``rtvideo.workers.decode_gather.RoundGather``, told of
every micro-step by the executor through ``step_done``), then sends the
chunks whose decoders are at the same point through the front as one batch
(``pipeline.decode_fronts``): each latent frame's activation of every row in
one ``DECODE`` frame (``DecodeFronts``, with ``rows``: session and chunk of
each), and one last frame for the batch (``DecodeFrontsEnd``). The follower
runs each part through the back as one batch (``pipeline.back_rows``) and
answers each chunk with its own
``DECODED`` frame once the last came. Both sides change the sessions' caches
only once the batch is through, so a batch that fails on rank 0 is sent
again chunk by chunk (its last frame says ``retry``, and the follower drops
what it had).

A follower answers on its decode thread
(``rtvideo.workers.parallel.decode_server.DecodeServer``). The engine releases a
session only once its decodes came back, so a release never takes a session
from under a decode.

A follower's connection closing (the rank died) ends the group through
``RankGroup.on_death``, as a dead rank seen anywhere does: every session
fails as the worker's death, and the group restarts as one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from rtvideo.engine.messages import (
    DecodeCancel,
    DecodeFront,
    DecodeFrontEnd,
    DecodeFronts,
    DecodeFrontsEnd,
    DecodeWhole,
)
from rtvideo.engine.plan import ChunkOutput, DecodeResult
from rtvideo.workers.decode_gather import RoundGather
from rtvideo.workers.decode_stage import DecodeStage, batch_rounds, decode_batch_rows
from rtvideo.workers.ordered_thread import OrderedThread
from rtvideo.workers.parallel.link import LinkTimeout, Message
from rtvideo.workers.parallel.sockets import CANCEL, DECODE, DECODED, RankSockets
from rtvideo.workers.pipelines.base import Abandoned, abandon_when
from rtvideo.workers.runner_sessions import RunnerSessions

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a waiting receiver looks for stopping sessions to cancel


def can_spread(pipeline) -> bool:
    """Whether ``pipeline`` can decode a chunk on another rank than the one that
    made it: it declares ``rank_decode`` (``rtvideo.workers.pipelines.capabilities``)."""
    return pipeline.capabilities.rank_decode


def can_split(pipeline) -> bool:
    """Whether ``pipeline``'s decoder can be split over two ranks: it declares
    ``split_decode`` and this decoder has stages to split between."""
    return pipeline.capabilities.split_decode and pipeline.decode_stages >= 2


class RankDecodeStage:
    def __init__(
        self,
        sessions: RunnerSessions,
        on_done: Callable[[DecodeResult], None],
        group,
        split: int = 0,
        nice: int = 0,
    ) -> None:
        """``sessions``: the runner's (``runner.sessions``), whose deferred
        decodes this runs or hands off. ``group``: the ``RankGroup`` (its sockets, its world, ``on_death``).
        ``split``: 0, each session decodes whole on one rank (``spread``); else
        every session's decoder is split, its first ``split`` stages on rank 0.
        ``nice``: steps of ``nice`` rank 0's decode lanes run below the worker
        (``rtvideo.workers.os_threads``)."""
        self._sessions = sessions
        self._split = split
        rows = decode_batch_rows(sessions.pipeline)
        # split chunks a front batch takes
        self._front_rows = rows if sessions.pipeline.capabilities.split_decode_batch else 1
        self._front = None
        self._gather = RoundGather(self._front_rows)  # when the front lane's waiting chunks go together
        if split and self._front_rows > 1:
            self._front = OrderedThread(
                "decode-front", self._decode_front, self._decode_fronts, self._gather.ready, nice=nice
            )
            self._gather.watch(self._front.recheck)
        elif split:
            self._front = OrderedThread("decode-front", self._decode_front, nice=nice)
        self._group = group
        self._sockets: RankSockets = group.sockets
        self._on_done = on_done
        # Rank 0's own whole decodes (none when sessions are split: a split decode ends on a follower).
        self._local = None if split else DecodeStage(sessions, on_done, lanes=1, batch=rows, nice=nice)
        self._rank_of: dict[str, int] = {}  # session -> the rank decoding it (the submitting thread's)
        self._lock = threading.Lock()
        # chunks out on each follower, per session in order: (chunk index, when it was handed off)
        self._out: dict[int, dict[str, deque[tuple[int, float]]]] = {rank: {} for rank in range(1, group.world)}
        self._answered = [0.0] * group.world  # when each follower last sent a decoded chunk back
        self._timeout_s = group.sockets.timeout_s  # pp_timeout_s
        self._cancelled: set[str] = set()  # sessions a CANCEL went out for
        self._closing = threading.Event()
        self._decoded = [0] * group.world  # chunks the followers decoded, per rank (rank 0's: its lane counts)
        self._receivers = [
            threading.Thread(target=self._receive, args=(rank,), name=f"decoded-from-{rank}", daemon=True)
            for rank in range(1, group.world)
        ]
        for thread in self._receivers:
            thread.start()

    def submit(self, session_id: str, chunk_index: int) -> None:
        rank = self._rank_of.get(session_id)
        if rank is None:
            rank = self._rank_of[session_id] = self._place(session_id)
        if rank == 0:
            self._local.submit(session_id, chunk_index)
            return
        if self._split:
            self._front.submit((session_id, chunk_index, rank, self._gather.arrived(session_id)))
            return
        value = self._hand_off(session_id, chunk_index, rank)
        if value is None:
            return
        try:
            message = Message(DecodeWhole(session_id=session_id, chunk_index=chunk_index), [value])
            self._sockets.post(rank, DECODE, chunk_index, message)
        except Exception as error:
            self._not_sent(rank, session_id, chunk_index, error)

    def step_done(self, idle: bool) -> None:
        """A micro-step ended (``idle``: none is queued after it): the front lane's
        waiting chunks may go (``rtvideo.workers.decode_gather``)."""
        self._gather.step_done(idle)

    def forget(self, session_id: str) -> None:
        """The session was released: its rank may take another. A follower that
        was sent a cancel for it is told the session ended, on the connection
        the cancel went on and after it (``DecodeServer``: a later session of
        the same id must not inherit the cancel)."""
        rank = self._rank_of.pop(session_id, None)
        self._gather.forget(session_id)
        if self._local is not None:
            self._local.forget(session_id)
        with self._lock:
            cancelled = session_id in self._cancelled
            self._cancelled.discard(session_id)
        if cancelled and rank:
            try:
                self._sockets.post(rank, CANCEL, 0, Message(DecodeCancel(session_id=session_id, ended=True), []))
            except Exception:  # the rank is gone: the group ends, and its receiver says so
                pass

    def close(self) -> None:
        """Decode what rank 0 has, stop waiting for the others (the group is ending)."""
        self._closing.set()
        if self._local is not None:
            self._local.close()
        if self._front is not None:
            self._front.close()
        for thread in self._receivers:
            thread.join(2 * POLL_S + 1.0)

    def _place(self, session_id: str) -> int:
        """Where ``session_id``'s decodes go: the rank with the fewest sessions,
        a follower before rank 0 on a tie; split, a follower (rank 0 runs every
        split session's front)."""
        load = [0] * self._group.world
        for rank in self._rank_of.values():
            load[rank] += 1
        order = [*range(1, self._group.world)] + ([] if self._split else [0])
        return min(order, key=lambda rank: load[rank])

    def _decode_front(self, item: tuple[str, int, int, int]) -> bool:
        """The front lane: a split chunk's front stages here, each latent frame's
        activation posted to ``rank`` as it is made, then the chunk's last frame."""
        session_id, chunk_index, rank, _ = item
        value = self._hand_off(session_id, chunk_index, rank)
        if value is not None:
            self._send_front(session_id, chunk_index, rank, value)
        return True

    def _decode_fronts(self, items: list[tuple[str, int, int, int]]) -> bool:
        """The split chunks waiting on the front lane (session, chunk, follower,
        ``RoundGather.arrived``) once the gather lets them go, in rounds of
        batches of at most ``_front_rows`` (``batch_rounds``: a session's chunks
        in order); in each batch the chunks for one follower whose decoders are
        at the same point (``pipeline.decode_groups``) go through the front as
        one batch (``_send_fronts``), others alone."""
        for batch in batch_rounds(items, self._front_rows):
            handed = []
            for session_id, chunk_index, rank, _ in batch:
                value = self._hand_off(session_id, chunk_index, rank)
                if value is not None:
                    handed.append((session_id, chunk_index, rank, value))
            for rank in dict.fromkeys(row[2] for row in handed):
                rows = [row for row in handed if row[2] == rank]
                states = [self._sessions.states[row[0]] for row in rows]
                for group in self._sessions.pipeline.decode_groups(states, [row[3] for row in rows]):
                    if len(group) == 1:
                        self._send_front(*rows[group[0]])
                    else:
                        self._send_fronts(rank, [rows[row] for row in group])
        return True

    def _send_fronts(self, rank: int, rows: list[tuple[str, int, int, torch.Tensor]]) -> None:
        """Split chunks of different sessions (session, chunk, ``rank``, clean
        latent) through the front as one batch (``pipeline.decode_fronts``): each
        latent frame's activation of every row in one ``DECODE`` frame
        (``DecodeFronts``), then one last frame for the batch
        (``DecodeFrontsEnd``: its front time, or that it was abandoned: every
        session in it is stopping). When the batch raises, the last frame says
        ``retry`` (the follower drops it unanswered) and each chunk goes
        through the front alone, so only a chunk that fails on its own gets an
        error."""
        ids = [row[0] for row in rows]
        keys = tuple((row[0], row[1]) for row in rows)
        number = rows[0][1]
        began = time.perf_counter()
        cancelled = retry = False
        try:
            try:
                with abandon_when(self._sessions.stop_check(ids)):
                    states = [self._sessions.states[sid] for sid in ids]
                    parts = self._sessions.pipeline.decode_fronts(states, [row[3] for row in rows], self._split)
                    for part, (meta, activation) in enumerate(parts):
                        header = DecodeFronts(rows=keys, split=self._split, part=part, meta=meta)
                        self._sockets.post(rank, DECODE, number, Message(header, [activation]))
            except Abandoned:
                cancelled = True
            except Exception:  # the pipeline's, or the rank is gone (then the next post raises too)
                log.warning("a batched decode front of %d chunks failed; each goes alone", len(rows), exc_info=True)
                retry = True
            front_ms = (time.perf_counter() - began) * 1000.0
            end = DecodeFrontsEnd(rows=keys, split=self._split, front_ms=front_ms, cancelled=cancelled, retry=retry)
            self._sockets.post(rank, DECODE, number, Message(end, []))
            self._sent(rank, list(keys))
        except Exception as error:
            for sid, chunk_index, _, _ in rows:
                self._not_sent(rank, sid, chunk_index, error)
            return
        if retry:
            for row in rows:
                self._send_front(*row)

    def _send_front(self, session_id: str, chunk_index: int, rank: int, value: torch.Tensor) -> None:
        """One split chunk (its clean latent handed off) through the front: a
        ``DecodeFront`` frame per latent frame, then its ``DecodeFrontEnd``."""
        key = {"session_id": session_id, "chunk_index": chunk_index, "split": self._split}
        began = time.perf_counter()
        cancelled, failure = False, None
        try:
            try:
                with abandon_when(self._sessions.stop_check((session_id,))):
                    parts = self._sessions.pipeline.decode_front(self._sessions.states[session_id], value, self._split)
                    for part, (meta, activation) in enumerate(parts):
                        header = DecodeFront(**key, part=part, meta=meta)
                        self._sockets.post(rank, DECODE, chunk_index, Message(header, [activation]))
            except Abandoned:
                cancelled = True
            except Exception as error:  # the pipeline's, or the rank is gone (then the next post raises too)
                failure = f"decode failed: {type(error).__name__}: {error}"
            front_ms = (time.perf_counter() - began) * 1000.0
            end = DecodeFrontEnd(**key, front_ms=front_ms, error=failure, cancelled=cancelled)
            self._sockets.post(rank, DECODE, chunk_index, Message(end, []))
            self._sent(rank, [(session_id, chunk_index)])
        except Exception as error:
            self._not_sent(rank, session_id, chunk_index, error)

    def _not_sent(self, rank: int, session_id: str, chunk_index: int, error: BaseException) -> None:
        """A decode request could not be sent: the connection to ``rank`` is
        broken, so the rank is gone and the group ends (its sessions fail as the
        worker's death, not this chunk as a decode error); while the stage
        closes, the chunk's result says it was not sent."""
        self._came_back(rank, session_id)
        if self._closing.is_set() or self._group.closing:
            self._on_done(DecodeResult(session_id, chunk_index, None, 0.0, f"rank {rank}: decode not sent: {error}"))
        else:
            self._lost(rank, error)

    @property
    def decodes(self) -> list[int]:
        """Chunks decoded (with frames), per rank: a split chunk counts on the
        follower that finished it."""
        return [0 if self._local is None else self._local.decodes[0], *self._decoded[1:]]

    def _hand_off(self, session_id: str, chunk_index: int, rank: int):
        """The chunk's clean latent, now out on ``rank``; None when it will not
        decode there (its result went on already: the session is stopping, or
        the pipeline failed)."""
        value = self._sessions.hand_off_decode(session_id, chunk_index)
        if isinstance(value, DecodeResult):
            self._on_done(value)
            return None
        with self._lock:
            self._out[rank].setdefault(session_id, deque()).append((chunk_index, time.monotonic()))
        return value

    def _came_back(self, rank: int, session_id: str) -> None:
        """The oldest chunk of ``session_id`` out on ``rank`` is back (or lost)."""
        self._sessions.decode_returned(session_id)
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
                if (silent := self._silent_s(rank)) > self._timeout_s:
                    self._lost(rank, TimeoutError(f"no decode came back in {silent:.0f} s (pp_timeout_s)"))
                    return
                continue
            except Exception as error:
                if not self._closing.is_set() and not self._group.closing:
                    self._lost(rank, error)
                return
            self._answered[rank] = time.monotonic()
            header = message.header  # a Decoded (RankSockets.take)
            sid, chunk_index = header.session_id, header.chunk_index
            chunk = None
            if header.frames is not None:
                count, width, height = header.frames
                chunk = ChunkOutput(count, width, height, message.tensors[0].numpy().tobytes())
            self._came_back(rank, sid)
            self._decoded[rank] += chunk is not None
            self._on_done(DecodeResult(sid, chunk_index, chunk, header.ms, header.error, header.cancelled))

    def _sent(self, rank: int, keys: list[tuple[str, int]]) -> None:
        """The split chunks of ``keys`` (session, chunk) went out whole to ``rank``
        now: the follower owes their decode from here, not from their hand-off
        (rank 0's own front stages ran in between)."""
        now = time.monotonic()
        with self._lock:
            for session_id, chunk_index in keys:
                out = self._out[rank].get(session_id, ())
                for position, (index, _) in enumerate(out):
                    if index == chunk_index:
                        out[position] = (index, now)

    def _silent_s(self, rank: int) -> float:
        """How long ``rank`` has owed a decode and sent none back: since its last
        answer, or since the oldest chunk out was handed off where that came
        later (0 with nothing out). A follower decodes what it is sent in order,
        so past ``pp_timeout_s`` its decode thread is wedged (or the rank is
        stopped), and every session decoding there would wait for ever."""
        with self._lock:
            oldest = min((out[0][1] for out in self._out[rank].values()), default=None)
        if oldest is None:
            return 0.0
        return time.monotonic() - max(oldest, self._answered[rank])

    def _cancel_stopping(self, rank: int) -> None:
        is_stopping = self._sessions.is_stopping
        if is_stopping is None:
            return
        with self._lock:
            stopping = [sid for sid in self._out[rank] if sid not in self._cancelled and is_stopping(sid)]
            self._cancelled.update(stopping)
        for sid in stopping:
            try:
                self._sockets.post(rank, CANCEL, 0, Message(DecodeCancel(session_id=sid), []))
            except Exception:  # the rank is gone; the next take says so
                pass

    def _lost(self, rank: int, error: BaseException) -> None:
        """The rank is gone: the group ends (its sessions fail as the worker's
        death, ``worker_died``, not as decode errors of their own)."""
        self._group.on_death(f"pipeline rank {rank} lost: {type(error).__name__}: {error}")
