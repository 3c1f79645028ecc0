"""The request limits and vocabularies every process agrees on, in one place.

Pure constants. The API process's schema (``rtvideo.server.schemas``) builds its
field bounds from them and the worker's control plane checks the same values
(``rtvideo.engine.validation``), so a request the schema admits is never refused for
the same rule by the engine, and a change here changes both.
"""

from __future__ import annotations

MAX_PROMPT_CHARS = 4000
"""Longest prompt (and scheduled or interactive prompt), in characters."""

MAX_TRANSITION_CHUNKS = 64
"""Largest ``transition_chunks``: chunks over which a new prompt is blended in."""

MAX_INFERENCE_STEPS = 64
"""Most denoise steps per chunk a request may name; each pipeline's ``describe``
refuses more than it takes itself (causal Wan: 4)."""

MAX_SEED = 2**63 - 1
"""Largest ``seed`` (a non-negative 63-bit integer)."""

PROMPT_CHANGE_MODES = ("soft", "recache", "reset")
"""What a prompt change does to the model's cache: ``soft`` keeps it, ``recache``
re-encodes it under the new prompt, ``reset`` starts afresh."""

DECODERS = ("full", "tiny")
"""What makes a session's frames from its latents: the model's own VAE decoder,
or the tiny streaming decoder where its weights are loaded."""

INPUT_KINDS = ("video",)
"""What a session's ``input`` may be: a stream of video frames (video to video)."""

INPUT_FORMATS = ("jpeg", "raw")
"""How an input stream's frames travel: JPEG images, or raw uint8 RGB."""

MAX_INPUT_CHUNKS_AHEAD = 4
"""Video to video: the most chunks of input frames a session may have waiting for
their boundaries (the chunk about to begin and the three after it); frames
further ahead fail the session (``invalid_input``).

Why 4: a client of the engine needs no more. The API process hands a chunk's
frames at most two chunks ahead of the chunks made (``rtvideo.server.video_input``'s
``MAX_CHUNKS_AHEAD``: the one being made and the next, so the engine never
waits for frames the server holds), and a chunk begun (its boundary taken)
holds none: frames wait only for chunks not begun, so two would do; four
leaves room for a client that sends a little ahead. Every chunk waiting is
raw RGB in the worker's memory (at 832x480, 12 frames are 14 MiB): at the
earlier bound of 32 a session could park about 440 MiB there."""
