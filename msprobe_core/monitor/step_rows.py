"""``StepRows``: one step's rows as columns, from the collector through the writers and the rules.

A step holds thousands of rows (a 400-layer model: 6,400) whose names, kinds and modules are the same every
step. ``RowLayout`` holds those fields as columns, made once while the step's layout does not change and shared
from step to step, with what the writers and rules work out from it (``plans``: per consumer, e.g. a kind's
CSV line starts, the rows a rule judges). The values are one float64 array ``[rows, ops]``. A ``MetricRow`` is
made only where one is asked for (``rows[i]``, iterating: an anomaly, the ``api`` writer, a caller's own code),
so a ``StepRows`` is a ``Sequence[MetricRow]`` as the rows' list was. ``StepRows.of`` turns rows given as a list
(an integration's, a test's) into columns, so the writers and rules have one implementation.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, overload

import numpy as np

from msprobe_core.monitor.records import MetricRow, stage_of


class RowLayout:
    """Every field of a step's rows but their values, as columns (tuples), and per-layout ``plans``."""

    __slots__ = ("kinds", "names", "modules", "micros", "call_ids", "numels", "aliases", "externals", "plans",
                 "_subsets", "_arrays")

    def __init__(self, kinds: Sequence[str], names: Sequence[str], modules: Sequence[str],
                 micros: Sequence[int | None], call_ids: Sequence[int], numels: Sequence[int],
                 aliases: Sequence[bool], externals: Sequence[bool]):
        self.kinds = tuple(kinds)
        self.names = tuple(names)
        self.modules = tuple(modules)
        self.micros = tuple(micros)
        self.call_ids = tuple(call_ids)
        self.numels = tuple(numels)
        self.aliases = tuple(aliases)
        self.externals = tuple(externals)
        self.plans: dict[Any, Any] = {}
        """What a consumer (a writer, a rule) worked out from this layout, under a key of its own."""
        self._subsets: dict[bytes, RowLayout] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.kinds)

    def subset(self, at: np.ndarray) -> "RowLayout":
        """The layout of the rows at positions ``at`` (ascending), made once per selection."""
        key = at.tobytes()
        sub = self._subsets.get(key)
        if sub is None:
            pick = at.tolist()
            sub = self._subsets[key] = RowLayout(*([column[i] for i in pick] for column in (
                self.kinds, self.names, self.modules, self.micros, self.call_ids, self.numels, self.aliases,
                self.externals)))
        return sub

    def mask(self, what: str, *args: Any) -> np.ndarray:
        """A boolean array over the rows, made once: ``"alias"``, or ``"kind_in"`` / ``"stage_in"`` with a
        frozenset of kinds / stages."""
        key = what + repr(sorted(args[0])) if args else what
        made = self._arrays.get(key)
        if made is None:
            if what == "alias":
                made = np.fromiter(self.aliases, dtype=bool, count=len(self))
            elif what == "kind_in":
                made = np.fromiter((k in args[0] for k in self.kinds), dtype=bool, count=len(self))
            else:
                made = np.fromiter((stage_of(k) in args[0] for k in self.kinds), dtype=bool, count=len(self))
            self._arrays[key] = made
        return made


class StepRows(Sequence[MetricRow]):
    """One step's rows: a ``RowLayout`` and the values ``[rows, ops]`` (float64)."""

    __slots__ = ("layout", "values")

    def __init__(self, layout: RowLayout, values: np.ndarray):
        self.layout = layout
        self.values = values

    @classmethod
    def of(cls, rows: Sequence[MetricRow] | "StepRows") -> "StepRows":
        """``rows`` as columns (itself when it is a ``StepRows``); every row has as many values."""
        if isinstance(rows, StepRows):
            return rows
        rows = list(rows)
        layout = RowLayout(*(zip(*[(r.kind, r.name, r.module, r.micro_step, r.call_id, r.numel, r.alias, r.external)
                                   for r in rows]) if rows else [()] * 8))
        width = len(rows[0].values) if rows else 0
        values = np.array([tuple(r.values) for r in rows], dtype=np.float64).reshape(len(rows), width)
        return cls(layout, values)

    def __len__(self) -> int:
        return len(self.layout.kinds)

    @overload
    def __getitem__(self, i: int) -> MetricRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[MetricRow]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        lay = self.layout
        return MetricRow(lay.kinds[i], lay.names[i], lay.modules[i], lay.micros[i], lay.call_ids[i], lay.numels[i],
                         tuple(self.values[i].tolist()), lay.aliases[i], lay.externals[i])

    def __iter__(self) -> Iterator[MetricRow]:
        return map(self.__getitem__, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (StepRows, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def take(self, at: np.ndarray) -> "StepRows":
        """The rows at positions ``at`` (ascending), as columns."""
        if len(at) == len(self):
            return self
        return StepRows(self.layout.subset(at), self.values[at])

    def where(self, keep: np.ndarray) -> "StepRows":
        """The rows where the boolean array ``keep`` is set."""
        return self.take(np.flatnonzero(keep))
