"""The layout of a dump folder: rank folders, step folders and whole dump paths.

A *rank folder* (``step0/rank0`` or ``step0/proc1234``) holds ``dump.json`` (``debug.json`` for
``save()``'s records), ``stack.json``, ``construct.json`` and, for task ``tensor``, ``dump_tensor_data/``.
A *step folder* holds rank folders; a *dump path* holds step folders. ``discover`` says which of the three a
path is and lists its rank folders; anything that is not a dump is a ``DumpInputError`` naming the path.
The file names are the ones the dump writes (``files.step_recorder``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from msprobe_core.errors import DumpInputError
from msprobe_core.files.step_recorder import JOURNAL_SUFFIX, JSON_NAMES

JOURNAL_GLOB = f".*{JOURNAL_SUFFIX}"
STEP_RE = re.compile(r"^step(\d+)$")
RANK_RE = re.compile(r"^(rank|proc)(\d*)$")
RECOVER_HINT = "run `python -m msprobe_core recover {path}` to rebuild it from the crash journal"


@dataclass(frozen=True)
class DumpUnit:
    """One rank folder found under a path given on the command line."""

    step: Optional[str]
    rank: Optional[str]
    path: Path

    @property
    def label(self) -> str:
        """``step0/rank1``, or the folder name when the path given was the rank folder itself."""
        parts = [p for p in (self.step, self.rank) if p]
        return "/".join(parts) if parts else self.path.name


def _number_key(name: str) -> tuple[int, str]:
    digits = re.search(r"(\d+)$", name)
    return (int(digits.group(1)) if digits else -1, name)


def _sorted_dirs(path: Path, pattern: re.Pattern) -> list[Path]:
    dirs = [d for d in path.iterdir() if d.is_dir() and pattern.match(d.name)]
    return sorted(dirs, key=lambda d: _number_key(d.name))


def _is_rank_folder(path: Path) -> bool:
    return any((path / n).is_file() for n in JSON_NAMES) or any(path.glob(JOURNAL_GLOB))


def discover(path: Path) -> tuple[str, list[DumpUnit]]:
    """Classify ``path`` as ``rank``, ``step`` or ``dump`` level and list its rank folders."""
    path = Path(path)
    if not path.exists():
        raise DumpInputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name in JSON_NAMES:
            path = path.parent
        else:
            raise DumpInputError(f"{path}: not a dump (expected a dump folder or its dump.json)")
    if _is_rank_folder(path):
        return "rank", [DumpUnit(None, None, path)]
    ranks = _sorted_dirs(path, RANK_RE)
    if ranks:
        return "step", [DumpUnit(None, r.name, r) for r in ranks]
    steps = _sorted_dirs(path, STEP_RE)
    if steps:
        units = []
        for step in steps:
            step_ranks = _sorted_dirs(step, RANK_RE)
            if not step_ranks:
                raise DumpInputError(f"{step}: step folder without rank*/proc* folders")
            units.extend(DumpUnit(step.name, r.name, r) for r in step_ranks)
        return "dump", units
    raise DumpInputError(f"{path}: not a dump (expected dump.json, rank*/proc* folders, or step* folders)")


def check_finished(path: Path) -> None:
    """Raise ``DumpInputError`` unless the rank folder ``path`` holds a dump.json."""
    if any((path / n).is_file() for n in JSON_NAMES):
        return
    if any(path.glob(JOURNAL_GLOB)):
        raise DumpInputError(f"{path}: not a finished dump (a crash journal but no dump.json); "
                             + RECOVER_HINT.format(path=_dump_root(path)))
    raise DumpInputError(f"{path}: not a dump (no dump.json)")


def _dump_root(rank_dir: Path) -> Path:
    step_dir = rank_dir.parent
    return step_dir.parent if STEP_RE.match(step_dir.name) else rank_dir
