"""Verdicts: when a compared tensor passes, warns or fails.

Tensor dumps (task ``tensor``), per tensor, from the saved files:

* **error** when the maximum absolute error is above ``max_abs`` (0.001) *and* either the cosine
  similarity is below ``cosine`` (0.99) -- the rule of ptdbg's compare guide (seed 004) for the first
  diverging API -- or the L2 norms differ by more than ``rel_error`` (0.1) relatively, which catches
  what cosine cannot see: a tensor scaled by a wrong factor. Also an error: different shapes, or
  NaN/Inf at different positions.
* **warning** when only some of these conditions hold, or the dtypes differ.
* **pass** otherwise.

Statistics dumps (task ``statistics``; also a tensor dump compared with a statistics dump), per tensor,
from Max/Min/Mean/Norm in dump.json. A statistic *moves* when its absolute difference is above
``max_abs`` (0.001; a difference of Max, Min or Mean is a lower bound of the maximum absolute error) and
its relative difference ``|target - golden| / |golden|`` is above a threshold:

* **error** when Max, Min or Norm moves by more than ``rel_error`` (0.1, about the relative L2
  error at which the cosine similarity drops under 0.99); or the shapes differ; or a statistic is
  NaN/Inf on one side only; or, with ``summary_mode: md5``, the CRC-32 digests differ (the tensors are
  not bitwise equal).
* **warning** when any of the four moves by more than ``rel_warning`` (0.01), or the dtypes differ.
  (Mean is never an error on its own: the mean of a tensor centred on zero moves a lot for nothing.)
* **pass** otherwise.

Plain values (ints, floats, strings... passed to an API) that differ, leaves present on one side
only, and a tensor facing a non-tensor are warnings. Records present in one run only are
**unmatched**: listed, but not a divergence. A record's verdict is its worst leaf's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

PASS, WARNING, ERROR, UNMATCHED = "pass", "warning", "error", "unmatched"
SEVERITY = {PASS: 0, UNMATCHED: 0, WARNING: 1, ERROR: 2}
STAT_KEYS = ("Max", "Min", "Mean", "Norm")
ERROR_STATS = ("Max", "Min", "Norm")


def worst(*verdicts: str) -> str:
    """The most severe of ``verdicts`` (pass < warning < error)."""
    return max(verdicts, key=lambda v: SEVERITY.get(v, 0), default=PASS)


@dataclass(frozen=True)
class Thresholds:
    """The numbers behind every verdict; see the module docstring for the rules."""

    cosine: float = 0.99
    max_abs: float = 0.001
    rel_error: float = 0.1
    rel_warning: float = 0.01

    def tensor_verdict(self, cosine: Optional[float], max_abs: Optional[float],
                       norm_rel: Optional[float] = None) -> tuple[str, list[str]]:
        """Verdict from the cosine similarity, maximum absolute error and relative difference of the L2
        norms of two equal-shape tensors.

        ``cosine`` None means it is undefined (one tensor is all zeros), which counts as below the bar.
        """
        shape_off = []
        if cosine is None:
            shape_off.append("undefined cosine (one side is all zeros)")
        elif math.isnan(cosine) or cosine < self.cosine:
            shape_off.append(f"cosine {cosine:.6g} < {self.cosine:g}")
        if norm_rel is not None and norm_rel > self.rel_error:
            shape_off.append(f"norms differ by {_pct(norm_rel)} > {_pct(self.rel_error)}")
        big_abs = max_abs is not None and (math.isnan(max_abs) or max_abs > self.max_abs)
        messages = shape_off + ([f"max abs error {max_abs:.6g} > {self.max_abs:g}"] if big_abs else [])
        if shape_off and big_abs:
            return ERROR, [" and ".join(messages)]
        return (WARNING, messages) if messages else (PASS, [])

    def stat_verdict(self, diffs: Mapping[str, tuple[float, float]]) -> tuple[str, list[str]]:
        """Verdict from ``{stat: (abs diff, rel diff)}`` of finite statistics."""
        verdict, messages = PASS, []
        for key, (abs_diff, rel_diff) in diffs.items():
            if abs_diff <= self.max_abs:
                continue
            if key in ERROR_STATS and rel_diff > self.rel_error:
                verdict = ERROR
                messages.append(f"{key} differs by {_pct(rel_diff)} > {_pct(self.rel_error)}")
            elif rel_diff > self.rel_warning:
                verdict = worst(verdict, WARNING)
                messages.append(f"{key} differs by {_pct(rel_diff)} > {_pct(self.rel_warning)}")
        return verdict, messages

    def describe(self) -> str:
        """One line naming the thresholds in use, for the terminal summary."""
        return (f"error = max abs error > {self.max_abs:g} and (cosine < {self.cosine:g} or norms differ by "
                f"> {_pct(self.rel_error)}) for tensors; Max/Min/Norm differ by > {_pct(self.rel_error)} and "
                f"> {self.max_abs:g} for statistics")


def _pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x * 100:.3g}%"
