"""``AnomalyTurbulence``: a metric's jump judged against that metric's own step-to-step noise.

**Norms** (magnitudes) are judged in log space, y = ln(norm), per series (kind and tensor name; with
gradient accumulation a step's level is the mean of its micro-batches' ln(norm): one micro-batch of two
sequences is noise, a fault is in all of them). A series keeps its last ``window`` levels. Its level is
judged once it has ``warmup`` of them: the jump z = y - median(levels) must exceed every one of

* ``ln(1 + threshold)``: msprobe's meaning of ``threshold`` kept as a floor (0.5: at least 1.5x);
* ``OWN_SIGMAS`` x the series' own robust noise (1.4826 x the median absolute deviation of its levels);

and, for activations and gradients (``COMMON_KINDS``), which move together from step to step (a hard
batch, a rare token, the loss scale of mixed precision training doubling or halving), three more things:

* the levels are taken relative to the kind's **common mode**: the median step-to-step change of all
  series of the kind, summed over the steps (a loss-scale change moves every activation gradient by
  exactly x2: it is not a jump of any of them);
* the jump must exceed ``STEP_SPREAD_SIGMAS`` x the ``STEP_SPREAD_QUANTILE`` quantile of |z| over the
  series of the same step (when many series jump at once, the step is unusual, not one layer);
* and ``KIND_TAIL_FACTOR`` x the ``KIND_TAIL_QUANTILE`` quantile of |z| over the kind's recent steps (the
  heavy tail of healthy gradients: small noisy batches and rare tokens make a layer's gradient norm jump
  30-80x relative to the others in healthy training; a gradient that explodes goes far beyond what the
  kind has done). A step whose common mode itself moved by more than the floor is left out of the tail:
  the step's spread judges its unevenness, and in the tail it would hide a later explosion for a window.

**A cascade is one event at its origin.** A fault in the middle of the network (a weight multiplied by 50)
moves every activation after it and every gradient before it in one step, so the step's spread excuses each
of them. Before that, the kind's series are read in the order the data was produced (the monitor's call
order: forward order for activations, backward order for gradients): the first series that jumped beyond
its own noise and beyond ``STEP_SPREAD_SIGMAS`` x the spread of the series **before** it (which stayed
within their noise) is where the jump starts. If that is the kind's first series (``INPUT_SERIES``: the
input moved, a hard batch, a rare token) the step is excused as before. Otherwise, once one series of the
cascade goes beyond the kind's tail (``CASCADE_TAIL_FACTOR`` x it for activations; known once it holds
``MIN_GROUP`` jumps, so the first steps after warm-up are judged too), or its step from its last level
(less its typical step) exceeds ``CASCADE_STEP_FACTOR`` x the largest such step any series of the kind
took in its window (the tail of |z| is wide early in training, while the weights still move fast, and
unknown while the kind's steps were all broad: the steps say what one step can do), the origin is
reported once; the series after it that jumped are its ``followers`` (counted in the event's
``reached``), and all of them are re-based.

The noise can excuse a jump of up to ``EXPLOSION`` (x1000) at most; ``threshold`` stays a floor above it.
The jump must also be sudden: the step from the previous level, less the series' median step, exceeds the
floor too (a trend that started after a flat stretch is not a jump). A jump re-bases the series (its levels
are shifted by the jump), so a lasting shift (a weight multiplied by 50) is reported once. A drop is never
reported (gradient clipping, a loss-scale halving).

**Means** are signed: they are judged by magnitude relative to scale. The share |mean| / RMS (RMS =
norm / sqrt(numel), so the share is in [0, 1]) must rise above its median, suddenly (as for norms), by
more than ``threshold``, ``OWN_SIGMAS`` x its own robust noise and ``SIGN_NOISE`` / sqrt(numel) (the
share a mean of numel random signs reaches by chance): the tensor's values became mostly one-signed (a
shifted bias, a saturated activation). The sign of a zero-centred mean flips from step to step (noise,
not a signal); a weight multiplied by 50 leaves the share unchanged (its norm is what jumps). Means need
``norm`` in ``ops``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from msprobe_core.monitor.config import TurbulenceRuleConfig
from msprobe_core.monitor.records import ACTV, ACTV_GRAD, GRAD, MetricRow
from msprobe_core.monitor.rules.windows import Windows, row_medians, sorted_quantile
from msprobe_core.monitor.step_rows import RowLayout, StepRows

OWN_SIGMAS = 8.0
"""A jump must exceed this many of the series' own robust standard deviations."""
COMMON_KINDS = (ACTV, ACTV_GRAD, GRAD)
"""Kinds whose series are judged relative to their common mode and against the kind's spread and tail."""
STEP_SPREAD_SIGMAS = 4.0
STEP_SPREAD_QUANTILE = 0.8
KIND_TAIL_FACTOR = 4.0
KIND_TAIL_QUANTILE = 0.99
CASCADE_TAIL_FACTOR = {ACTV: 2.5}
"""For a cascade in these kinds (its origin stands out of a calm upstream), the tail factor instead of
``KIND_TAIL_FACTOR``: on the healthy zoo (10 models, 3 seeds) no activation cascade passes the upstream
spread at all; a weight x50 passes it at 2.7-17x the kind's tail. Gradients keep ``KIND_TAIL_FACTOR``
(their heavy tail: healthy cascades there reach 2x the tail)."""
CASCADE_STEP_FACTOR = 4.0
"""A cascade whose origin (or a series after it) steps by more than this many times the largest step of any
series of its kind in the window is reported even within the kind's tail of |z|. Measured on the model zoo
(10 models, seeds 0-4, 40 steps, ``param_distribution`` on and off): healthy cascades that pass the
upstream spread step at most 1.2x that largest step; a weight x50 at 7-35x it."""
MIN_GROUP = 4
"""Series of a kind needed for a common mode and a spread (fewer: judged on their own)."""
INPUT_SERIES = 1
"""A cascade that starts within this many series of a kind (in data order) starts at the input: excused."""
MIN_TAIL_SAMPLES = 40
"""Jumps of a kind seen before its tail is known; until then its common-mode series are not judged."""
SIGN_NOISE = 4.0
"""The mean of n zero-centred values is about 1/sqrt(n) of their RMS: a mean's share must rise by more than
this many 1/sqrt(numel) (a bias of eight elements whose gradients all have one sign is chance)."""
EXPLOSION = 1000.0
"""A norm that jumps by more than this factor (beyond its kind's common mode) in one step is reported
whatever the noise says: no healthy run of the model zoo comes within a factor of ten of it."""
EXPLOSION_LOG = math.log(EXPLOSION)
TAIL_POINTS_PER_STEP = 100
"""A step's jumps enter the kind's tail as at most this many evenly spaced quantiles (bounded cost)."""


