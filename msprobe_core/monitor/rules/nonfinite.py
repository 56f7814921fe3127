"""``AnomalyNan``: NaN and Inf, judged by where the tensor comes from.

* A tensor the model computed from its weights (an activation that requires grad, a weight, a gradient,
  an optimizer state) is bad when it holds a NaN, an Inf, or values so large that its norm or mean
  overflows float32 (|x| beyond ~1e19), and, with the rule's ``threshold``, when |min|, |max|, |norm| or
  |mean| exceeds it.
* A tensor the model did not compute (``MetricRow.external``: an input batch, an attention mask, a
  constant) is bad only when it holds a NaN. -inf (``generate_square_subsequent_mask``) and +inf are what a
  mask means, and a ``finfo.min`` mask has a norm that overflows float32 without holding an Inf. If such a
  value reaches the model's computation, the first module that computes a non-finite value is reported.

NaN is read from the ``nans`` count when collected, else from min/max (both propagate NaN), else from
norm/mean. Inf is read from min/max when collected, else from norm/mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from msprobe_core.monitor.records import MetricRow


@dataclass(frozen=True)
class Finding:
    """Why a row is bad: the metric that shows it, its value, and the limit it crossed (None for NaN/Inf)."""

    metric: str
    value: float
    limit: float | None = None


class NonFiniteRule:
    """Finds NaN/Inf (and values above the optional threshold) in one row."""

    def __init__(self, ops: Sequence[str], threshold: float | None):
        col: Mapping[str, int] = {op: i for i, op in enumerate(ops)}
        self._nans = col.get("nans")
        self._extremes = [(op, col[op]) for op in ("min", "max") if op in col]
        self._sums = [(op, col[op]) for op in ("norm", "mean") if op in col]
        self._all = self._extremes + self._sums
        self._threshold = threshold

    def check(self, row: MetricRow) -> Finding | None:
        """The finding that makes ``row`` bad, or None."""
        values = row.values
        if self._nans is not None:
            if values[self._nans] > 0:
                return Finding("nans", values[self._nans])
        else:
            for op, c in self._extremes or self._sums:
                if math.isnan(values[c]):
                    return Finding(op, values[c])
        if row.external:
            return None
        for op, c in self._all:
            if not math.isfinite(values[c]):  # an Inf, or (norm, mean) a float32 overflow of huge values
                return Finding(op, values[c])
        if self._threshold is not None:
            for op, c in self._all:
                if abs(values[c]) > self._threshold:
                    return Finding(op, values[c], self._threshold)
        return None
