"""A token bucket: how often one realtime session may send interactions, and
how much text one realtime connection may send.

API process, pure (the caller passes the time). A bucket holds at most
``burst`` tokens and gains ``rate`` per second; each interaction takes one.
A session that sends faster than ``rate`` may do so for ``burst`` of them,
then each one more is refused until a token has grown back (``take`` says
how long that is). ``rtvideo.server.live_session`` keeps one per session, for all of
its controllers together (``max_interactions_per_s``, ``interaction_burst``);
``rtvideo.server.realtime`` one per connection, a token a character of text
(``limits.TEXT_CHARS_PER_S``, ``limits.TEXT_BURST_CHARS``).
"""

from __future__ import annotations


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        """Full at ``now`` (seconds, any monotonic clock)."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def take(self, now: float, amount: float = 1.0) -> float | None:
        """Take ``amount`` tokens (at most ``burst``) at ``now``: None when there
        were as many, else the seconds until there will be (nothing is taken then)."""
        if amount > self.burst:
            raise ValueError(f"cannot take {amount} tokens from a bucket of {self.burst}")
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
        self._at = max(self._at, now)
        if self._tokens >= amount - 1e-9:  # tokens grown back exactly by now, give or take rounding
            self._tokens = max(0.0, self._tokens - amount)
            return None
        return (amount - self._tokens) / self.rate
