"""Writing a comparison: one CSV and one .xlsx per rank pair, compare_summary.json, and terminal text.

The columns are ``columns``' (the default) or ``msprobe_columns``' (``--msprobe-columns``). In the
workbook, error rows are red, warnings yellow and unmatched records grey.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Callable, Optional

from msprobe_core.compare import columns as default_layout
from msprobe_core.compare import msprobe_columns as msprobe_columns_layout
from msprobe_core.compare.columns import row_values
from msprobe_core.compare.engine import CompareResult, Divergence, PairResult
from msprobe_core.compare.thresholds import ERROR, PASS, UNMATCHED, WARNING

FILLS = {ERROR: "FFC7CE", WARNING: "FFEB9C", UNMATCHED: "D9D9D9"}
STACK_LINES = 6


def _csv_cell(value: Any) -> Any:
    return "" if value is None else value


def write_csv(path: Path, pair: PairResult, cols: list[str], values: Callable = row_values) -> None:
    """Write a pair's rows as CSV (``values(pair, row, cols)``: the cells of a row under ``cols``)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        for row in pair.rows:
            writer.writerow([_csv_cell(v) for v in values(pair, row, cols)])


def write_xlsx(path: Path, pair: PairResult, cols: list[str], values: Callable = row_values) -> None:
    """Write a pair's rows as an .xlsx: errors red, warnings yellow, unmatched records grey."""
    from msprobe_core.compare.xlsx import write_xlsx as write_sheet

    order = list(FILLS)
    write_sheet(path, cols, (values(pair, row, cols) for row in pair.rows),
                row_fills=(order.index(row.verdict) if row.verdict in FILLS else None for row in pair.rows),
                widths={"Target Name": 60, "Golden Name": 60, "Message": 50, "Target Stack": 60,
                        "NPU Name": 60, "Bench Name": 60, "Err_message": 50, "NPU_Stack_Info": 60},
                fills=[FILLS[v] for v in order])


def output_stem(pair: PairResult, single: bool) -> str:
    """``compare_result`` for a single pair, ``compare_result_step0_rank1`` otherwise."""
    if single:
        return "compare_result"
    parts = [p for p in (pair.target_unit.step, pair.target_unit.rank) if p]
    return "compare_result_" + "_".join(parts or [pair.target_unit.path.name])


def write_pair_outputs(pair: PairResult, output_dir: Path, single: bool, xlsx: bool = True,
                       with_stack: bool = False, msprobe_columns: bool = False) -> list[Path]:
    """Write one pair's CSV (and .xlsx) into ``output_dir``; ``single`` drops the step/rank suffix;
    ``msprobe_columns``: under msprobe's column names (``msprobe_columns``)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    layout = msprobe_columns_layout if msprobe_columns else default_layout
    cols, values = layout.columns(pair, with_stack), layout.row_values
    stem = output_stem(pair, single)
    csv_path = output_dir / f"{stem}.csv"
    write_csv(csv_path, pair, cols, values)
    pair.outputs = [csv_path]
    if xlsx:
        xlsx_path = output_dir / f"{stem}.xlsx"
        write_xlsx(xlsx_path, pair, cols, values)
        pair.outputs.append(xlsx_path)
    return pair.outputs


def write_summary(result: CompareResult, output_dir: Path) -> Path:
    """Write compare_summary.json into ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    summary_path = output_dir / "compare_summary.json"
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary_dict(result), f, indent=1, default=str)
    return summary_path


def write_outputs(result: CompareResult, output_dir: Path, xlsx: bool = True, with_stack: bool = False,
                  msprobe_columns: bool = False) -> list[Path]:
    """Write every pair's CSV (and .xlsx) plus compare_summary.json into ``output_dir``."""
    written: list[Path] = []
    for pair in result.pairs:
        written.extend(write_pair_outputs(pair, output_dir, len(result.pairs) == 1, xlsx, with_stack, msprobe_columns))
    written.append(write_summary(result, output_dir))
    return written


def _divergence_dict(div: Optional[Divergence]) -> Optional[dict]:
    if div is None:
        return None
    return {"target_record": div.target_record, "golden_record": div.golden_record, "verdict": div.verdict,
            "parent": div.parent, "inputs_differ": div.inputs_differ,
            "rows": [{"path": r.path, "messages": r.messages, "metrics": r.metrics} for r in div.rows],
            "stack": div.stack}


