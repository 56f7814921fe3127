"""Anomalies: what the monitor's rules report, and the order they are listed in (no torch).

An ``Anomaly`` is one event: the first anomalous tensor of a fault (its origin: rank, step, micro-batch,
stage, call order, module/parameter, metric, value and baseline) and how far the fault reached (``reached``
tensors, until ``last_step``). The rules are in ``msprobe_core.monitor.rules``, the grouping into events
in ``msprobe_core.monitor.events``, and ``AnomalyDetector`` (``msprobe_core.monitor.detector``) runs them over a step's host-side rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from msprobe_core.monitor.moe.config import BELOW_RULES
from msprobe_core.monitor.records import STAGE_BACKWARD, STAGE_FORWARD, STAGE_GRADIENT, STAGE_OPTIMIZER, STAGE_PARAM

NAN_RULE = "AnomalyNan"
TURBULENCE_RULE = "AnomalyTurbulence"
LR_KIND = "lr"
"""The kind of an anomaly about an optimizer param group's learning rate (name ``optimizer.param_groups.N.lr``)."""


@dataclass(frozen=True)
class Anomaly:
    """One anomaly: where (rank, step, micro_step, stage, call order, module/parameter), what and how far."""

    rank: int
    step: int
    micro_step: int | None
    stage: str
    call_id: int
    kind: str
    name: str
    module: str
    metric: str
    value: float
    baseline: float | None
    rule: str
    pp_stage: int = 0
    event: int = 0
    """The event's number on its rank (0, 1, ...)."""
    reached: int = field(default=1, compare=False)
    """Distinct tensors (kind and name) the fault reached so far, the origin included (progress of the
    event, so not part of its identity: the callback's copy equals the later, grown one)."""
    last_step: int | None = field(default=None, compare=False)
    """The last step the fault was seen at (NaN still there, or more jumps in the following step)."""
    capture: str | None = field(default=None, compare=False)
    """The dump folder (``dump.json``) of the evidence captured after it (``on_anomaly.dump``), or None."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("value", "baseline"):
            v = d[key]
            if isinstance(v, float) and not math.isfinite(v):
                d[key] = str(v)  # JSON has no NaN/Inf; keep them readable and round-trippable
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Anomaly":
        values = dict(d)
        for key in ("value", "baseline"):
            if isinstance(values.get(key), str):
                values[key] = float(values[key])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in values.items() if k in known})

    def describe(self) -> str:
        """One log line."""
        micro = f" micro {self.micro_step}" if self.micro_step is not None else ""
        if self.rule == TURBULENCE_RULE and self.baseline is not None:
            how = f"{self.metric}={self.value:.6g}, was {self.baseline:.6g}"
        elif self.baseline is not None:
            side = "below" if self.rule in BELOW_RULES else "above"
            how = f"{self.metric}={self.value:.6g} {side} {self.baseline:.6g}"
        else:
            how = f"{self.metric}={self.value:.6g}"
        spread = ""
        if self.reached > 1:
            later = self.last_step is not None and self.last_step != self.step
            until = f" through step {self.last_step}" if later else ""
            spread = f"; reached {self.reached} tensors{until}"
        evidence = f"; evidence: {self.capture}" if self.capture else ""
        return (f"anomaly rank {self.rank} step {self.step}{micro} [{self.stage} #{self.call_id}] "
                f"{self.kind} {self.name}: {how} ({self.rule}{spread}){evidence}")


_STAGE_RANK = {STAGE_PARAM: 0, STAGE_FORWARD: 1, STAGE_BACKWARD: 1, STAGE_GRADIENT: 2, STAGE_OPTIMIZER: 3}


def order_key(a: Anomaly) -> tuple:
    """Sort key that puts anomalies in the order the data was produced, across ranks.

    step, then: the weights used by the step; per micro-batch its forward then its backward; the
    accumulated gradients; the optimizer state. Pipeline stages run forward in ascending and backward
    in descending order; inside a rank and stage the monitor's call order decides; the rank breaks ties.
    """
    rank = _STAGE_RANK.get(a.stage, 4)
    micro = a.micro_step if a.micro_step is not None else 0
    backward = a.stage in (STAGE_BACKWARD, STAGE_GRADIENT)
    return (a.step, rank, micro if rank == 1 else 0, 1 if a.stage == STAGE_BACKWARD else 0,
            -a.pp_stage if backward else a.pp_stage, a.call_id, a.rank)
