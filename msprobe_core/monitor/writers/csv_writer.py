"""The ``csv`` format: one file per rank and kind, header ``name,step,[micro_step,]<ops...>``.

A file holds ``step_count_per_record`` monitored steps and is named ``{kind}_{first}-{last}.csv`` after
the steps it covers (``last`` is ``first + (step_count_per_record - 1) * step_interval``). Values are
written with ``ndigits`` significant digits, so tiny gradients are not rounded to zero. Files are
flushed after every step.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import IO, Sequence

from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.writers.base import MetricWriter, WriterContext


@dataclass
class _OpenFile:
    handle: IO[str]
    writer: "csv._writer"  # type: ignore[name-defined]
    steps: int
    last_step: int | None
    with_micro: bool


class CsvWriter(MetricWriter):
    """Writes one CSV per kind, rolled over every ``step_count_per_record`` steps."""

    def __init__(self, context: WriterContext):
        self.context = context
        self._files: dict[str, _OpenFile] = {}
        self._fmt = f"%.{context.ndigits}g"
        self._row_fmts: dict[int, str] = {}
        self._fields: dict[str, str] = {}

    def write(self, step: int, rows: Sequence[MetricRow]) -> None:
        # one %-format per row ("%.Ng" is "{:.Ng}" for every float, nan and inf included), the lines of a
        # kind joined and written at once: the bytes csv.writer would write, without a call per row
        lines: dict[str, tuple[_OpenFile, list[str]]] = {}
        row_fmts, fields = self._row_fmts, self._fields
        for row in rows:
            kind = row.kind
            at = lines.get(kind)
            if at is None:
                at = lines[kind] = (self._file(kind, step, row.micro_step is not None), [])
            values = row.values
            n = len(values)
            row_fmt = row_fmts.get(n)
            if row_fmt is None:
                row_fmt = row_fmts[n] = ",".join([self._fmt] * n)
            name = fields.get(row.name)
            if name is None:
                name = fields[row.name] = _field(row.name)
            if at[0].with_micro:
                micro = -1 if row.micro_step is None else row.micro_step
                at[1].append(f"{name},{step},{micro},{row_fmt % tuple(values)}\r\n" if n else f"{name},{step},{micro}\r\n")
            else:
                at[1].append(f"{name},{step},{row_fmt % tuple(values)}\r\n" if n else f"{name},{step}\r\n")
        for f, text in lines.values():
            f.handle.write("".join(text))
        self.flush()

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
            ctx.rank_dir.mkdir(parents=True, exist_ok=True)
            handle = open(ctx.rank_dir / f"{kind}_{step}-{last}.csv", "w", newline="", encoding="utf-8")
            writer = csv.writer(handle)
            writer.writerow(["name", "step", *(["micro_step"] if micro else []), *ctx.ops])
            f = self._files[kind] = _OpenFile(handle, writer, 1, step, micro)
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