def summary_dict(result: CompareResult) -> dict:
    """compare_summary.json: per pair the counts, the first divergence and the unmatched records."""
    pairs = []
    for pair in result.pairs:
        counts = pair.counts()
        pairs.append({
            "label": pair.label, "step": pair.target_unit.step, "rank": pair.target_unit.rank,
            "target": str(pair.target_unit.path), "golden": str(pair.golden_unit.path), "mode": pair.mode,
            "notes": pair.notes, "records": len(pair.merged), "seconds": round(pair.seconds, 3),
            "rows": {v: counts.get(v, 0) for v in (PASS, WARNING, ERROR, UNMATCHED)},
            "unreadable_records": len(pair.unreadable), "unreadable": pair.unreadable[:100],
            "first_divergence": _divergence_dict(pair.divergence),
            "first_warning": _divergence_dict(pair.first_warning),
            "only_in_target": pair.only_target, "only_in_golden": pair.only_golden,
            "outputs": [str(p) for p in pair.outputs],
        })
    th = result.thresholds
    return {"target": str(result.target), "golden": str(result.golden), "seconds": round(result.seconds, 3),
            "thresholds": {"cosine": th.cosine, "max_abs": th.max_abs, "rel_error": th.rel_error,
                           "rel_warning": th.rel_warning},
            "pairs": pairs}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _divergence_lines(div: Divergence, title: str) -> list[str]:
    golden = "" if div.golden_record in (None, div.target_record) else f"  (golden: {div.golden_record})"
    lines = [f"  {title}: {div.target_record}{golden}"]
    for row in div.rows[:4]:
        lines.append(f"    {row.path or 'record'}: {'; '.join(row.messages)}")
    if len(div.rows) > 4:
        lines.append(f"    ... and {len(div.rows) - 4} more {div.verdict} tensors in this record")
    if div.inputs_differ:
        bad = [r.path for r in div.rows if r.path.startswith("input")]
        lines.append(f"    its inputs already differ ({', '.join(bad[:4])}): they come from outside the dumped calls "
                     "(a parameter, the data, or an operation the dump does not cover)")
    lines.append(f"    parent module: {div.parent or 'none recorded (construct.json has no parent for it)'}")
    if div.stack:
        note = f", {div.stack_note}" if div.stack_note else ""
        lines.append(f"    stack (innermost last{note}):")
        for frame in div.stack[-STACK_LINES:]:
            for part in str(frame).splitlines():
                if part.strip():
                    lines.append(f"      {part.strip()}")
    return lines


def _list_line(title: str, names: list[str], limit: int = 5) -> str:
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"  {title} ({len(names)}): {', '.join(names[:limit])}{more}"


def summary_text(result: CompareResult, quiet: bool = False) -> str:
    """The terminal summary; the first divergence is named on the last line."""
    lines: list[str] = []
    for pair in result.pairs:
        counts = pair.counts()
        tally = ", ".join(f"{counts.get(v, 0)} {v}" for v in (PASS, WARNING, ERROR) if counts.get(v, 0) or v == PASS)
        if pair.unreadable:
            tally += f", {len(pair.unreadable)} unreadable records"
        head = (f"{pair.label}: {len(pair.merged)} records, {sum(counts.values())} rows ({pair.mode}): {tally}")
        if quiet:
            div = pair.divergence
            lines.append(head + (f"; first divergence {div.target_record}" if div else ""))
            continue
        lines.append(head)
        lines.extend(f"  note: {n}" for n in pair.notes)
        if pair.unreadable:
            lines.append(_list_line("records that could not be read (warning rows)", pair.unreadable))
        if pair.only_target:
            lines.append(_list_line("only in target", pair.only_target))
        if pair.only_golden:
            lines.append(_list_line("only in golden", pair.only_golden))
        if pair.divergence:
            lines.extend(_divergence_lines(pair.divergence, "first divergence"))
        elif pair.first_warning:
            lines.extend(_divergence_lines(pair.first_warning, "no error; first warning"))
        if pair.outputs:
            lines.append("  results: " + ", ".join(str(p) for p in pair.outputs))
    if not quiet:
        lines.append(f"thresholds: {result.thresholds.describe()}")
    found = result.divergence
    if found:
        pair, div = found
        where = f"{pair.label} " if len(result.pairs) > 1 else ""
        lines.append(f"First divergence: {where}{div.target_record}"
                     + (f" (parent {div.parent})" if div.parent else ""))
    elif any(pair.unreadable for pair in result.pairs):
        lines.append(f"No divergence among the records that could be read; "
                     f"{sum(len(p.unreadable) for p in result.pairs)} records could not be read (see the warning rows)")
    else:
        lines.append(f"No divergence: every compared tensor is within the thresholds ({result.seconds:.2f} s)")
    return "\n".join(lines)