@dataclass(frozen=True)
class Jump:
    """A turbulent value: the row, the metric, its value and the baseline it jumped from (same units)."""

    row: MetricRow
    metric: str
    value: float
    baseline: float
    followers: tuple[str, ...] = ()
    """Series of the same kind after it (in data order) that jumped with it: a cascade, judged at its origin."""
    cascade: bool = False
    """The origin of a cascade (found in data order, see ``TurbulenceRule._cascade``)."""


@dataclass
class _Kind:
    norms: Windows
    """Levels (ln norm less the common mode) per tensor name."""
    shares: Windows
    """|mean| / RMS per (tensor name, micro-batch)."""
    common: float = 0.0
    """The common-mode log level of the kind's series."""
    tail: deque = field(default_factory=deque)
    """Per step, a sorted sample of the |z| of the kind's calm series."""


@dataclass
class _Plan:
    """Where one kind's series are in a step's rows: worked out once per row layout, then a lookup."""

    kind: str
    state: _Kind
    rows: np.ndarray
    """Positions of the kind's rows in the step's rows."""
    tensor: np.ndarray
    """Per row, its tensor's index in ``norm_rows`` (micro-batches of one tensor share it)."""
    norm_rows: np.ndarray
    """Per tensor, its row in ``state.norms``."""
    share_rows: np.ndarray
    """Per row, its row in ``state.shares``."""
    sqrt_numel: np.ndarray
    share_floor: np.ndarray
    """Per row, max(threshold, SIGN_NOISE / sqrt(numel))."""
    one_row_per_tensor: bool
    first_call: np.ndarray
    """Per tensor, the call order of its first row in the step (the order the data was produced)."""


