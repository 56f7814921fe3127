"""Build a report: find what a folder holds (a dump, a compare output, a monitor output), gather its
data and write the page. Also the reports ``compare --report`` and ``nan_analyze --report`` write."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from msprobe_core.dumpdir.layout import discover
from msprobe_core.dumpdir.rank_dump import load_rank_dump
from msprobe_core.errors import DumpInputError, MsprobeError
from msprobe_core.report.compare_data import compare_data, is_compare_dir
from msprobe_core.report.dump_data import rank_tree
from msprobe_core.report.html import render
from msprobe_core.report.moe_section import moe_section
from msprobe_core.report.monitor_data import is_monitor_dir, monitor_data

if TYPE_CHECKING:
    from msprobe_core.nan_analyze.analyzer import NanAnalysis

KINDS = ("dump", "compare", "monitor")


class ReportOutputError(MsprobeError, ValueError):
    """The report cannot be written where asked (the file exists, or the folder is not writable)."""


def detect(path: Path) -> str:
    """``compare``, ``monitor`` or ``dump``; ``DumpInputError`` when the folder is none of them."""
    path = Path(path)
    if not path.exists():
        raise DumpInputError(f"{path}: no such file or directory")
    if is_compare_dir(path):
        return "compare"
    if is_monitor_dir(path):
        return "monitor"
    try:
        discover(path)
    except DumpInputError as e:
        raise DumpInputError(f"{path}: not a dump, a compare output (compare_summary.json) or a monitor output "
                             f"(rank*/ with CSV, TensorBoard events or anomalies.json): {e}") from None
    return "dump"


def dump_units(paths: list[Path], labels: list[str]) -> list[dict]:
    """Tree data of each rank folder."""
    return [rank_tree(load_rank_dump(p), label) for p, label in zip(paths, labels)]


def dump_data(path: Path) -> dict:
    """The dump view's data for every rank folder under ``path``."""
    _, units = discover(path)
    return {"units": dump_units([u.path for u in units], [u.label for u in units]), "selected": 0,
            "highlight": None, "banner": None}


def report_page(path: Path) -> str:
    """The page for whatever ``path`` holds."""
    path = Path(path)
    kind = detect(path)
    if kind == "compare":
        return render(kind, f"msprobe compare report: {path}", compare_data(path))
    if kind == "monitor":
        return render(kind, f"msprobe monitor report: {path}", monitor_data(path), moe_section(path))
    return render(kind, f"msprobe dump report: {path}", dump_data(path))


def write_page(out: Path, page: str, overwrite: bool = False) -> Path:
    """Write the page atomically; an existing file is kept unless ``overwrite``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ReportOutputError(f"{out}: already exists; choose another -o or pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, out)
    except OSError as e:
        raise ReportOutputError(f"{out}: cannot write the report ({e.strerror})") from None
    return out


def build_report(path: Path, out: Path, overwrite: bool = False) -> Path:
    """Write the report of ``path`` (a dump, compare output or monitor output) to ``out``."""
    return write_page(out, report_page(path), overwrite)


def compare_report(compare_dir: Path, out: Optional[Path] = None) -> Path:
    """``compare_report.html`` next to a compare's results (replaced on each compare, like its CSV)."""
    compare_dir = Path(compare_dir)
    page = render("compare", f"msprobe compare report: {compare_dir}", compare_data(compare_dir))
    return write_page(out or compare_dir / "compare_report.html", page, overwrite=True)


def nan_report(analysis: "NanAnalysis", out: Path) -> Path:
    """The dump view of the step where NaN/Inf started, its origin highlighted and the path listed."""
    found = analysis.first
    step = found[0] if found else (analysis.steps[0] if analysis.steps else None)
    if step is None:
        raise DumpInputError(f"{analysis.dump_path}: no rank folder to show")
    units = dump_units([Path(p) for p in step.paths], [f"{step.step}/{r}" for r in step.ranks])
    data = {"units": units, "selected": 0, "highlight": None, "banner": None}
    if found is None:
        data["banner"] = {"ok": True, "title": "No NaN/Inf", "text": "no dumped tensor holds NaN or Inf"}
    else:
        origin = found[1]

        def link(rank: str, record: Optional[str]) -> Optional[list]:
            k = step.ranks.index(rank)
            names = units[k]["names"]
            return [k, names.index(record)] if record in names else None

        unit = step.ranks.index(origin.rank)
        data["selected"] = unit
        data["highlight"] = {"unit": unit, "node": link(origin.rank, origin.record)[1]}
        items = [{"text": hop.describe(), "link": link(hop.to_rank, hop.first_seen or hop.via)} for hop in step.hops]
        items += [{"text": "also: " + o.describe(), "link": link(o.rank, o.record)} for o in step.origins if o is not origin]
        data["banner"] = {"title": "First NaN/Inf", "text": origin.describe(), "link": link(origin.rank, origin.record),
                          "items": items}
    return write_page(out, render("dump", f"msprobe nan_analyze report: {analysis.dump_path}", data))


def report_after(command: str, args: "argparse.Namespace") -> Path:
    """The page ``--report`` asks for once ``compare`` or ``nan_analyze`` has run (called by ``msprobe_core.cli``,
    so neither command's package depends on this one): ``OUT/compare_report.html`` beside a compare's results,
    or the nan_analyze result's name with ``.html``."""
    if command == "compare":
        return compare_report(Path(args.output))
    if command == "nan_analyze":
        from msprobe_core.nan_analyze.analyzer import analyze

        return nan_report(analyze(args.input), Path(args.result_path).with_suffix(".html"))
    raise ValueError(f"--report is not available for the {command!r} command")
