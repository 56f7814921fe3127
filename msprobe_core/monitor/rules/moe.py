"""Mixture-of-experts alert rules over each step's router health (host numbers, no torch).

* ``ExpertStarvation``: an expert's share of the routed tokens stayed below ``share`` x its fair share
  (1 / num_experts) for ``steps`` monitored steps in a row. Reported once until the expert recovers.
* ``ImbalanceJump``: the load's max/mean rose above (1 + ``threshold``) x its median over the last
  ``window`` steps (judged after ``warmup`` steps); names the most loaded expert.
* ``EntropyCollapse``: the mean per-token router entropy fell below ``ratio`` x its median over the last
  ``window`` steps (after ``warmup``); names the most loaded expert.

Each anomaly's ``kind`` is ``router``, its ``name`` ``{router module}.{expert}``, its ``module`` the router.
A jump or collapse is reported once until the value is back within bounds; values judged anomalous do not
enter the median. What the rules find is grouped into events by the rank's ``EventTracker`` like every other
rule's anomalies (a starvation right after another event's jumps joins that event as a consequence).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from msprobe_core.monitor.anomaly import Anomaly
from msprobe_core.monitor.moe.config import ENTROPY_RULE, IMBALANCE_RULE, STARVATION_RULE, MoERuleConfig
from msprobe_core.monitor.moe.routers import RouterStep
from msprobe_core.monitor.records import STAGE_FORWARD
from msprobe_core.monitor.rules.robust import median

ROUTER_KIND = "router"


class MoERules:
    """The configured MoE rules of one rank, with their per-layer state."""

    def __init__(self, rules: Sequence[MoERuleConfig], pp_stage: int = 0):
        self.rules = {r.rule: r for r in rules}
        self.pp_stage = pp_stage
        self._below: dict[tuple[str, int], int] = {}
        self._starved: set[tuple[str, int]] = set()
        self._history: dict[tuple[str, str], deque[float]] = {}
        self._open: set[tuple[str, str]] = set()

    def __bool__(self) -> bool:
        return bool(self.rules)

    def judge(self, rank: int, step: int, routers: Sequence[RouterStep]) -> list[Anomaly]:
        """The anomalies opened at this step (in router order)."""
        found: list[Anomaly] = []
        for r in routers:
            total = sum(r.load)
            if total <= 0:
                continue
            busiest = max(range(r.num_experts), key=r.load.__getitem__)

            def anomaly(expert: int, metric: str, value: float, baseline: float, rule: str) -> Anomaly:
                return Anomaly(rank, step, None, STAGE_FORWARD, 0, ROUTER_KIND, f"{r.layer}.{expert}", r.layer,
                               metric, value, baseline, rule, self.pp_stage)

            starve = self.rules.get(STARVATION_RULE)
            if starve is not None:
                limit = starve.share / r.num_experts
                for e, v in enumerate(r.load):
                    key = (r.layer, e)
                    share = v / total
                    if share >= limit:
                        self._below.pop(key, None)
                        self._starved.discard(key)
                        continue
                    n = self._below[key] = self._below.get(key, 0) + 1
                    if n >= starve.steps and key not in self._starved:
                        self._starved.add(key)
                        found.append(anomaly(e, "load_share", share, limit, STARVATION_RULE))
            jump = self.rules.get(IMBALANCE_RULE)
            if jump is not None:
                hit = self._judge_series(r.layer, "imbalance_max_mean", r.max_mean, jump,
                                         lambda v, m: v > (1 + jump.threshold) * m)
                if hit is not None:
                    found.append(anomaly(busiest, "imbalance_max_mean", r.max_mean, hit, IMBALANCE_RULE))
            collapse = self.rules.get(ENTROPY_RULE)
            if collapse is not None and r.entropy is not None:
                hit = self._judge_series(r.layer, "entropy", r.entropy, collapse, lambda v, m: v < collapse.ratio * m)
                if hit is not None:
                    found.append(anomaly(busiest, "entropy", r.entropy, hit, ENTROPY_RULE))
        return found

    def _judge_series(self, layer: str, metric: str, value: float, rule: MoERuleConfig, bad) -> float | None:
        """The median ``value`` broke away from (once per excursion), or None; normal values join the window."""
        key = (layer, metric)
        hist = self._history.setdefault(key, deque(maxlen=rule.window))
        if len(hist) >= rule.warmup:
            m = median(list(hist))
            if bad(value, m):
                if key in self._open:
                    return None
                self._open.add(key)
                return m
        self._open.discard(key)
        hist.append(value)
        return None
