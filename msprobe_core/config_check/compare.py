"""``python -m msprobe_core config_check -c BENCH.zip CMP.zip -o OUT``: compare two packs.

``OUT`` is deleted and created again (as msprobe does), then holds ``bench/`` and ``cmp/`` (the packs'
contents) and ``result.xlsx``: a ``summary`` sheet (pass/fail for env, pip, hyperparameters, weights,
dataset; random as information) and one sheet per check listing only the differing items (the pass rules
are in ``checks``). For safety an existing ``OUT`` is deleted only when it is empty or holds nothing but
a previous result (``bench``, ``cmp``, ``result.xlsx``); any other folder is an error.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from msprobe_core.config_check import pack
from msprobe_core.config_check.checks import FAIL, CheckResult, cell_value, overall_pass, run_checks
from msprobe_core.config_check.exceptions import PackInputError, PackPathError

RESULT_FILE = "result.xlsx"
DEFAULT_OUTPUT = "./config_check_result"
_OWN = {"bench", "cmp", RESULT_FILE}
_WIDTHS = {"stack": 90, "call site": 40, "name": 36, "parameter": 48, "input": 28, "variable": 32, "package": 28}


def _prepare_output(output: Path, inputs: list[Path]) -> None:
    if output.exists() and not output.is_dir():
        raise PackPathError(f"output path '{output}' is a file; give a folder for the comparison result")
    if output.is_dir():
        foreign = sorted(p.name for p in output.iterdir() if p.name not in _OWN)
        if foreign:
            raise PackPathError(f"output path '{output}' holds files that are not a config_check result "
                                f"({', '.join(foreign[:5])}); it is not deleted: choose an empty or new folder")
        resolved = output.resolve()
        for p in inputs:
            if resolved == p.resolve() or resolved in p.resolve().parents:
                raise PackPathError(f"output path '{output}' contains the input pack '{p}'; choose another folder")
        shutil.rmtree(output)
    output.mkdir(parents=True)


def _write_xlsx(path: Path, results: list[CheckResult], bench: str, cmp: str) -> None:
    from openpyxl import Workbook
    from openpyxl.styles import Font, PatternFill

    bold = Font(bold=True)
    fills = {"fail": PatternFill("solid", fgColor="FFC7CE"), "pass": PatternFill("solid", fgColor="C6EFCE"),
             "error": PatternFill("solid", fgColor="FFC7CE"), "info": PatternFill("solid", fgColor="FFEB9C")}
    wb = Workbook()
    ws = wb.active
    ws.title = "summary"
    ws.append(["check", "result", "differences", "note"])
    for r in results:
        ws.append([r.name, r.status, len(r.rows), r.note])
        ws.cell(ws.max_row, 2).fill = fills.get(r.status, PatternFill())
    ws.append([])
    ws.append(["bench", bench])
    ws.append(["cmp", cmp])
    ws.append(["overall", "pass" if overall_pass(results) else "fail"])
    for cell in ws[1]:
        cell.font = bold
    for col, width in zip("ABCD", (18, 10, 12, 80)):
        ws.column_dimensions[col].width = width
    for r in results:
        sheet = wb.create_sheet(r.name)
        sheet.append(r.header)
        level = r.header.index("level") + 1 if "level" in r.header else None
        for row in r.rows:
            sheet.append([cell_value(v) for v in row])
            if level:
                fill = fills.get(row[level - 1])
                if fill:
                    sheet.cell(sheet.max_row, level).fill = fill
        for i, name in enumerate(r.header, start=1):
            sheet.cell(1, i).font = bold
            sheet.column_dimensions[sheet.cell(1, i).column_letter].width = _WIDTHS.get(name, 16)
        sheet.freeze_panes = "A2"
        if r.rows:
            sheet.auto_filter.ref = sheet.dimensions
    tmp = path.with_name(f".{path.name}.tmp")
    wb.save(tmp)
    os.replace(tmp, path)


def compare_packs(bench_zip_path: str | os.PathLike, cmp_zip_path: str | os.PathLike,
                  output_path: str | os.PathLike = DEFAULT_OUTPUT) -> list[CheckResult]:
    """Compare two packs (zips, or folders holding extracted ones) into ``output_path``; returns the
    checks' results (``checks.overall_pass`` tells whether the runs' configurations agree)."""
    bench_src, cmp_src, output = Path(bench_zip_path), Path(cmp_zip_path), Path(output_path)
    for p in (bench_src, cmp_src):  # fail before anything is deleted
        if not pack.is_pack(p):
            raise PackInputError(f"'{p}' is not a config_check pack (a zip written by `config_check -d` or "
                                 "ConfigChecker, holding pack.json)")
    _prepare_output(output, [bench_src, cmp_src])
    bench = pack.PackFolder(pack.extract(bench_src, output / "bench"))
    cmp = pack.PackFolder(pack.extract(cmp_src, output / "cmp"))
    results = run_checks(bench, cmp)
    _write_xlsx(output / RESULT_FILE, results, str(bench_src), str(cmp_src))
    return results


def summary_text(results: list[CheckResult], output: str | os.PathLike) -> str:
    """The lines the CLI prints."""
    lines = [f"{r.name:<16} {r.status:<8} {len(r.rows):>5} difference(s)  {r.note}".rstrip() for r in results]
    verdict = "PASS: the two runs' configurations agree" if overall_pass(results) else \
        "FAIL: " + ", ".join(r.name for r in results if r.status == FAIL) + " differ"
    return "\n".join([*lines, verdict, f"result: {Path(output) / RESULT_FILE}"])
