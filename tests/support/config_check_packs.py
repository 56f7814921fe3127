"""Editing config_check packs in tests: ``edit_pip`` fakes package versions, as if the pack came from another
machine."""

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
