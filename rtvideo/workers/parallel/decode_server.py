"""A follower's decode thread: what rank 0's decode stage sends it, decoded.

Worker processes: pipeline ranks 1..N-1. ``DecodeServer`` decodes on a
thread of its own, with the rank's copy of each session (``Follower.states``:
its decoder's cache is there): a whole chunk through
``pipeline.decode_latent`` (chunks that came together batched through
``pipeline.decode_latents``), a split chunk's parts through
``pipeline.decode_back``, its frames sent once the last part came
(``pipeline.frames_of``), or a batch of split chunks' parts through
``pipeline.back_rows``. Every chunk gets exactly one ``DECODED`` reply, once
its last part came, however its decode ended. ``CANCEL`` frames from rank 0
abandon a stopping session's decodes between latent frames; one that says
``ended`` closes the cancel once the session was released. The other side,
and what travels in each frame, is ``rtvideo.workers.parallel.rank_decode``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import torch

from rtvideo.engine.messages import DecodeCancel, Decoded, DecodeFront, DecodeFronts, DecodeFrontsEnd, DecodeWhole
from rtvideo.engine.plan import ChunkOutput
from rtvideo.engine.session import unsendable
from rtvideo.workers.decode_stage import batch_rounds, decode_batch_rows
from rtvideo.workers.os_threads import lower_this_thread, name_this_thread
from rtvideo.workers.parallel.link import LinkTimeout, Message
from rtvideo.workers.parallel.sockets import CANCEL, DECODE, DECODED, PeerClosed, RankSockets
from rtvideo.workers.pipelines.base import Abandoned, abandon_when

log = logging.getLogger(__name__)
REQUEST_POLL_S = 0.05  # how long the thread waits for a request before it looks whether it is closing


class DecodeServer:
    """A follower's decode thread: the chunks rank 0 sends it, decoded with this
    rank's copy of each session."""

    def __init__(self, pipeline, states: dict, sockets: RankSockets, nice: int = 0) -> None:
        """``states``: the follower's sessions (``Follower.states``), read here.
        ``nice``: steps of ``nice`` the thread runs below the rank
        (``rtvideo.workers.os_threads``)."""
        self._pipeline = pipeline
        self._states = states
        self._sockets = sockets
        # the most whole chunks one batched decode takes (1: each alone)
        self._rows = decode_batch_rows(pipeline) if pipeline.capabilities.rank_decode_batch else 1
        self._cancelled: set[str] = set()
        self._split: dict[tuple[str, int], _SplitChunk] = {}  # split chunks whose last part has not come
        self._split_batches: dict[tuple, _SplitBatch] = {}  # batches of them, by their (session, chunk) rows
        self._closing = threading.Event()
        self._nice = nice
        self._thread = threading.Thread(target=self._serve, name="decode", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(2 * REQUEST_POLL_S + 1.0)

    def _serve(self) -> None:
        """Decode until closed. Rank 0 gone (its connection closed) ends the
        thread quietly: this process ends with it. Anything else that ends the
        thread would leave chunks rank 0 waits for unanswered, and their
        sessions hung: it ends the rank instead, saying why, so rank 0 sees a
        rank's death, fails the group's sessions and restarts the group."""
        name_this_thread()
        lower_this_thread(self._nice)
        try:
            while not self._closing.is_set():
                self._handle(self._requests())
        except PeerClosed:
            return
        except BaseException:
            if self._closing.is_set():  # the rank is stopping: its sockets close under a decode still running
                return
            log.exception("pipeline rank %d: the decode thread failed; the rank ends", self._sockets.rank)
            os._exit(2)

    def _requests(self) -> list[Message]:
        """The decode requests that came: the next one (waiting up to
        ``REQUEST_POLL_S``; none by then: an empty list) and, where whole decodes batch,
        those that came meanwhile. A ``CANCEL`` is applied as it is taken, here
        as in ``_cancel_arrived``: taken ahead and applied later, a cancel could
        land after the end of its session that ``_cancel_arrived`` took
        meanwhile, and outlive it."""
        requests: list[Message] = []
        wait = REQUEST_POLL_S
        while True:
            try:
                kind, message = self._sockets.take(0, (DECODE, CANCEL), None, wait, "decode request")
            except LinkTimeout:
                return requests
            if kind == CANCEL:
                self._note_cancel(message.header)
                continue
            requests.append(message)
            if self._rows <= 1:
                return requests
            wait = 0.0  # what came meanwhile, without waiting: its whole decodes batch

    def _handle(self, requests: list[Message]) -> None:
        """Decode requests (``rtvideo.engine.messages.DecodeRequest``) in the order they
        came: split parts, and whole decodes, which wait to go together
        (``_decode_whole``) until a split part or the end of the list."""
        whole: list[tuple[str, int, torch.Tensor]] = []
        for message in requests:
            header = message.header
            if isinstance(header, DecodeWhole):
                whole.append((header.session_id, header.chunk_index, message.tensors[0]))
                continue
            self._decode_whole(whole)
            whole = []
            if isinstance(header, DecodeFronts | DecodeFrontsEnd):  # a part of a batch of split chunks
                for reply in self._split_batch_part(message):
                    self._sockets.post(0, DECODED, reply.header.chunk_index, reply)
                continue
            reply = self._split_part(message)
            if reply is not None:
                self._sockets.post(0, DECODED, header.chunk_index, reply)
        self._decode_whole(whole)

    def _decode_whole(self, requests: list[tuple[str, int, torch.Tensor]]) -> None:
        """Whole chunks (session, chunk index, clean latent), in rounds of
        batches of at most ``_rows`` (``batch_rounds``: a session's chunks in
        order), each answered as its batch ends."""
        for batch in batch_rounds(requests, self._rows):
            for (_, chunk_index, _), reply in zip(batch, self._decode_batch(batch), strict=True):
                self._sockets.post(0, DECODED, chunk_index, reply)

    def _decode_batch(self, batch: list[tuple[str, int, torch.Tensor]]) -> list[Message]:
        """One batch of whole chunks through ``decode_latents``; a session whose
        cancel came is answered cancelled and left out; the batch is abandoned
        once every session in it is cancelled; when it raises, each chunk
        decodes alone, so only a chunk that fails on its own gets an error."""
        replies: dict[int, Message] = {}
        wanted: list[int] = []
        for row, (sid, chunk_index, _) in enumerate(batch):
            if sid in self._cancelled or self._cancel_arrived(sid):
                replies[row] = self._reply(sid, chunk_index, None, 0.0, None, True)
            elif sid in self._states:
                wanted.append(row)
        if len(wanted) > 1:
            ids = [batch[row][0] for row in wanted]
            sessions = [self._states[sid] for sid in ids]

            def all_cancelled() -> bool:  # takes the cancels that came once, then reads them for every row
                return self._cancel_arrived(ids[0]) and all(sid in self._cancelled for sid in ids)

            began = time.perf_counter()
            try:
                with abandon_when(all_cancelled):
                    chunks = self._pipeline.decode_latents(sessions, [batch[row][2] for row in wanted])
            except Abandoned:
                chunks = [None] * len(wanted)
            except Exception:
                log.warning("a batched decode of %d chunks failed; decoding each alone", len(wanted), exc_info=True)
                chunks = None
            if chunks is not None and len(chunks) != len(wanted):
                log.warning("a batched decode of %d chunks returned %d; decoding each alone", len(wanted), len(chunks))
                chunks = None
            if chunks is not None:
                share = (time.perf_counter() - began) * 1000.0 / len(wanted)
                for row, chunk in zip(wanted, chunks, strict=True):
                    sid, chunk_index, _ = batch[row]
                    replies[row] = self._reply(sid, chunk_index, chunk, share, None, chunk is None)
        for row, (sid, chunk_index, clean) in enumerate(batch):
            if row not in replies:
                replies[row] = self._decode(sid, chunk_index, clean)
        return [replies[row] for row in range(len(batch))]

    def _decode(self, sid: str, chunk_index: int, clean: torch.Tensor) -> Message:
        began = time.perf_counter()
        chunk, error, cancelled = None, None, False
        try:
            session = self._session(sid)
            with abandon_when(lambda: self._cancel_arrived(sid)):
                chunk = self._pipeline.decode_latent(session, clean)
        except Abandoned:
            cancelled = True
        except Exception as failure:
            error = self._failed(failure)
        return self._reply(sid, chunk_index, chunk, (time.perf_counter() - began) * 1000.0, error, cancelled)

    def _split_part(self, message: Message) -> Message | None:
        """One part of a split chunk (``DecodeFront``): a latent frame's back
        stages, or the chunk's last frame (``DecodeFrontEnd``), which gets the
        chunk's one reply (its frames, or that it was
        abandoned or failed, here or on rank 0). The reply waits for the last
        frame even when a part failed or was cancelled: rank 0's front is then
        done with the session, which the engine may release once it has the
        reply. Parts after a failure or a cancel are only counted off."""
        header = message.header
        sid, chunk_index = header.session_id, header.chunk_index
        key = (sid, chunk_index)
        chunk = self._split.setdefault(key, _SplitChunk())
        if not isinstance(header, DecodeFront):  # the last frame
            del self._split[key]
            error, cancelled = chunk.error or header.error, chunk.cancelled or header.cancelled
            output = None
            began = time.perf_counter()
            if error is None and not cancelled:
                try:  # on a GPU the back's kernels are waited for here: their time is counted in this step's
                    output = self._pipeline.frames_of(chunk.pixels)
                except Exception as failure:
                    error = self._failed(failure)
            ms = chunk.back_ms + header.front_ms + (time.perf_counter() - began) * 1000.0
            return self._reply(sid, chunk_index, output, ms, error, cancelled)
        if chunk.error is not None or chunk.cancelled:
            return None
        began = time.perf_counter()
        try:
            session = self._session(sid)
            with abandon_when(lambda: self._cancel_arrived(sid)):
                chunk.pixels.append(self._pipeline.decode_back(session, header.meta, message.tensors[0], header.split))
        except Abandoned:
            chunk.cancelled = True
        except Exception as failure:
            chunk.error = self._failed(failure)
        chunk.back_ms += (time.perf_counter() - began) * 1000.0
        return None

    def _split_batch_part(self, message: Message) -> list[Message]:
        """One part of a batch of split chunks (``DecodeFronts``; ``rows``:
        session and chunk of each): a latent frame's back stages for every row
        (``pipeline.back_rows``), or the batch's last frame
        (``DecodeFrontsEnd``), which gets each
        chunk's one reply (its frames, or that the batch was abandoned or
        failed, here or on rank 0, or that a cancel came for its session). A
        last frame that says ``retry`` is answered by nothing: rank 0 sends
        each chunk again alone, and the sessions' caches here are as they were
        before the batch. The batch is abandoned once every session in it is
        cancelled; once abandoned, parts are only counted off. Its parts are
        kept until its last frame: when one failed here, each row then goes
        through the back alone over them (``_rows_alone``: the sessions' caches
        change only once a batch's frames are made, so the failed batch left
        them as they were), and only a row that fails on its own gets an error.
        A failure while the frames are made, which may have written some
        caches, fails every row."""
        header = message.header
        rows = list(header.rows)
        key = tuple(rows)
        batch = self._split_batches.setdefault(key, _SplitBatch())
        ids = [sid for sid, _ in rows]
        if not isinstance(header, DecodeFronts):  # the last frame
            del self._split_batches[key]
            if header.retry:
                return []
            error, abandoned = batch.error, batch.cancelled or header.cancelled
            outputs: list[ChunkOutput | None] = [None] * len(rows)
            errors: list[str | None] = [error] * len(rows)
            began = time.perf_counter()
            if error is None and not abandoned and batch.back is not None:
                try:  # the back's kernels waited for, as a single chunk's are
                    outputs = batch.back.frames()
                except Exception as failure:  # the caches may be part-written: no row is run again on them
                    errors = [self._failed(failure)] * len(rows)
            elif error is not None and not abandoned:  # a part failed here, the caches untouched: each row alone
                outputs, errors = self._rows_alone(rows, batch.parts)
            ms = (batch.back_ms + header.front_ms + (time.perf_counter() - began) * 1000.0) / len(rows)
            self._cancel_arrived(ids[0])  # take the cancels that came
            replies = []
            for (sid, chunk_index), output, why in zip(rows, outputs, errors, strict=True):
                cancelled = abandoned or sid in self._cancelled
                replies.append(self._reply(sid, chunk_index, None if cancelled else output, ms, why, cancelled))
            return replies
        if batch.cancelled:
            return []
        batch.parts.append((header.meta, message.tensors[0], header.split))  # for each row alone, should it fail
        if batch.error is not None:
            return []
        began = time.perf_counter()
        try:
            if batch.back is None:
                batch.back = self._pipeline.back_rows([self._held(sid) for sid in ids])
            with abandon_when(lambda: self._cancel_arrived(ids[0]) and all(sid in self._cancelled for sid in ids)):
                batch.back.decode(header.meta, message.tensors[0], header.split)
        except Abandoned:
            batch.cancelled = True
        except Exception as failure:
            batch.error = self._failed(failure)
        batch.back_ms += (time.perf_counter() - began) * 1000.0
        return []

    def _reply(self, sid: str, chunk_index: int, chunk, ms: float, error: str | None, cancelled: bool) -> Message:
        return _reply(sid, chunk_index, chunk, ms, error, cancelled, self._sockets.rank)

    def _rows_alone(
        self, rows: list[tuple[str, int]], parts: list[tuple[dict, torch.Tensor, int]]
    ) -> tuple[list[ChunkOutput | None], list[str | None]]:
        """A failed batch's rows, each through the back alone over its own rows of
        the batch's parts: each row's chunk, or its own error."""
        outputs: list[ChunkOutput | None] = []
        errors: list[str | None] = []
        for row, (sid, _) in enumerate(rows):
            try:
                session = self._session(sid)
                back = self._pipeline.decode_back
                pixels = [back(session, meta, activation[row : row + 1], split) for meta, activation, split in parts]
                outputs.append(self._pipeline.frames_of(pixels))
                errors.append(None)
            except Abandoned:  # its cancel came: answered cancelled
                outputs.append(None)
                errors.append(None)
            except Exception as failure:
                outputs.append(None)
                errors.append(self._failed(failure))
        return outputs, errors

    def _held(self, sid: str):
        """This rank's copy of ``sid``; ``RuntimeError`` naming it when it has none."""
        session = self._states.get(sid)
        if session is None:
            raise RuntimeError(f"session {sid} is not open on rank {self._sockets.rank}")
        return session

    def _session(self, sid: str):
        """This rank's copy of ``sid``; ``Abandoned`` once a cancel for it came."""
        session = self._held(sid)
        if sid in self._cancelled or self._cancel_arrived(sid):
            raise Abandoned
        return session

    def _failed(self, error: BaseException) -> str:
        return f"rank {self._sockets.rank}: decode failed: {type(error).__name__}: {error}"

    def _cancel_arrived(self, sid: str) -> bool:
        """Whether a cancel for ``sid`` came (taking the ones that have arrived)."""
        while True:
            try:
                _, message = self._sockets.take(0, (CANCEL,), None, 0.0, "cancel")
            except LinkTimeout:
                break
            self._note_cancel(message.header)
        return sid in self._cancelled

    def _note_cancel(self, header: DecodeCancel) -> None:
        """A ``CANCEL`` frame: the session is stopping (its chunks here are
        answered cancelled), or, with ``ended``, it was released and the cancel
        is over. Both come from rank 0 on this one connection and are taken in
        the order sent, so a cancel that arrives after its session was released
        is always followed by its end, before a later session of the same id
        sends anything."""
        if header.ended:
            self._cancelled.discard(header.session_id)
        else:
            self._cancelled.add(header.session_id)


class _SplitBatch:
    """What a follower holds of a batch of split chunks until its last part."""

    def __init__(self) -> None:
        self.back = None  # the pipeline's BackRows, from the first part
        self.parts: list[tuple[dict, torch.Tensor, int]] = []  # each part's header, activation and split
        self.back_ms = 0.0
        self.error: str | None = None  # a part failed here
        self.cancelled = False  # a part was abandoned here (every session's cancel came)


class _SplitChunk:
    """What a follower holds of a split chunk until its last part."""

    def __init__(self) -> None:
        self.pixels: list[torch.Tensor] = []  # each latent frame's, in order
        self.back_ms = 0.0
        self.error: str | None = None  # a part failed here
        self.cancelled = False  # a part was abandoned here (a cancel came)


def _reply(
    sid: str, chunk_index: int, chunk: ChunkOutput | None, ms: float, error: str | None, cancelled: bool, rank: int
):
    """A ``DECODED`` frame (``Decoded``): the chunk's frames, or why there are none.
    A pipeline's output that cannot travel as frames (not a ``ChunkOutput`` of
    integer sizes and a non-empty bytes payload) is answered as the session's
    decode error: it must fail that session, never the thread that serves every
    session's decodes. Rank 0 checks what travels against the session's size."""
    if chunk is not None and (fault := unsendable(chunk)) is not None:
        chunk, error = None, error or f"rank {rank}: decode returned {fault}"
    frames = None if chunk is None else (chunk.num_frames, chunk.width, chunk.height)
    header = Decoded(session_id=sid, chunk_index=chunk_index, ms=ms, frames=frames, error=error, cancelled=cancelled)
    tensors: list[torch.Tensor] = []
    if chunk is not None:
        with warnings.catch_warnings():  # a read-only buffer: only read, into the frame sent
            warnings.simplefilter("ignore", UserWarning)
            tensors = [torch.frombuffer(chunk.payload, dtype=torch.uint8)]
    return Message(header, tensors)
