"""``Windows``: the recent levels of many series at once (numpy), so a step's medians are one vectorised call.

Each series (any hashable key) owns a row of ``window`` slots, oldest first: a row holding ``count`` levels
has them in its last ``count`` slots (the others are NaN). A step pushes one level per series it saw.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from msprobe_core.monitor.rules.robust import MAD_TO_SIGMA


class Windows:
    """Recent levels of many series: rows of a NaN-padded [series, window] array."""

    def __init__(self, window: int):
        self.window = window
        self._index: dict[Hashable, int] = {}
        self.levels = np.full((0, window), np.nan)
        self.count = np.zeros(0, dtype=np.int64)
        """Levels stored per series (at most ``window``)."""
        self.last = np.full(0, np.nan)
        """The last raw value pushed per series (NaN before the first)."""

    def rows(self, keys: Sequence[Hashable]) -> np.ndarray:
        """The row of each key (distinct keys), adding rows for keys not seen before."""
        index = self._index
        out = np.empty(len(keys), dtype=np.int64)
        for i, key in enumerate(keys):
            r = index.get(key)
            if r is None:
                r = index[key] = len(index)
            out[i] = r
        grow = len(index) - len(self.count)
        if grow > 0:
            self.levels = np.vstack([self.levels, np.full((grow, self.window), np.nan)])
            self.count = np.concatenate([self.count, np.zeros(grow, dtype=np.int64)])
            self.last = np.concatenate([self.last, np.full(grow, np.nan)])
        return out

    def medians(self, rows: np.ndarray) -> np.ndarray:
        """The median level of each row (rows that hold at least one level): one sort per fill count."""
        if not len(rows):
            return np.empty(0)
        counts = self.count[rows]
        first = int(counts[0])
        if (counts == first).all():  # the usual case: every series seen as often
            return row_medians(self.levels[rows, self.window - first:])
        out = np.empty(len(rows))
        for c in np.unique(counts):
            same = counts == c
            out[same] = row_medians(self.levels[rows[same], self.window - int(c):])
        return out

    def filled(self, row: int) -> np.ndarray:
        """One row's levels, oldest first."""
        return self.levels[row, self.window - int(self.count[row]):]

    def sigma(self, row: int, center: float) -> float:
        """Robust standard deviation (1.4826 x MAD around ``center``) of one row's levels."""
        return float(MAD_TO_SIGMA * np.median(np.abs(self.filled(row) - center)))

    def sigmas(self, rows: np.ndarray, centers: np.ndarray) -> np.ndarray:
        """``sigma`` of many rows at once (distinct rows, each holding at least one level)."""
        out = np.empty(len(rows))
        counts = self.count[rows]
        for c in np.unique(counts):
            same = counts == c
            dev = np.abs(self.levels[rows[same], self.window - int(c):] - centers[same, None])
            out[same] = MAD_TO_SIGMA * row_medians(dev)
        return out

    def typical_step(self, row: int) -> float:
        """The median step-to-step change of one row's levels (0 with fewer than two)."""
        filled = self.filled(row)
        return float(np.median(np.diff(filled))) if len(filled) > 1 else 0.0

    def largest_step(self, rows: np.ndarray) -> float:
        """The largest step-to-step change, less its series' typical step, over the windows of ``rows``
        (0 when none holds two levels): how far any of these series has moved in one step lately."""
        steps = np.diff(self.levels[rows], axis=1)
        held = ~np.isnan(steps)
        if not held.any():
            return 0.0
        steps = steps[held.any(axis=1)]
        return float(np.nanmax(np.abs(steps - np.nanmedian(steps, axis=1, keepdims=True))))

    def shift(self, row: int, by: float) -> None:
        """Move one row's levels by ``by`` (a series re-based after a jump)."""
        self.levels[row] += by

    def push(self, rows: np.ndarray, levels: np.ndarray, raw: np.ndarray | None = None) -> None:
        """Append one level per row (distinct rows); ``raw`` becomes ``last``."""
        if not len(rows):
            return
        self.levels[rows, :-1] = self.levels[rows, 1:]
        self.levels[rows, -1] = levels
        self.count[rows] = np.minimum(self.count[rows] + 1, self.window)
        if raw is not None:
            self.last[rows] = raw


def row_medians(a: np.ndarray) -> np.ndarray:
    """The median of each row of a 2-D array (short rows: a sort is cheaper than ``np.median``'s machinery)."""
    s = np.sort(a, axis=1)
    n = s.shape[1]
    return s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])


def sorted_quantile(s: np.ndarray, q: float) -> float:
    """The ``q`` quantile of an ascending, non-empty array (linear interpolation, as ``np.quantile``)."""
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))
