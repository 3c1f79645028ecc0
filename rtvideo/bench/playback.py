"""The bundled page's playback buffer policy, mirrored, and a simulated player.

Pure Python, no I/O: ``rtvideo bench realtime`` (``rtvideo/bench/realtime.py``)
plays each of its sessions through ``SimulatedPlayer`` so that it can say what
a viewer of the page would see: key-to-pixel (a new prompt sent, to the first
frame of the chunk it applied at on screen) and underruns (playback that ran
out of media while the session went on).

``LeadPolicy`` is a copy of ``LeadPolicy`` in ``rtvideo/server/static/index.html``, the
one place the page keeps it: change both together
(``tests/unit/test_playback.py`` checks that the constants agree and that both
take the same decisions on the same events, in Chromium).

The policy. The server paces a session (``max_lead_seconds``): it begins a
chunk only while the media it generated is less than the budget ahead of the
playhead the client reports. A new prompt takes effect at the next chunk
begun, so it shows about the lead plus half a chunk after it is sent: the
smaller the lead, the sooner; too small and playback runs dry whenever a chunk
is late. So the lead starts at ``START_S``, grows by ``STEP_S`` after each
underrun (up to ``MAX_S``) and shrinks back by ``SHRINK_S`` after each
``CALM_S`` seconds of playback without one (never below ``START_S``). The
client asks for ``max_lead_seconds = START_S`` in ``session.start`` and
reports ``reported(position)``, its playhead plus what the lead has grown by,
every ``REPORT_EVERY_S``: the server, which begins a chunk only while it is
less than ``START_S`` ahead of the reported playhead, then runs the current
lead ahead of what is on screen, with no change to the protocol. (Reported
behind instead, a lead grown by ``START_S`` or more would hold the session
for good once the picture caught up: the server would wait for a playhead
past the end of the media it sent.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

START_S = 0.5  # the lead a session starts at, and the least it shrinks back to (seconds of media)
STEP_S = 0.25  # added after each underrun
MAX_S = 2.0  # the most it grows to (the server's default budget)
CALM_S = 15.0  # seconds of playback without an underrun before each shrink
SHRINK_S = 0.125  # taken off at each shrink
REPORT_EVERY_S = 0.25  # how often the playhead is reported (session.playback)

EPSILON_S = 1e-6  # media times closer than this are the same frame's


@dataclass
class LeadPolicy:
    """How far ahead of the picture generation may run; one per session.

    ``underrun()`` after each stall, ``played(seconds)`` as playback moves,
    ``reported(position)`` for each ``session.playback``. ``adaptive`` False
    keeps the lead at ``start_s`` (a fixed budget: ``bench realtime --max-lead S``)."""

    start_s: float = START_S
    adaptive: bool = True
    lead_s: float = field(init=False)
    calm_s: float = field(init=False, default=0.0)
    underruns: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.start_s > 0:
            raise ValueError(f"the lead must be > 0 seconds, got {self.start_s}")
        self.lead_s = self.start_s

    def underrun(self) -> None:
        """Playback ran dry while the session went on: grow the lead."""
        self.underruns += 1
        self.calm_s = 0.0
        if self.adaptive:
            self.lead_s = min(MAX_S, self.lead_s + STEP_S)

    def played(self, seconds: float) -> None:
        """``seconds`` of media played without a stall: after ``CALM_S`` of them, shrink."""
        self.calm_s += seconds
        if self.calm_s >= CALM_S and self.lead_s > self.start_s:
            self.calm_s = 0.0
            self.lead_s = max(self.start_s, self.lead_s - SHRINK_S)

    def reported(self, position: float) -> float:
        """The ``position_seconds`` to report for a playhead at ``position``: ahead
        of it by what the lead grew by, so a server paced at ``start_s`` runs ``lead_s`` ahead."""
        return position + (self.lead_s - self.start_s)


@dataclass
class _Watch:
    media_s: float  # the frame to see
    since: float  # wall time it was asked for (the send)
    shown: float | None = None  # wall time that frame was on screen


class SimulatedPlayer:
    """A viewer's playhead, in wall-clock seconds (any monotonic clock).

    Playback starts with the first media, moves at real time while media is
    buffered ahead of it, stops when it catches up with what was received
    (an underrun, unless the session ended: then it has simply played
    everything) and resumes as soon as more arrives, as a browser's media
    element does. Call ``received`` with each chunk's end, ``advance`` whenever
    the time matters (before reading ``position``), ``watch`` for each frame
    whose display time is wanted and ``finish`` once the session is over."""

    def __init__(self, policy: LeadPolicy) -> None:
        self.policy = policy
        self.position = 0.0  # media seconds played
        self.received_end = 0.0  # media seconds received
        self.clock: float | None = None  # wall time ``position`` was last brought up to date; None: not started
        self.stalled = False
        self.ended = False
        self.stalled_s = 0.0  # wall seconds spent stalled
        self._stalled_at = 0.0
        self._watches: list[_Watch] = []

    @property
    def started(self) -> bool:
        return self.clock is not None

    def received(self, now: float, end_s: float) -> None:
        """Media up to ``end_s`` (seconds) arrived at ``now``."""
        self.advance(now)
        self.received_end = max(self.received_end, end_s)
        if self.clock is None:
            self.clock = now
        elif self.stalled and self.received_end > self.position + EPSILON_S:
            self.stalled = False
            self.stalled_s += now - self._stalled_at
            self.clock = now
        self._show(now, self.position, self.position)

    def advance(self, now: float) -> None:
        """Play from the last update to ``now``."""
        if self.clock is None or self.stalled or now <= self.clock:
            return
        begin, at = self.position, self.clock
        step = min(now - at, max(0.0, self.received_end - begin))
        self.position = begin + step
        self.clock = now
        self.policy.played(step)
        self._show(at, begin, self.position)
        if step < now - at and not self.ended:
            self.stalled = True
            self._stalled_at = at + step
            self.policy.underrun()

    def watch(self, media_s: float, since: float) -> None:
        """Note the wall time the frame at ``media_s`` reaches the screen; ``since``: when it was asked for."""
        self._watches.append(_Watch(media_s, since))
        if self.clock is not None and not self.stalled:
            self._show(self.clock, self.position, self.position)

    def finish(self, now: float) -> None:
        """The session ended at ``now``: what was received plays out, with no more underruns."""
        self.advance(now)
        self.ended = True
        if self.clock is None:
            return
        if self.stalled:
            self.stalled = False
            self.stalled_s += now - self._stalled_at
            self.clock = now
        end = self.clock + (self.received_end - self.position)
        self.advance(end)

    def shown_after(self) -> list[float]:
        """Seconds from each watch's ``since`` to its frame on screen, for those shown."""
        return [w.shown - w.since for w in self._watches if w.shown is not None]

    def _show(self, at: float, begin: float, end: float) -> None:
        """Playback ran from media ``begin`` at wall ``at`` to media ``end`` (at real
        time): a watched frame in that span, and received, was on screen then."""
        for w in self._watches:
            if w.shown is None and w.media_s <= end + EPSILON_S and w.media_s < self.received_end - EPSILON_S:
                w.shown = max(w.since, at + max(0.0, w.media_s - begin))
