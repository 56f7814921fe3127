"""``AnomalyDetector``: runs the alert rules over one step's host-side rows and groups what they find.

``judge(rank, step, rows, lrs=..., skipped=...)`` looks at one step's rows (statistics already on the
host; it never sees a tensor) and the optimizer's learning rates, and returns a ``StepVerdict``: the
events opened at this step (one per fault, named by its origin) and the earlier events that reached more
tensors. The rules (``msprobe_core.monitor.rules``):

* ``AnomalyNan`` (always on when alerts are on): NaN/Inf in what the model computed; NaN only in what it
  did not (input batches, masks, constants). A tensor that stays bad is reported once.
* ``AnomalyTurbulence`` (when configured): norms and means judged against their own robust noise, and
  the learning rate of each param group.

A **skipped iteration** (``skipped=True``: forward and backward ran, the optimizer did not update,
because a loss scaler found Inf/NaN gradients) is judged on its forward rows only: the overflowed
gradients are why the scaler skipped, not an anomaly of the model. ``StepVerdict.skipped`` reports it
with the gradient seen overflowing first. ``SKIP_STREAK_ALARM`` skips in a row are an anomaly (the
overflow does not go away by scaling: training has stalled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from msprobe_core.monitor.anomaly import LR_KIND, NAN_RULE, TURBULENCE_RULE, Anomaly, order_key
from msprobe_core.monitor.config import AlertConfig
from msprobe_core.monitor.events import EventTracker
from msprobe_core.monitor.records import (ACTV_GRAD, GRAD, STAGE_BACKWARD, STAGE_GRADIENT, STAGE_OPTIMIZER,
                                          MetricRow)
from msprobe_core.monitor.rules.learning_rate import LearningRateRule
from msprobe_core.monitor.rules.nonfinite import NonFiniteRule
from msprobe_core.monitor.rules.turbulence import TurbulenceRule
from msprobe_core.monitor.step_rows import StepRows

BACKWARD_STAGES = (STAGE_BACKWARD, STAGE_GRADIENT)
_BACKWARD = frozenset(BACKWARD_STAGES)


SKIP_STREAK_ALARM = 10
"""Updates skipped in a row before the skipping itself is an anomaly: a dynamic loss scaler halves its
scale at each skip, so ten in a row (1/1024 of the scale) mean the overflow does not go away by scaling
(a healthy start skips a few while the scale settles)."""
SKIPPED_METRIC = "skipped_steps"


@dataclass(frozen=True)
class SkippedStep:
    """An update the loss scaler skipped, and the gradients seen overflowing (in backward order)."""

    rank: int
    step: int
    overflowed: tuple[str, ...] = ()

    @property
    def origin(self) -> str:
        """The gradient seen overflowing first ("" when not known)."""
        return self.overflowed[0] if self.overflowed else ""


@dataclass
class StepVerdict:
    """What one step (or one skipped iteration) brought: events opened, events that grew (or went on), a skip."""

    step: int
    opened: list[Anomaly] = field(default_factory=list)
    grew: list[Anomaly] = field(default_factory=list)
    skipped: SkippedStep | None = None


class AnomalyDetector:
    """Stateful rules over a run's host-side rows. One detector per rank."""

    def __init__(self, alert: AlertConfig, ops: Sequence[str], pp_stage: int = 0,
                 events: EventTracker | None = None):
        """``events``: the rank's event tracker, when events must outlive this detector (a config change)."""
        self.alert = alert
        self.ops = tuple(ops)
        self.pp_stage = pp_stage
        self._nan = NonFiniteRule(self.ops, alert.nan.threshold)
        turb = alert.turbulence
        self._turbulence = TurbulenceRule(turb, self.ops) if turb is not None else None
        self._lr = LearningRateRule(turb.threshold, turb.window) if turb is not None else None
        self._events = events if events is not None else EventTracker()
        self._bad: set[tuple[str, str]] = set()
        self._skip_streak = 0
        self._nans_shown = any(op in self.ops for op in ("min", "max", "norm", "mean"))
        self._nans_col = self.ops.index("nans") if "nans" in self.ops else None

    def check(self, rank: int, step: int, rows: Iterable[MetricRow], *, lrs: Sequence[float] | None = None,
              skipped: bool = False, overflow: Sequence[str] = ()) -> list[Anomaly]:
        """The events a step opened (``judge(...).opened``)."""
        return self.judge(rank, step, rows, lrs=lrs, skipped=skipped, overflow=overflow).opened

    def judge(self, rank: int, step: int, rows: Iterable[MetricRow], *, lrs: Sequence[float] | None = None,
              skipped: bool = False, overflow: Sequence[str] = ()) -> StepVerdict:
        """Judge one step's rows (any order) and its param groups' learning rates ``lrs``. ``skipped``: the
        rows of an iteration whose update was skipped; ``overflow`` names the weight gradients seen
        overflowing (in backward order; else the rows' Inf/NaN gradients are named)."""
        verdict = StepVerdict(step)
        if not self.alert.enabled:
            return verdict
        rows = StepRows.of(rows)
        found: list[Anomaly] = []
        if skipped:
            verdict.skipped, alarm = self._skip(rank, step, rows, overflow)
            if alarm is not None:
                found.append(alarm)
            rows = rows.where(~rows.layout.mask("stage_in", _BACKWARD))
        else:
            self._skip_streak = 0
        written, rows = rows, rows.where(~rows.layout.mask("alias"))
        bad: set[tuple[str, str]] = set()
        if self._all_finite(rows):  # then none is bad, checked at once
            good = rows
        else:  # a row (object) each, judged one by one
            keep = []
            for i, row in enumerate(rows):
                finding = self._nan.check(row)
                key = (row.kind, row.name)
                if finding is None:
                    keep.append(i)
                    continue
                if key not in self._bad and key not in bad:
                    found.append(self._make(rank, step, row, finding.metric, finding.value, finding.limit, NAN_RULE))
                bad.add(key)
            good = rows.take(np.array(keep, dtype=np.int64))
        if self._bad:  # usually none
            self._bad = (self._bad - set(zip(good.layout.kinds, good.layout.names))) | bad
        else:
            self._bad = bad
        followed: set[tuple[str, str]] = set()  # series that jumped after a cascade's origin: they join its event
        if self._turbulence is not None:
            judged = self._turbulence.judged(good)
            for jump in self._turbulence.check(judged):
                row = _consumer_input(written, jump.row) if jump.cascade and jump.row.kind == ACTV_GRAD else jump.row
                found.append(self._make(rank, step, row, jump.metric, jump.value, jump.baseline, TURBULENCE_RULE))
                followed.update((jump.row.kind, name) for name in jump.followers)
        if self._lr is not None and lrs and not skipped:
            for jump in self._lr.check(lrs):
                found.append(Anomaly(rank=rank, step=step, micro_step=None, stage=STAGE_OPTIMIZER, call_id=-1,
                                     kind=LR_KIND, name=f"optimizer.param_groups.{jump.group}.lr", module="optimizer",
                                     metric="lr", value=jump.value, baseline=jump.previous, rule=TURBULENCE_RULE,
                                     pp_stage=self.pp_stage))
        found.sort(key=order_key)
        verdict.opened, verdict.grew = self._events.add(step, found, bad, followed)
        return verdict

    def _all_finite(self, rows: StepRows) -> bool:
        """Whether ``NonFiniteRule`` finds nothing in any of ``rows`` for sure: every value is finite (a
        NaN count above 0 makes min, max, norm and mean NaN, so it shows in them) and no threshold is set."""
        if self.alert.nan.threshold is not None or not len(rows):
            return False
        if not np.isfinite(rows.values).all():
            return False
        col = self._nans_col
        return self._nans_shown or col is None or not rows.values[:, col].any()

    def _skip(self, rank: int, step: int, rows: StepRows,
              overflow: Sequence[str]) -> tuple[SkippedStep, Anomaly | None]:
        """Record a skipped update; the anomaly when the skips reach ``SKIP_STREAK_ALARM`` in a row."""
        if not overflow:
            backward = rows.where(rows.layout.mask("stage_in", _BACKWARD))
            bad = sorted((r for r in backward if self._nan.check(r) is not None),
                         key=lambda r: r.call_id)
            overflow = list(dict.fromkeys(r.name for r in bad))
        skip = SkippedStep(rank, step, tuple(overflow))
        origin = skip.origin
        self._skip_streak += 1
        alarm = None
        if self._skip_streak == SKIP_STREAK_ALARM:
            alarm = Anomaly(rank=rank, step=step, micro_step=None, stage=STAGE_GRADIENT, call_id=-1, kind=GRAD,
                            name=origin or "gradients", module=origin.rpartition(".")[0], metric=SKIPPED_METRIC,
                            value=float(self._skip_streak), baseline=None, rule=NAN_RULE, pp_stage=self.pp_stage)
        return skip, alarm

    def _make(self, rank: int, step: int, row: MetricRow, metric: str, value: float,
              baseline: float | None, rule: str) -> Anomaly:
        return Anomaly(rank=rank, step=step, micro_step=row.micro_step, stage=row.stage, call_id=row.call_id,
                       kind=row.kind, name=row.name, module=row.module, metric=metric, value=float(value),
                       baseline=None if baseline is None or not math.isfinite(baseline) else float(baseline),
                       rule=rule, pp_stage=self.pp_stage)


def _consumer_input(rows: Sequence[MetricRow], row: MetricRow) -> MetricRow:
    """The gradient a backward cascade starts at, named by the module it entered: ``act1.output``'s gradient
    is ``fc2.input``'s (the module whose fault made it jump), when the step wrote that alias row."""
    for r in rows:
        if (r.alias and r.kind == row.kind and r.micro_step == row.micro_step and r.call_id > row.call_id
                and ".input" in r.name and list(r.values) == list(row.values)):
            return r
    return row
