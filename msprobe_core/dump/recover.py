"""``python -m msprobe_core recover DUMP_PATH``: finish the steps a crashed run left unfinished.

A run killed mid-step (even by SIGKILL) leaves each unfinished rank folder with a ``.dump.journal`` of
every record made so far; this command rebuilds dump.json (or debug.json), stack.json and construct.json
from it. Finished folders are left untouched.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from msprobe_core.files.journal import SPARE_SUFFIX
from msprobe_core.files.step_recorder import JOURNAL_SUFFIX, recover_journal
from msprobe_core.errors import DumpInputError


def recover(dump_path: str | os.PathLike) -> list[Path]:
    """Recover every rank folder under ``dump_path`` that still has a journal; returns those folders. Spare
    journals a killed process left (``files/journal.py``) are removed.

    A journal that cannot be used (unreadable, or not this tool's) does not stop the others: they are
    recovered first, then one ``DumpInputError`` names every journal left as it was."""
    root = Path(dump_path)
    if not root.is_dir():
        raise DumpInputError(f"dump path '{root}' is not a directory")
    for spare in root.rglob(f".*{JOURNAL_SUFFIX}{SPARE_SUFFIX}"):  # a killed process's spare journal: no records
        spare.unlink(missing_ok=True)
    recovered = []
    problems = []
    for journal in sorted(root.rglob(f".*{JOURNAL_SUFFIX}")):
        try:
            done = recover_journal(journal)
        except DumpInputError as e:
            problems.append(str(e))
            continue
        if done and journal.parent not in recovered:
            recovered.append(journal.parent)
    if problems:
        done_text = f"recovered {len(recovered)} folder(s); " if recovered else ""
        raise DumpInputError(done_text + "; ".join(problems))
    return recovered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_path", help="a dump_path, step folder or rank folder of an interrupted run")


def run(args: argparse.Namespace) -> int:
    folders = recover(args.dump_path)
    if not folders:
        print(f"nothing to recover under {args.dump_path}: every step folder is finished")
    for folder in folders:
        print(f"recovered {folder}")
    return 0
