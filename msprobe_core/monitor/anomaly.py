"""Anomaly rules: NaN/Inf (always on when alerts are on) and AnomalyTurbulence, tuned to stay quiet.

``AnomalyDetector.check(rank, step, rows)`` looks at one step's host-side rows and returns the new
anomalies in call order. It never sees tensors and never touches a device.

Why it does not cry wolf (msprobe raised over a thousand alerts on a healthy 5-step run):

* **Warm-up.** A series (kind, name, metric) is only judged after it was seen on ``warmup`` steps
  (default 5).
* **Missing is not NaN.** Tensors without a gradient produce no row at all, so nothing to flag.
* **A jump, not a trend.** The running average is a geometric one: an exponential average of
  log|value| (``beta``, default 0.6). A value is turbulent when |value| > (1 + threshold) x that
  average *and* its log exceeds the average by more than ``JITTER_FACTOR`` times the series' typical
  step-to-step change of log|value|. Steady growth (a norm growing some percent every step) and noise
  around zero (the mean of a zero-centred gradient) never alert; a x50 spike does. Zeros are skipped.
* **Gradients, not their averages.** By default the rule judges ``actv``, ``actv_grad``, ``grad`` and
  ``param`` (rule argument ``kinds``). Adam's moments are exponential averages of the gradients, so
  a spike shows at the gradient first, and in the first ~1/(1 - beta2) steps the raw moments grow by
  construction (they carry no bias correction). NaN/Inf is checked on every kind.
* **Means must matter.** A mean is judged only when it is a material part of the tensor's magnitude
  (|mean| >= ``MEAN_MATERIAL`` x RMS, with RMS = norm / sqrt(numel), when ``norm`` is collected):
  the mean of a zero-centred gradient is sign noise, not a signal.
* **No repeats.** A series that stays NaN (or above the NaN rule's threshold) is reported once, when it
  turns bad, not every step after; after a jump the running average restarts at the new value, so a
  lasting shift (a weight multiplied by 50) is reported once too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from msprobe_core.monitor.config import AlertConfig
from msprobe_core.monitor.records import (STAGE_BACKWARD, STAGE_FORWARD, STAGE_GRADIENT, STAGE_OPTIMIZER,
                                          STAGE_PARAM, MetricRow)

JITTER_FACTOR = 3.0
"""A turbulent value exceeds its running average by more than this many typical step-to-step changes."""
MEAN_MATERIAL = 0.1
"""A mean is judged only when |mean| >= this share of the tensor's RMS."""
_JITTER_WINDOW = 10
NAN_RULE = "AnomalyNan"
TURBULENCE_RULE = "AnomalyTurbulence"


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
            how = f"{self.metric}={self.value:.6g} > running avg {self.baseline:.6g}"
        elif self.baseline is not None:
            how = f"{self.metric}={self.value:.6g} above {self.baseline:.6g}"
        else:
            how = f"{self.metric}={self.value:.6g}"
        return (f"anomaly rank {self.rank} step {self.step}{micro} [{self.stage} #{self.call_id}] "
                f"{self.kind} {self.name}: {how} ({self.rule})")


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


@dataclass
class _Series:
    level: float = 0.0
    jitter: float = 0.0
    prev: float = 0.0
    count: int = 0
    diffs: int = 0
    steps: int = 0
    last_step: int | None = None