class TurbulenceRule:
    """Judges the norms and means of one step's rows; keeps every series' recent levels."""

    def __init__(self, cfg: TurbulenceRuleConfig, ops: Sequence[str]):
        self.cfg = cfg
        self.floor = math.log1p(cfg.threshold)
        self._norm = ops.index("norm") if "norm" in ops else None
        self._mean = ops.index("mean") if "mean" in ops and "mean" in cfg.metrics and self._norm is not None else None
        self._judge_norm = self._norm is not None and "norm" in cfg.metrics
        self._kinds_judged = frozenset(cfg.kinds)
        self._kinds: dict[str, _Kind] = {}
        self._layout: list[tuple] = []
        self._layout_seen: RowLayout | None = None
        """The ``RowLayout`` ``_layout`` was last found in (the plans hold for it without a comparison)."""
        self._plans: list[_Plan] = []

    def judged(self, rows: Sequence[MetricRow]) -> StepRows:
        """The rows of ``rows`` of the kinds this rule judges, in order."""
        rows = StepRows.of(rows)
        return rows.where(rows.layout.mask("kind_in", self._kinds_judged))

    def check(self, rows: Sequence[MetricRow]) -> list[Jump]:
        """Judge one step's (or one skipped iteration's) good rows of the judged kinds, then learn from them."""
        rows = StepRows.of(rows)
        if self._norm is None or not len(rows):
            return []
        if rows.layout is not self._layout_seen:  # the same tensors every step, as a rule: plan once
            lay = rows.layout
            layout = list(zip(lay.kinds, lay.names, lay.micros, lay.numels, lay.call_ids))
            if layout != self._layout:
                self._layout, self._plans = layout, self._plan(layout)
            self._layout_seen = lay
        values = rows.values
        norms = values[:, self._norm]
        found: list[Jump] = []
        for plan in self._plans:
            norm = norms[plan.rows]
            if self._judge_norm:
                found.extend(self._check_norms(plan, rows, norm))
            if self._mean is not None:
                found.extend(self._check_means(plan, rows, norm, values[plan.rows, self._mean]))
        return found

    def _plan(self, layout: list[tuple]) -> list[_Plan]:
        positions: dict[str, list[int]] = {}
        for i, (kind, *_rest) in enumerate(layout):
            positions.setdefault(kind, []).append(i)
        plans = []
        for kind, at in positions.items():
            state = self._kinds.get(kind)
            if state is None:
                state = self._kinds[kind] = _Kind(Windows(self.cfg.window), Windows(self.cfg.window),
                                                  tail=deque(maxlen=self.cfg.window))
            names: dict[str, int] = {}
            tensor = [names.setdefault(layout[i][1], len(names)) for i in at]
            numel = np.array([max(layout[i][3], 1) for i in at], dtype=np.float64)
            first_call = np.full(len(names), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(first_call, np.array(tensor, dtype=np.int64), np.array([layout[i][4] for i in at]))
            plans.append(_Plan(kind, state, np.array(at, dtype=np.int64), np.array(tensor, dtype=np.int64),
                               state.norms.rows(list(names)), state.shares.rows([layout[i][1:3] for i in at]),
                               np.sqrt(numel), np.maximum(self.cfg.threshold, SIGN_NOISE / np.sqrt(numel)),
                               len(names) == len(at), first_call))
        return plans

    # ------------------------------------------------------------------------------------------ norms
    def _check_norms(self, plan: _Plan, rows: Sequence[MetricRow], norm: np.ndarray) -> list[Jump]:
        absn = np.abs(norm)
        ok = (absn > 0) & (absn < math.inf)
        logs = np.log(np.where(ok, absn, 1.0))
        if plan.one_row_per_tensor:
            y, present = logs, ok
        else:  # micro-batches of a step: one level, the mean of their ln norm
            seen = np.bincount(plan.tensor, weights=ok, minlength=len(plan.norm_rows))
            y = np.bincount(plan.tensor, weights=np.where(ok, logs, 0.0), minlength=len(plan.norm_rows))
            present = seen > 0
            y = y / np.maximum(seen, 1)
        tensors = np.flatnonzero(present)
        if not len(tensors):
            return []
        kind, state, win = plan.kind, plan.state, plan.state.norms
        idx, y = plan.norm_rows[tensors], y[tensors]
        grouped = kind in COMMON_KINDS and len(tensors) >= MIN_GROUP
        broad = False  # the whole kind moved (a hard batch, a loss-scale change): an unusual step, not a tail sample
        if grouped:
            steps = y - win.last[idx]
            steps = steps[~np.isnan(steps)]
            if len(steps):
                move = float(row_medians(steps[None, :])[0])
                state.common += move
                broad = abs(move) > self.floor
        offset = state.common if kind in COMMON_KINDS else 0.0
        level = y - offset
        judged = np.flatnonzero(win.count[idx] >= self.cfg.warmup)
        z = level[judged] - win.medians(idx[judged])
        noise = 0.0  # what the kind's other series say about how far a healthy series may jump now
        pooled = np.sort(np.concatenate(state.tail)) if grouped and state.tail else np.empty(0)
        if grouped and len(judged) >= MIN_GROUP:
            others = np.sort(np.abs(z))[:-1]  # the largest jump is the candidate, not the spread
            tail = sorted_quantile(pooled, KIND_TAIL_QUANTILE) if len(pooled) >= MIN_TAIL_SAMPLES else math.inf
            noise = max(STEP_SPREAD_SIGMAS * sorted_quantile(others, STEP_SPREAD_QUANTILE), KIND_TAIL_FACTOR * tail)
        elif grouped:
            noise = math.inf  # too few judged series to know the kind's spread yet
        found: list[Jump] = []
        calm = np.ones(len(judged), dtype=bool)
        if grouped and len(judged) > MIN_GROUP and (z > self.floor).any():
            cascade = self._cascade(plan, rows, norm, tensors, judged, level, z, offset, pooled, calm)
            if cascade is not None:
                found.append(cascade)
                noise = math.inf  # the series that jumped with it follow it
        for k in np.flatnonzero((z > max(self.floor, min(noise, EXPLOSION_LOG))) & calm):  # own noise where it matters
            i, zk = judged[k], float(z[k])
            r = idx[i]
            own = OWN_SIGMAS * win.sigma(r, level[i] - zk)
            if zk > max(self.floor, min(max(noise, own), EXPLOSION_LOG)) and self._sudden(win, r, level[i], self.floor):
                row = self._largest(plan, rows, norm, tensors[i])
                found.append(Jump(row, "norm", row.values[self._norm], math.exp(level[i] - zk + offset)))
                win.shift(r, zk)  # re-base: a lasting shift is reported once
                calm[k] = False
        win.push(idx, level, y)
        if kind in COMMON_KINDS and calm.any() and not broad:  # the kind's healthy tail: jumps that were no anomaly
            sample = np.sort(np.abs(z[calm]))
            if len(sample) > TAIL_POINTS_PER_STEP:
                sample = sample[np.round(np.linspace(0, len(sample) - 1, TAIL_POINTS_PER_STEP)).astype(np.int64)]
            state.tail.append(sample)
        return found

    def _cascade(self, plan: _Plan, rows: Sequence[MetricRow], norm: np.ndarray, tensors: np.ndarray,
                 judged: np.ndarray, level: np.ndarray, z: np.ndarray, offset: float, pooled: np.ndarray,
                 calm: np.ndarray) -> Jump | None:
        """Where a jump of many series of one step starts (see the module docstring): in the order the data
        was produced (forward order for activations, backward order for gradients), the first series that
        jumped beyond its own noise, the floor and ``STEP_SPREAD_SIGMAS`` x the spread of the series before
        it; reported when it, or a series after it, also goes beyond the kind's tail or steps by more than
        ``CASCADE_STEP_FACTOR`` x the largest step of the kind's series in their window. A jump that starts
        within the first ``INPUT_SERIES`` series is the input moving (a hard batch, a rare token): excused.
        The series after the origin that jumped beyond their own noise are its ``followers``; they are
        re-based with it (a lasting shift is reported once)."""
        win = plan.state.norms
        r = plan.norm_rows[tensors[judged]]
        center = level[judged] - z
        bound = np.maximum(self.floor, OWN_SIGMAS * win.sigmas(r, center))
        order = np.argsort(plan.first_call[tensors[judged]], kind="stable")
        factor = CASCADE_TAIL_FACTOR.get(plan.kind, KIND_TAIL_FACTOR)
        tail = factor * sorted_quantile(pooled, KIND_TAIL_QUANTILE) if len(pooled) >= MIN_GROUP else math.inf
        origin = None
        largest = None
        for at in np.flatnonzero(z[order] > bound[order]):
            if at < INPUT_SERIES:
                return None  # the jump starts at the input: the step was unusual
            k = int(order[at])
            spread = STEP_SPREAD_SIGMAS * sorted_quantile(np.sort(np.abs(z[order[:at]])), STEP_SPREAD_QUANTILE)
            if z[k] <= min(spread, EXPLOSION_LOG) or not self._sudden(win, int(r[k]), float(level[judged[k]]), self.floor):
                continue  # within the spread of the series before it
            if origin is None:
                origin = at
            if z[k] > min(tail, EXPLOSION_LOG):
                break  # the cascade goes beyond what the kind does in healthy steps: it starts at ``origin``
            if largest is None:
                largest = win.largest_step(r)
            if self._step(win, int(r[k]), float(level[judged[k]])) > CASCADE_STEP_FACTOR * largest:
                break  # one step beyond any the kind's series took in their window: a jump, not the noise
        else:
            return None
        at = origin
        k = int(order[at])
        after = order[at + 1:]
        followed = after[z[after] > bound[after]]
        for j in (k, *followed):
            win.shift(int(r[j]), float(z[j]))
            calm[j] = False
        row = self._largest(plan, rows, norm, tensors[judged[k]])
        names = tuple(self._largest(plan, rows, norm, tensors[judged[j]]).name for j in followed)
        return Jump(row, "norm", row.values[self._norm], math.exp(center[k] + offset), names, cascade=True)

    @staticmethod
    def _largest(plan: _Plan, rows: Sequence[MetricRow], norm: np.ndarray, tensor: int) -> MetricRow:
        """The row (micro-batch) of ``tensor`` with the largest finite norm: the one an alert shows."""
        mine = np.flatnonzero(plan.tensor == tensor)
        finite = np.where(np.isfinite(norm[mine]), np.abs(norm[mine]), -1.0)
        return rows[plan.rows[mine[int(np.argmax(finite))]]]

    @staticmethod
    def _step(win: Windows, row: int, level: float) -> float:
        """The step from the series' last level to ``level``, less the series' typical step."""
        return level - float(win.levels[row, -1]) - win.typical_step(row)

    @classmethod
    def _sudden(cls, win: Windows, row: int, level: float, floor: float) -> bool:
        """A jump, not a trend: the step from the last level, less the series' typical step, exceeds the floor."""
        return cls._step(win, row, level) > floor

    # ------------------------------------------------------------------------------------------ means
    def _check_means(self, plan: _Plan, rows: Sequence[MetricRow], norm: np.ndarray, mean: np.ndarray) -> list[Jump]:
        absn = np.abs(norm)
        ok = (absn > 0) & (absn < math.inf) & np.isfinite(mean)
        at = np.flatnonzero(ok)
        if not len(at):
            return []
        win = plan.state.shares
        rms = absn[at] / plan.sqrt_numel[at]
        share = np.abs(mean[at]) / rms  # in [0, 1]: 1 when every element has the same value
        idx, floor = plan.share_rows[at], plan.share_floor[at]
        judged = np.flatnonzero(win.count[idx] >= self.cfg.warmup)
        center = win.medians(idx[judged])
        found: list[Jump] = []
        for k in np.flatnonzero(share[judged] - center > floor[judged]):
            i, c = judged[k], float(center[k])
            r, zk = idx[i], float(share[i]) - c
            if zk > OWN_SIGMAS * win.sigma(r, c) and self._sudden(win, r, share[i], floor[i]):
                row = rows[plan.rows[at[i]]]
                value = row.values[self._mean]
                found.append(Jump(row, "mean", value, math.copysign(c * rms[i], value)))
                win.shift(r, zk)
        win.push(idx, share)
        return found
