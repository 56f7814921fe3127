"""One event per fault: the anomalies a fault causes are grouped under the first one (its origin).

A NaN put into one weight reaches the forward activations, every gradient and, after the update, every
weight: a hundred tensors over several steps. The user needs one alert, naming where it started and how
far it went. Rules, for one rank:

* the new anomalies of a step form one event; its origin is the first of them in the order the data was
  produced (``anomaly.order_key``: weights, forward and backward per micro-batch, gradients, optimizer);
* an event stays **live** while a tensor it reached holds NaN/Inf at every judged step; new anomalies of a
  step in which it is live join it (the NaN spreading) instead of opening an event. Once no tensor it
  reached is bad, the event is over: a NaN that comes back later is a new event;
* jumps (``AnomalyTurbulence``) within ``CASCADE_STEPS`` judged steps after an event's last step join it
  too (a cascade: the learning rate multiplied by 100 at step s moves the weights more at every step
  after it); a new NaN/Inf does not;
* ``reached`` counts the distinct tensors (kind and name) an event's anomalies named.

``EventTracker.add`` returns the events opened (for the log and the callbacks) and the earlier events that
grew (their file and database rows are updated).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from msprobe_core.monitor.anomaly import NAN_RULE, Anomaly, order_key

SeriesKey = tuple[str, str]
CASCADE_STEPS = 3
"""Jumps within this many judged steps after an event's last anomaly are its consequences: the optimizer's
momentum carries an exploded gradient over the next steps, a wrong learning rate moves the weights a
little more at each step."""


@dataclass
class _Event:
    index: int
    origin: Anomaly
    members: set[SeriesKey] = field(default_factory=set)
    last_step: int = 0
    bad_step: int | None = None
    """The last step at which a tensor the event reached held NaN/Inf."""

    def snapshot(self) -> Anomaly:
        return replace(self.origin, event=self.index, reached=len(self.members), last_step=self.last_step)


class EventTracker:
    """Groups one rank's anomalies into events."""

    def __init__(self) -> None:
        self._events: list[_Event] = []
        self._judged: deque[int] = deque(maxlen=CASCADE_STEPS + 1)  # the steps judged last, this one included

    def add(self, step: int, anomalies: Sequence[Anomaly], bad: Iterable[SeriesKey],
            followed: Iterable[SeriesKey] = ()) -> tuple[list[Anomaly], list[Anomaly]]:
        """Group a step's new ``anomalies``; ``bad`` are every series that holds NaN/Inf at this step (also the
        ones reported earlier); ``followed``: series that jumped after a cascade's origin (they count as
        reached, they are not anomalies of their own). Returns (events opened, events that grew or went on)."""
        bad = set(bad)
        if not self._judged or self._judged[-1] != step:
            self._judged.append(step)
        keys = {(a.kind, a.name) for a in anomalies} | (set(followed) if anomalies else set())
        live = self._events[-1] if self._events else None
        if live is not None:
            before = (len(live.members), live.last_step)
            if live.members & bad and live.bad_step in list(self._judged)[-2:]:  # the NaN is still there
                live.bad_step = live.last_step = step
                live.members |= keys
            elif anomalies and live.last_step in self._judged and all(a.rule != NAN_RULE for a in anomalies):
                live.last_step = step  # a cascade: jumps (never a new NaN) shortly after the event's last one
                live.members |= keys
            else:
                live = None
            if live is not None:
                return [], ([live.snapshot()] if (len(live.members), live.last_step) != before else [])
        if not anomalies:
            return [], []
        event = _Event(len(self._events), min(anomalies, key=order_key), keys, step, step if keys & bad else None)
        self._events.append(event)
        return [event.snapshot()], []
