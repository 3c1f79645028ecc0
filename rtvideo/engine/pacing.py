"""Pacing: a session never gets more than its lead budget ahead of its viewer.

Policy only (loop thread of worker rank 0). A session between chunks may
begin its next chunk only while the media it has generated is less than
``max_lead_seconds`` ahead of the client's playhead; so the lead never
exceeds the budget by more than one chunk, and a new prompt becomes
*visible* within about lead + one chunk, not only generated.

The playhead is the last ``Playback`` position the client reported; a client
that never reports one is assumed to play in real time from the moment the
first chunk was emitted. Apart from that budget, a session never gets more
than ``max_undelivered_seconds`` of media ahead of what was written to its
client's socket (``Delivered``, reported by the API process): a client that
stops reading holds its session's generation, paced or not, and the server
buffers a bounded amount for it. And a session never begins a chunk while
``max_chunks_decoding`` of its chunks are committed and not yet decoded: where
denoising outruns the decode (a request-mode job, which nothing else paces, on
a machine whose decode is most of a chunk), the chunks waiting for the decode
stage, their latents and the frames queued for it on another rank stay
bounded, however long the session runs. A session that waits is simply not
scheduled: other sessions run, and control (interactions, stops, pings) stays
live because it never waits for the loop.
"""

from __future__ import annotations

from typing import NamedTuple

from rtvideo.engine.session import EngineSession, Phase

EPSILON_S = 1e-3  # wake a little after the lead drops under budget, not a little before


class Playhead(NamedTuple):
    """What the engine knows of where a session's media has got to."""

    reported: float | None  # the client's last reported playhead (Playback)
    delivered: float | None  # media written to its socket (Delivered, from the API process)


def playhead_seconds(session: EngineSession, reported: float | None, now: float) -> float:
    """Where the viewer is: the last report, else real time since the first chunk."""
    if reported is not None:
        return reported
    if session.first_emit_at is None:
        return 0.0
    return now - session.first_emit_at


def lead_seconds(session: EngineSession, reported: float | None, now: float) -> float:
    """Media generated ahead of the playhead (the chunks under way counted as made)."""
    return session.media_seconds_begun - playhead_seconds(session, reported, now)


DECODE_RUN_AHEAD = 16
"""How many chunks a session's denoising may run ahead of its decodes. A
short job never waits: its chunks denoise at full speed while the decodes
catch up, and on a CPU the ranks' forwards and the decodes then run at
different moments rather than fighting for the cores. A bound of 2 cost
about a fifth of two ranks' frames per second with four 24-chunk sessions.
A long job stays bounded: each waiting chunk is one latent, 1.2 MB at Wan's
832x480."""


def max_chunks_decoding(session: EngineSession) -> int:
    """The committed chunks of ``session`` the decode stage may hold before its
    next chunk waits: ``DECODE_RUN_AHEAD``, plus the chunks the session may have
    in flight (``lookahead``: 1 exact, more with stream batch, whose chunks can
    commit one right after another)."""
    return session.lookahead + DECODE_RUN_AHEAD


def wait_seconds(
    session: EngineSession,
    reported: float | None,
    now: float,
    delivered: float | None = None,
    begins: bool | None = None,
) -> float | None:
    """0 when the session may run now; else seconds until it may (the real-time
    estimate catches up), or None when only a new report can free it: a playback
    report, or a delivery report when the media not yet written to the client's
    socket reaches ``max_undelivered_seconds`` (transport backpressure, whatever
    the pacing budget), or a decode result when ``max_chunks_decoding`` of its
    chunks wait for the decode stage (decode backpressure). Only a session whose
    next pass would begin a chunk is ever held (``begins``; None: it sits
    between chunks), never one in the middle of a chunk; media of the chunks
    under way counts as made."""
    if not (session.phase is Phase.BOUNDARY if begins is None else begins):
        return 0.0
    if len(session.decoding) >= max_chunks_decoding(session):
        return None
    undelivered = session.max_undelivered_seconds
    if delivered is not None and undelivered is not None and session.media_seconds_begun - delivered >= undelivered:
        return None
    budget = session.max_lead_seconds
    if budget is None:
        return 0.0
    excess = lead_seconds(session, reported, now) - budget
    if excess < 0:
        return 0.0
    if reported is not None:
        return None
    return excess + EPSILON_S
