"""Summary statistics shared by the ``rtvideo bench`` commands."""

from __future__ import annotations

import statistics


def percentiles(values: list[float]) -> dict[str, float]:
    """min, p50, p95, p99, max and mean of ``values`` (nearest rank); {} when empty."""
    ordered = sorted(values)
    if not ordered:
        return {}

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "min": ordered[0],
        "p50": pick(0.5),
        "p95": pick(0.95),
        "p99": pick(0.99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }
