"""The causal Wan pipeline's decode side: committed chunks to frames.

Worker process. ``CausalWanDecoding`` is the part of ``CausalWanPipeline``
that turns a committed chunk's clean latent into uint8 frames through the
session's streaming VAE decoder (``vae_stream.StreamingDecoder``, whose
causal feature cache lives in the session), in three placements:

- ``decode``: here, on the thread the decode stage gave the session;
- ``decode_input`` then ``decode_latent``: the clean latent handed to the
  pipeline rank the session's decodes were given, which holds its own copy
  of the session and so of the decoder's cache;
- ``decode_front`` then ``decode_back`` and ``frames_of``: the decoder
  split over two ranks (its first stages here, the rest on another rank, a
  latent frame at a time), each rank's copy of the session filling only the
  cache slots of its own stages.

All three give the same frames, bit for bit, on one device. Each session's
frames come from the decoder it chose (``CausalWanSession.decoder``: the
model's own, or the tiny streaming one, ``tiny_decoder``); the tiny one is
not split: its whole chunk is made in front and handed on as a part that
says so (``WHOLE``). ``decode_batch``
(and ``decode_latents``, for the rank a session's decodes were given to)
decodes several sessions' chunks through one decoder batch each group of
them whose decoders are at the same point (on a CPU, bit for bit what each
decodes alone).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from rtvideo.engine.plan import ChunkOutput
from rtvideo.workers.pipelines.causal_wan_state import CausalWanSession
from rtvideo.workers.pipelines.vae_stream import FrontPart, StreamingDecoder

WHOLE = -1  # a split decode's part that is a whole chunk's pixels already (a decoder that is not split)


class CausalWanDecoding:
    """Needs ``decoder`` (the model's ``StreamingDecoder``), ``decoders`` (every
    decoder loaded, by ``StartSession.decoder`` name), ``device``,
    ``default_size``, ``spatial`` (pixels per latent) and ``latent_frames`` of
    the pipeline."""

    decoder: StreamingDecoder
    decoders: dict
    device: torch.device

    @torch.no_grad()
    def decode(self, session: CausalWanSession, chunk_index: int) -> ChunkOutput:
        """The chunk's frames, latent frame by latent frame through the session's
        streaming decoder (its causal feature cache carries over from the last chunk)."""
        chunk = session.chunk_to_decode(chunk_index)
        with self._decode_stream(chunk.committed_on_device):
            output = self._decode_clean(session, chunk.clean)
        del session.chunks[chunk_index]
        return output

    @torch.no_grad()
    def decode_batch(self, sessions: Sequence[CausalWanSession], chunk_indices: Sequence[int]) -> list[ChunkOutput]:
        """``decode`` of one chunk of each of several sessions (distinct ones),
        their frames in the same order: the chunks whose latents and decoder
        caches agree in shape, and whose streams are all at their first frame
        or all past it, go through the decoder as one batch
        (``StreamingDecoder.decode_rows``). All or nothing: when it raises or
        is abandoned, no session's decoder cache or chunk record has changed."""
        _distinct(sessions, "decode_batch")
        chunks = [session.chunk_to_decode(index) for session, index in zip(sessions, chunk_indices, strict=True)]
        with self._decode_stream(*(chunk.committed_on_device for chunk in chunks)):
            outputs = self._decode_rows(sessions, [chunk.clean for chunk in chunks])
        for session, index in zip(sessions, chunk_indices, strict=True):
            del session.chunks[index]
        return outputs

    @torch.no_grad()
    def decode_latents(self, sessions: Sequence[CausalWanSession], cleans: Sequence[torch.Tensor]) -> list[ChunkOutput]:
        """``decode_latent`` of one chunk of each of several sessions (distinct
        ones) on the rank their decodes were given to, batched as
        ``decode_batch`` batches them; all or nothing, as it is."""
        _distinct(sessions, "decode_latents")
        with self._decode_stream(None):
            return self._decode_rows(sessions, [clean.to(self.device) for clean in cleans])

    def decode_input(self, session: CausalWanSession, chunk_index: int) -> torch.Tensor:
        """What another rank needs to decode a committed chunk (its clean latent, on
        the host); the chunk's record is dropped here, as ``decode`` drops it."""
        chunk = session.chunk_to_decode(chunk_index)
        if chunk.committed_on_device is not None:
            chunk.committed_on_device.synchronize()
        clean = chunk.clean.detach().cpu()
        del session.chunks[chunk_index]
        return clean

    @torch.no_grad()
    def decode_latent(self, session: CausalWanSession, clean: torch.Tensor) -> ChunkOutput:
        """``decode`` on the rank a session's decodes were given to: the chunk's
        clean latent came from the first rank (``decode_input``); this rank's
        copy of the session holds its decoder's cache."""
        with self._decode_stream(None):
            return self._decode_clean(session, clean.to(self.device))

    # -- the decoder split over two ranks ---------------------------------------------

    @property
    def decode_stages(self) -> int:
        """Stages the decoder can be split between (0: it cannot be split)."""
        return self.decoder.stages

    def decode_stage_seconds(self) -> list[float]:
        """Each decoder stage's seconds for a chunk at the default size."""
        width, height = self.default_size
        return self.decoder.stage_seconds(self.latent_frames, height // 8, width // 8)

    def decode_front(
        self, session: CausalWanSession, clean: torch.Tensor, split: int
    ) -> Iterator[tuple[dict, torch.Tensor]]:
        """The first ``split`` decoder stages of a chunk (its clean latent from
        ``decode_input``), per latent frame: what ``decode_back`` needs, a header
        (``slot``) and the activation on the host. Fills this copy of the
        session's front cache slots."""
        with self._decode_stream(None):
            if session.decoder != "full":  # not split: the whole chunk here, handed on as one part
                yield {"slot": WHOLE}, self._pixels(session, clean.to(self.device)).cpu()
                return
            for part in self.decoder.decode_front(clean.to(self.device).float(), session.vae_cache, split):
                yield {"slot": part.slot}, part.activation.cpu()

    @torch.no_grad()
    def decode_back(
        self, session: CausalWanSession, header: dict, activation: torch.Tensor, split: int
    ) -> torch.Tensor:
        """The other decoder stages of one latent frame (``decode_front``'s),
        with this copy of the session's back cache slots: its pixels (a
        ``WHOLE`` part is its chunk's pixels already). On a GPU every step of
        the split decode's back, the copy to the device included, is on the calling
        thread's decode stream: its kernels are then in order with
        ``frames_of``'s, which waits for them."""
        with self._decode_stream(None):
            if int(header["slot"]) == WHOLE:
                return activation.to(self.device)
            part = FrontPart(activation.to(self.device), int(header["slot"]))
            return self.decoder.decode_back(part, session.vae_cache, split)

    def decode_groups(self, sessions: Sequence[CausalWanSession], cleans: Sequence[torch.Tensor]) -> list[list[int]]:
        """The rows of ``sessions`` (each with its chunk's clean latent in
        ``cleans``) that can go through the decoder as one batch, in groups in
        order of their first row: those whose latents and this rank's copies of
        their decoder caches agree in shape and whose streams have begun alike."""
        groups: dict[tuple, list[int]] = {}
        for row, (session, clean) in enumerate(zip(sessions, cleans, strict=True)):
            decoder = self._decoder_of(session)
            key = (session.decoder, tuple(clean.shape), session.decoded_any, decoder.cache_shape(session.vae_cache))
            groups.setdefault(key, []).append(row)
        return list(groups.values())

    def decode_fronts(
        self, sessions: Sequence[CausalWanSession], cleans: Sequence[torch.Tensor], split: int
    ) -> Iterator[tuple[dict, torch.Tensor]]:
        """``decode_front`` of one chunk of each of several sessions (distinct
        ones, one group of ``decode_groups``) as one batch: per latent frame a
        header and the activation of every row, in order, on the host. The
        sessions' front cache slots change only once the last frame is made (a
        batch abandoned or failed part-way leaves them as they were)."""
        _distinct(sessions, "decode_fronts")
        with self._decode_stream(None):
            latents = [clean.to(self.device).float() for clean in cleans]
            if sessions[0].decoder != "full":  # one group: one decoder
                yield {"slot": WHOLE}, torch.cat(self._decode_rows(sessions, latents, as_pixels=True)).cpu()
                return
            for part in self.decoder.decode_front_rows(latents, [session.vae_cache for session in sessions], split):
                yield {"slot": part.slot}, part.activation.cpu()

    def back_rows(self, sessions: Sequence[CausalWanSession]) -> BackRows:
        """The back of a batch ``decode_fronts`` makes, for this rank's copies of its sessions."""
        _distinct(sessions, "back_rows")
        return BackRows(self, sessions)

    def frames_of(self, pixels: Sequence[torch.Tensor]) -> ChunkOutput:
        """A chunk's frames from its latent frames' ``decode_back`` pixels, in
        order (on the decode stream they were made on, so after them)."""
        with self._decode_stream(None):
            return _chunk_output(torch.cat(list(pixels), dim=2))

    # -- internals ---------------------------------------------------------------------

    def _decode_rows(
        self, sessions: Sequence[CausalWanSession], cleans: Sequence[torch.Tensor], as_pixels: bool = False
    ) -> list:
        """Each session's chunk (its clean latent in ``cleans``) through its
        decoder, those that agree in decoder, latent shape, cache shape and
        whether their stream has begun as one batch; the sessions' caches
        change only once every row is decoded. Each chunk's ``ChunkOutput``
        (``as_pixels``: its pixels)."""
        caches = [list(session.vae_cache) for session in sessions]  # filled here, kept once all decoded
        pixels: list[torch.Tensor | None] = [None] * len(sessions)
        for rows in self.decode_groups(sessions, cleans):
            latents = [cleans[row].float() for row in rows]
            first = not sessions[rows[0]].decoded_any
            decoder = self._decoder_of(sessions[rows[0]])
            decoded = decoder.decode_rows(latents, [caches[row] for row in rows], first=first)
            for row, frames in zip(rows, decoded, strict=True):
                pixels[row] = frames
        outputs = pixels if as_pixels else [_chunk_output(frames) for frames in pixels]
        for session, cache in zip(sessions, caches, strict=True):
            session.vae_cache[:] = cache
            session.decoded_any = True
        return outputs

    def _decoder_of(self, session: CausalWanSession):
        return self.decoders[session.decoder]

    def _pixels(self, session: CausalWanSession, clean: torch.Tensor) -> torch.Tensor:
        """The chunk's pixels through the session's decoder, which has then seen the stream begin."""
        pixels = self._decoder_of(session).decode(clean.float(), session.vae_cache, first=not session.decoded_any)
        session.decoded_any = True
        return pixels

    def _decode_clean(self, session: CausalWanSession, clean: torch.Tensor) -> ChunkOutput:
        return _chunk_output(self._pixels(session, clean))

    def _decode_stream(self, *committed: torch.cuda.Event | None) -> contextlib.AbstractContextManager:
        """On a GPU, a CUDA stream of the calling thread's own, waiting for the
        chunks' commits (``committed``, where they were recorded): the decode
        stage's kernels then overlap the next chunk's forward on the default
        stream. Elsewhere, nothing."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        streams = self.__dict__.setdefault("_decode_streams", {})  # per decoding thread
        stream = streams.get(threading.get_ident())
        if stream is None:
            stream = streams[threading.get_ident()] = torch.cuda.Stream(self.device)
        for event in committed:
            if event is not None:
                stream.wait_event(event)
        return torch.cuda.stream(stream)

    @property
    def decode_overlap_pays(self) -> bool:
        """On a GPU (the decode runs on a stream of its own); on a CPU the decode
        thread and the forward share the cores and the interpreter: measured on 2
        cores, 0.5x the frames per second at 64x64 and no gain at 256x256."""
        return self.device.type == "cuda"


class BackRows:
    """A batch of split chunks' back halves on the rank that finishes them: each
    latent frame's activation from ``decode_fronts`` through the back stages
    with a cache stacked from the sessions' back cache slots, then each
    session's frames. The sessions' caches change only at ``frames``. On a
    GPU all of it runs on the calling thread's decode stream, in order."""

    def __init__(self, pipeline: CausalWanDecoding, sessions: Sequence[CausalWanSession]) -> None:
        self._pipeline = pipeline
        self._sessions = list(sessions)
        with pipeline._decode_stream(None):  # checks their shapes
            self._work = pipeline.decoder.stacked([session.vae_cache for session in sessions])
        self._pixels: list[torch.Tensor] = []

    @torch.no_grad()
    def decode(self, header: dict, activation: torch.Tensor, split: int) -> None:
        """The back stages of the batch's next latent frame (``decode_fronts``' part)."""
        if activation.shape[0] != len(self._sessions):
            raise ValueError(f"a part of {activation.shape[0]} rows for a batch of {len(self._sessions)}")
        pipeline = self._pipeline
        with pipeline._decode_stream(None):
            if int(header["slot"]) == WHOLE:  # the rows' pixels were made in front
                self._pixels.append(activation.to(pipeline.device))
                return
            part = FrontPart(activation.to(pipeline.device), int(header["slot"]))
            self._pixels.append(pipeline.decoder.decode_back(part, self._work, split))

    def frames(self) -> list[ChunkOutput]:
        """Each session's chunk, in order; their back cache slots kept from here."""
        with self._pipeline._decode_stream(None):
            pixels = torch.cat(self._pixels, dim=2)
            outputs = [_chunk_output(row) for row in pixels.split(1)]
            self._pipeline.decoder.unstack(self._work, [session.vae_cache for session in self._sessions])
        return outputs


def _distinct(sessions: Sequence[CausalWanSession], method: str) -> None:
    """A batched decode takes one chunk of each session: ``ValueError`` for a
    session given twice."""
    if len({id(session) for session in sessions}) != len(sessions):
        raise ValueError(f"{method} takes one chunk of each session")


def _chunk_output(pixels: torch.Tensor) -> ChunkOutput:
    """Pixels in [-1, 1], ``[1, 3, frames, height, width]``, as uint8 RGB frames."""
    frames = ((pixels[0].permute(1, 2, 3, 0).float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    array = frames.cpu().numpy()  # waits for this stream's kernels
    count, height, width = array.shape[:3]
    return ChunkOutput(num_frames=count, width=width, height=height, payload=np.ascontiguousarray(array).tobytes())
