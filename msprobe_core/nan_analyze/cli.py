"""``python -m msprobe_core nan_analyze -i DUMP_PATH [-o OUT] [--report]``.

Exit status: 0 when no rank holds NaN/Inf, 1 when the first NaN/Inf was found, 2 for unusable input.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from msprobe_core.nan_analyze.analyzer import NanAnalysis, Origin, StepResult

STACK_LINES = 8
EPILOG = """\
DUMP_PATH may be a dump_path (step*/rank*), a step folder or one rank folder. Every step is analysed over
all of its ranks; statistics dumps are enough (Max/Min NaN or Inf), tensor files are read where a summary
has no statistics and to count NaN/Inf in the records named.

A record "makes" NaN/Inf when its outputs hold some and its inputs (arguments and parameters) do not; a
module that does is narrowed down to the first call inside it that does. Communication calls
(Distributed.*) carry NaN from the ranks that sent it to the ranks they write into: seen in the call's
output when it recorded one, otherwise inferred and shown at the first later record on the receiving rank
that holds NaN. The first origin is the earliest in the first step that has one (fewest collectives
before it, then position in its rank).

output: OUT/nan_analyze_{timestamp}.json (first_nan, propagation, rank_status, per-step results);
with --report also OUT/nan_analyze_{timestamp}.html (the origin's rank, the record highlighted).
exit status: 0 no NaN/Inf, 1 NaN/Inf found, 2 unusable input.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the nan_analyze options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("-i", "--input", required=True, metavar="DUMP_PATH",
                        help="dump to analyse (dump_path, step folder or rank folder)")
    parser.add_argument("-o", "--output", default="./output", metavar="OUT",
                        help="folder for the JSON result (default ./output)")
    parser.add_argument("--report", action="store_true",
                        help="also write an HTML report of the origin's rank with the record highlighted")


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def origin_lines(step: StepResult, origin: Origin) -> list[str]:
    """The terminal description of the first origin and how NaN spread."""
    lines = [f"First NaN/Inf: {origin.describe()}"]
    if origin.parent_chain:
        lines.append(f"  parent chain: {' < '.join(origin.parent_chain)}")
    for t in origin.tensors:
        if t["nan_or_inf"]:
            counts = f" ({t['nan']} NaN, {t['inf']} Inf of {t['numel']})" if "nan" in t else ""
            lines.append(f"  {t['path']}: {t['dtype']} {t['shape']} Max={_fmt(t['Max'])} Min={_fmt(t['Min'])}{counts}")
    if origin.stack:
        note = f", {origin.stack_note}" if origin.stack_note else ""
        lines.append(f"  stack (innermost last{note}):")
        for frame in origin.stack[-STACK_LINES:]:
            lines.extend(f"    {part.strip()}" for part in str(frame).splitlines() if part.strip())
    if step.hops:
        lines.append("  how it reached the other ranks:")
        lines.extend(f"    {hop.describe()}" for hop in step.hops)
    others = [o for o in step.origins if o is not origin]
    for o in others:
        lines.append(f"  also made on its own: {o.describe()}")
    return lines


def summary_lines(result: NanAnalysis) -> list[str]:
    """One line per step, then the first origin."""
    lines = []
    for step in result.steps:
        bad = [r for r, s in step.status.items() if s != "no NaN/Inf"]
        lines.append(f"{step.step}: {len(step.ranks)} rank(s), NaN/Inf on {len(bad)}"
                     + (f" ({', '.join(f'{r}: {step.status[r]}' for r in bad[:4])})" if bad else ""))
        lines.extend(f"  note: {n}" for n in step.notes[:5])
    found = result.first
    if found is None:
        lines.append("No NaN/Inf in any dumped tensor.")
    else:
        lines.extend(origin_lines(*found))
    return lines


def _new_path(out_dir: Path, stem: str, suffix: str) -> Path:
    path = out_dir / f"{stem}{suffix}"
    n = 1
    while path.exists():
        path = out_dir / f"{stem}_{n}{suffix}"
        n += 1
    return path


def run(args: argparse.Namespace) -> int:
    """Analyse the dump, write the JSON result (and report); 1 when NaN/Inf was found."""
    from msprobe_core.nan_analyze.analyzer import analyze

    result = analyze(args.input)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"nan_analyze_{time.strftime('%Y%m%d%H%M%S')}"
    json_path = _new_path(out_dir, stem, ".json")
    with open(json_path, "x", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=1, default=str)
    print("\n".join(summary_lines(result)))
    print(f"result: {json_path}")
    args.result_path = str(json_path)  # --report (run by msprobe_core.cli after this) puts its page beside it
    return 0 if result.first is None else 1
