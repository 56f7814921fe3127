"""Rank folder naming: where one process writes inside a step folder or the monitor's output folder.

``rank{R}`` for a process with a rank (``torch.distributed``'s global rank, or one given explicitly with
``start(rank_id=...)``), ``proc{pid}`` for a process without one (msprobe's layout:
``dump_path/step{N}/rank{R}/dump.json``, ``MONITOR_OUTPUT_DIR/rank{R}/``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from msprobe_core.common.output_dir import check_output_dir
from msprobe_core.errors import DumpPathError


def rank_folder_name(rank: Optional[int]) -> str:
    """``rank{rank}``, or ``proc{pid}`` of this process when ``rank`` is None."""
    return f"rank{rank}" if rank is not None else f"proc{os.getpid()}"


def check_not_taken(dump_path: str | os.PathLike, folder: str) -> None:
    """Raise ``DumpPathError`` when ``dump_path`` is a file, already holds a non-empty ``step*/{folder}``
    (another run's dump of this rank: a dump never overwrites another run's files), or cannot be created
    or written (checked when the dump starts, not at its first record)."""
    root = Path(dump_path)
    if root.exists() and not root.is_dir():
        raise DumpPathError(f"dump_path '{root}' is a file; allowed: a directory or a path that does not exist yet")
    taken = sorted(p for p in root.glob(f"step*/{folder}") if p.is_dir() and any(p.iterdir())) if root.is_dir() else []
    if taken:
        raise DumpPathError(
            f"dump_path '{root}' already holds a dump for {folder} ({taken[0]}); a dump never "
            "overwrites another run's files: choose a new dump_path or remove the old dump")
    check_output_dir(root, "dump_path", DumpPathError)
