"""The learning rate, read from the optimizer's param groups at each monitored step, judged like a norm.

A schedule changes the LR smoothly: linear or exponential warm-up (the step-to-step ratio falls or stays
put), cosine, linear or step decay (the ratio is <= 1). A learning rate multiplied by 100 mid-run is a
ratio no schedule makes. Per param group, r = ln(lr / previous lr) is reported when it exceeds
``ln(1 + threshold)`` and the median of the group's recent ratios by more than ``OWN_SIGMAS`` x their
robust noise. A zero LR (the first step of a warm-up from 0) is skipped. Only increases are reported;
a schedule with warm restarts is reported at each restart.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from msprobe_core.monitor.rules.robust import mad_sigma, median
from msprobe_core.monitor.rules.turbulence import OWN_SIGMAS

MIN_RATIOS = 2
"""Ratios of a group seen before its LR is judged (a warm-up's first ratios are the largest)."""


@dataclass(frozen=True)
class LRJump:
    """Param group ``group``'s LR jumped from ``previous`` to ``value``."""

    group: int
    value: float
    previous: float


class LearningRateRule:
    """Keeps each param group's recent LR ratios."""

    def __init__(self, threshold: float, window: int):
        self.floor = math.log1p(threshold)
        self.window = window
        self._last: dict[int, float] = {}
        self._ratios: dict[int, deque] = {}

    def check(self, lrs: Sequence[float]) -> list[LRJump]:
        found: list[LRJump] = []
        for group, lr in enumerate(lrs):
            if not (isinstance(lr, (int, float)) and 0.0 < lr < math.inf):
                continue
            prev = self._last.get(group)
            self._last[group] = float(lr)
            if prev is None:
                continue
            r = math.log(lr / prev)
            ratios = self._ratios.setdefault(group, deque(maxlen=self.window))
            if len(ratios) >= MIN_RATIOS:
                center = median(ratios)
                if r > self.floor and r - center > OWN_SIGMAS * mad_sigma(ratios, center):
                    found.append(LRJump(group, float(lr), prev))
                    r = center  # the new LR is the schedule's from now on; its ratio is not the schedule's
            ratios.append(r)
        return found


def learning_rates(optimizer: Any) -> list[float]:
    """The ``lr`` of each of ``optimizer``'s param groups (NaN where it is missing or lives on an
    accelerator: reading it there would synchronise the device)."""
    out: list[float] = []
    for group in getattr(optimizer, "param_groups", None) or []:
        lr = group.get("lr") if isinstance(group, Mapping) else None
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            out.append(float(lr))
        elif getattr(getattr(lr, "device", None), "type", None) == "cpu" and getattr(lr, "numel", lambda: 0)() == 1:
            out.append(float(lr))
        else:
            out.append(math.nan)
    return out