@dataclass
class AnomalyDetector:
    """Stateful rules over a run's host-side rows. One detector per rank."""

    alert: AlertConfig
    ops: Sequence[str]
    pp_stage: int = 0
    _series: dict[tuple[str, str, str], _Series] = field(default_factory=dict)
    _bad: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._col = {op: i for i, op in enumerate(self.ops)}
        turb = self.alert.turbulence
        self._turb_cols = [(m, self._col[m]) for m in (turb.metrics if turb else ()) if m in self._col]
        self._finite_cols = [self._col[op] for op in ("min", "max", "norm", "mean") if op in self._col]
        self._nans_col = self._col.get("nans")

    def reset(self) -> None:
        """Forget every running average (after a configuration change)."""
        self._series.clear()
        self._bad.clear()

    def check(self, rank: int, step: int, rows: Iterable[MetricRow]) -> list[Anomaly]:
        """Judge one step's rows (any order); returns new anomalies sorted by ``order_key``."""
        if not self.alert.enabled:
            return []
        found: list[Anomaly] = []
        for row in rows:
            if row.alias:
                continue
            is_bad, anomaly = self._check_nan(rank, step, row)
            if is_bad:
                if anomaly is not None:
                    found.append(anomaly)
                continue
            for metric, col in self._turb_cols:
                a = self._check_turbulence(rank, step, row, metric, col)
                if a is not None:
                    found.append(a)
        found.sort(key=order_key)
        return found

    # ------------------------------------------------------------------------------------- NaN rule
    def _check_nan(self, rank: int, step: int, row: MetricRow) -> tuple[bool, Anomaly | None]:
        """(row is bad, the anomaly to report: None while a series stays bad)."""
        values = row.values
        metric, value, baseline = None, 0.0, None
        if self._nans_col is not None and values[self._nans_col] > 0:
            metric, value = "nans", values[self._nans_col]
        else:
            for col in self._finite_cols:
                if not math.isfinite(values[col]):
                    metric, value = self.ops[col], values[col]
                    break
        limit = self.alert.nan.threshold
        if metric is None and limit is not None:
            for col in self._finite_cols:
                if abs(values[col]) > limit:
                    metric, value, baseline = self.ops[col], values[col], limit
                    break
        key = (row.kind, row.name)
        if metric is None:
            self._bad.discard(key)
            return False, None
        if key in self._bad:
            return True, None
        self._bad.add(key)
        return True, self._make(rank, step, row, metric, value, baseline, NAN_RULE)

    # ----------------------------------------------------------------------------- turbulence rule
    def _check_turbulence(self, rank: int, step: int, row: MetricRow, metric: str, col: int) -> Anomaly | None:
        turb = self.alert.turbulence
        assert turb is not None
        value = row.values[col]
        v = abs(value)
        if not (0.0 < v < math.inf) or row.kind not in turb.kinds:
            return None
        x = math.log(v)
        key = (row.kind, row.name, metric)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series()
        found = None
        if s.steps >= turb.warmup:
            baseline = math.exp(s.level)
            if (v > (1.0 + turb.threshold) * baseline and x - s.level > JITTER_FACTOR * s.jitter
                    and self._material(row, metric, v)):
                found = self._make(rank, step, row, metric, value, baseline, TURBULENCE_RULE)
        # update the running statistics after judging, so a spike is compared with the past only
        if s.count == 0 or found is not None:
            s.level = x  # first value, or a jump: re-baseline so a lasting shift is reported once
        else:
            s.diffs += 1
            s.jitter += (abs(x - s.prev) - s.jitter) / min(s.diffs, _JITTER_WINDOW)
            s.level = turb.beta * s.level + (1.0 - turb.beta) * x
        s.prev = x
        s.count += 1
        if s.last_step != step:
            s.steps += 1
            s.last_step = step
        return found

    def _material(self, row: MetricRow, metric: str, v: float) -> bool:
        if metric != "mean" or "norm" not in self._col or row.numel <= 0:
            return True
        rms = abs(row.values[self._col["norm"]]) / math.sqrt(row.numel)
        return v >= MEAN_MATERIAL * rms

    def _make(self, rank: int, step: int, row: MetricRow, metric: str, value: float,
              baseline: float | None, rule: str) -> Anomaly:
        return Anomaly(rank=rank, step=step, micro_step=row.micro_step, stage=row.stage, call_id=row.call_id,
                       kind=row.kind, name=row.name, module=row.module, metric=metric, value=float(value),
                       baseline=None if baseline is None else float(baseline), rule=rule, pp_stage=self.pp_stage)
