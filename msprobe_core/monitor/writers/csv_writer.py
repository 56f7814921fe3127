"""The ``csv`` format: one file per rank and kind, header ``name,step,[micro_step,]<ops...>``.

A file holds ``step_count_per_record`` monitored steps and is named ``{kind}_{first}-{last}.csv`` after
the steps it covers (``last`` is ``first + (step_count_per_record - 1) * step_interval``). Values are
written with ``ndigits`` significant digits, so tiny gradients are not rounded to zero. Files are
flushed after every step.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from typing import IO, Sequence

import numpy as np

from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.step_rows import RowLayout, StepRows
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext
from msprobe_core.stats.kernel import KERNEL

_csv_rows = getattr(KERNEL, "csv_rows", None)


_STEP = "\0"
"""Where a template holds the step."""


@dataclass
class _OpenFile:
    handle: IO[str]
    steps: int
    last_step: int | None
    with_micro: bool


class CsvWriter(MetricWriter):
    """Writes one CSV per kind, rolled over every ``step_count_per_record`` steps."""

    def __init__(self, context: WriterContext):
        self.context = context
        self._files: dict[str, _OpenFile] = {}
        self._fmt = f"%.{context.ndigits}g"
        self._fields: dict[str, str] = {}
        """Names as csv fields, ``%`` doubled (for templates)."""
        self._templates: dict[str, tuple[tuple, tuple, str | None]] = {}
        """Per kind: the key (layout, rows, micro column) of its last lines, their names, micro-steps and width,
        and their template (None: made per step)."""
        self._heads: dict[str, tuple[tuple, list[str], list[str] | None]] = {}
        """Per kind, for the kernel's ``csv_rows``: the key of its last lines, their starts (the name field
        and a comma) and what follows the step (the micro_step column, or None)."""

    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        # A kind's lines are one %-format of all its values ("%.Ng" is "{:.Ng}" for every float, nan and inf
        # included) with a template made once for its names (the same every step): the bytes csv.writer
        # would write, without a Python round per row. Which rows each kind has is worked out once per layout.
        rows = StepRows.of(rows)
        kinds = rows.layout.plans.get(self)
        if kinds is None:
            kinds = rows.layout.plans[self] = _kinds_of(rows.layout)
        for kind, at, span in kinds:
            first = at[0]
            f = self._file(kind, step, rows.layout.micros[first] is not None)
            f.handle.write(self._lines(kind, step, rows, at, f.with_micro, span))
        self.flush()

    def _lines(self, kind: str, step: int, rows: StepRows, at: np.ndarray, with_micro: bool,
               span: slice | None = None) -> str:
        """The lines of one kind's rows (at positions ``at`` of ``rows``; ``span``: the same positions as a slice,
        where they are consecutive: the values' rows are then a view, not a copy) at ``step``."""
        layout = rows.layout
        if len(at) == len(rows):
            values = rows.values
        else:
            values = rows.values[span] if span is not None else rows.values[at]
        values = np.ascontiguousarray(values)
        key = (layout, at.tobytes(), with_micro)
        if _csv_rows is not None:  # the kernel writes the lot, from the values' buffer
            heads = self._heads.get(kind)
            if heads is None or heads[0] != key:
                names, micros = [layout.names[i] for i in at.tolist()], [layout.micros[i] for i in at.tolist()]
                heads = self._heads[kind] = (key, [_field(name) + "," for name in names],
                                             [f",{-1 if m is None else m}" for m in micros] if with_micro else None)
            return _csv_rows(heads[1], str(step), heads[2], values, values.shape[1], self.context.ndigits)
        made = self._templates.get(kind)
        if made is None or made[0] != key:
            names = tuple(layout.names[i] for i in at.tolist())
            micros = tuple(layout.micros[i] for i in at.tolist()) if with_micro else None
            steady = not any(_STEP in name for name in names)  # else a name holds the step mark (a NUL)
            made = self._templates[kind] = (key, (names, micros, values.shape[1]),
                                            self._template(names, micros, values.shape[1]) if steady else None)
        template = made[2].replace(_STEP, str(step)) if made[2] is not None else self._template(*made[1], step=str(step))
        return template % tuple(values.ravel().tolist())

    def _template(self, names: tuple[str, ...], micros: tuple[int | None, ...] | None, n: int,
                  step: str = _STEP) -> str:
        """A %-format of rows' lines with these names (micro-steps: the micro_step column), ``n`` values each,
        the step written as ``step``."""
        fields = self._fields
        lines = []
        for i, name in enumerate(names):
            field = fields.get(name)
            if field is None:
                field = fields[name] = _field(name).replace("%", "%%")
            row_fmt = "," + ",".join([self._fmt] * n) if n else ""
            if micros is not None:
                micro = -1 if micros[i] is None else micros[i]
                lines.append(f"{field},{step},{micro}{row_fmt}\r\n")
            else:
                lines.append(f"{field},{step}{row_fmt}\r\n")
        return "".join(lines)

    def _file(self, kind: str, step: int, micro: bool) -> _OpenFile:
        f = self._files.get(kind)
        if f is not None and f.last_step != step:
            if f.steps >= self.context.step_count_per_record:
                f.handle.close()
                f = None
            else:
                f.steps += 1
                f.last_step = step
        if f is None:
            ctx = self.context
            last = step + (ctx.step_count_per_record - 1) * ctx.step_interval
            path = os.path.join(ctx.rank_dir, f"{kind}_{step}-{last}.csv")
            try:  # the folder is there after the first file (a file a step and kind: no mkdir each time)
                handle = open(path, "w", newline="", encoding="utf-8")
            except FileNotFoundError:
                ctx.rank_dir.mkdir(parents=True, exist_ok=True)
                handle = open(path, "w", newline="", encoding="utf-8")
            csv.writer(handle).writerow(["name", "step", *(["micro_step"] if micro else []), *ctx.ops])
            f = self._files[kind] = _OpenFile(handle, 1, step, micro)
        return f

    def flush(self) -> None:
        for f in self._files.values():
            f.handle.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.handle.close()
        self._files.clear()


def _field(name: str) -> str:
    """``name`` as ``csv.writer`` writes a field of a row (quoted where it holds a delimiter, a quote, a line
    break; an empty field stays empty)."""
    if not name:
        return ""
    out = io.StringIO()
    csv.writer(out).writerow([name])
    return out.getvalue()[:-2]  # less the "\r\n" line end


def _kinds_of(layout: RowLayout) -> list[tuple[str, np.ndarray, slice | None]]:
    """Each kind of ``layout``'s rows (in order of first appearance), the positions of its rows, and those
    positions as a slice where they are consecutive (as a rule: a kind's rows are recorded together), else None."""
    positions: dict[str, list[int]] = {}
    for i, kind in enumerate(layout.kinds):
        positions.setdefault(kind, []).append(i)
    return [(kind, np.array(at, dtype=np.int64), slice(at[0], at[-1] + 1) if at[-1] - at[0] == len(at) - 1 else None)
            for kind, at in positions.items()]
