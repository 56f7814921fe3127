"""Robust statistics of short series (pure Python: the windows hold a few dozen numbers).

``median`` and ``mad_sigma`` (the median absolute deviation scaled to a normal standard deviation) ignore
the outliers a mean and a standard deviation would chase; ``upper_quantile`` reads a tail.
"""

from __future__ import annotations

from typing import Iterable, Sequence

MAD_TO_SIGMA = 1.4826
"""MAD x this estimates the standard deviation of normally distributed values."""


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def mad_sigma(values: Sequence[float], center: float) -> float:
    """``MAD_TO_SIGMA`` x the median absolute deviation of ``values`` from ``center``."""
    return MAD_TO_SIGMA * median([abs(v - center) for v in values])


def upper_quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 < q < 1) of ``values`` (at least one), by linear interpolation."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
