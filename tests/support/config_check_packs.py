"""config_check packs in tests: ``edit_pip`` fakes package versions, as if the pack came from another
machine; ``compare_packs`` runs the compare command and reads its summary."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path


def edit_pip(path: Path, versions: dict[str, str]) -> None:
    """Set ``versions`` ({package: version}) in the pack's ``pip.json``, rewriting the zip in place."""
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    pip = json.loads(members["pip.json"])
    pip["packages"].update(versions)
    members["pip.json"] = json.dumps(pip).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


CHECKS = ("env", "pip", "hyperparameters", "weights", "dataset", "random")


def compare_packs(bench: str, cmp: str, out: Path, status: int) -> dict:
    """``python -m msprobe_core config_check -c bench cmp -o out`` (its exit status checked); the result's
    summary sheet as {check: outcome}, every check present."""
    import openpyxl

    from msprobe_core.cli import main

    assert main(["config_check", "-c", str(bench), str(cmp), "-o", str(out)]) == status
    sheet = openpyxl.load_workbook(out / "result.xlsx")["summary"]
    summary = {row[0]: row[1] for row in sheet.iter_rows(min_row=2, values_only=True) if row[0] in CHECKS}
    assert set(summary) == set(CHECKS), summary
    return summary
