"""The two CSV files of a run (seed 002's names and columns) and resuming an interrupted run.

``accuracy_checking_result_{timestamp}.csv``: API Name, Forward Test Success, Backward Test Success,
Message; one row per API call (``pass``, ``error``, or ``skip`` for calls that cannot be replayed,
with the reason in Message; Backward Test Success is empty when the call has no backward).
``accuracy_checking_details_{timestamp}.csv``: API Name, Bench Dtype, Tested Dtype, Shape, Cosine,
MaxAbsErr, MaxRelativeErr, Status, Message; one row per compared output
(``Functional.linear.0.forward.output.0``) and per input gradient (``Functional.linear.0.backward.output.1``,
numbered like the dump's backward records).

A call's detail rows are written before its result row, each file in one write and flushed, so after a
crash (even SIGKILL) every call listed in the result file is complete. ``ResultFiles.resume`` cuts what
follows the last complete call (a half-written line, detail rows of a call without a result row) and
returns the calls already done; the run then appends, and the final files are the same as those of an
uninterrupted run. New files are created exclusively: another run's files are never overwritten.
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

from msprobe_core.errors import DumpInputError, DumpPathError

RESULT_HEADER = ["API Name", "Forward Test Success", "Backward Test Success", "Message"]
DETAILS_HEADER = ["API Name", "Bench Dtype", "Tested Dtype", "Shape", "Cosine", "MaxAbsErr", "MaxRelativeErr",
                  "Status", "Message"]
RESULT_PREFIX = "accuracy_checking_result_"
DETAILS_PREFIX = "accuracy_checking_details_"
_RESULT_RE = re.compile(r"^accuracy_checking_result_(.+)\.csv$")
_DETAIL_CALL_RE = re.compile(r"^(.*)\.(?:forward|backward)\.output(?:\..*)?$")


def timestamp() -> str:
    """The run's timestamp as msprobe writes it: ``%Y%m%d%H%M%S``."""
    return time.strftime("%Y%m%d%H%M%S")


def _line(row: Sequence[object]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else str(v).replace("\n", " ") for v in row])
    return buf.getvalue()


def detail_call(api_name: str) -> str:
    """The call a details row belongs to: ``Functional.linear.0.backward.output.1`` -> ``Functional.linear.0``."""
    m = _DETAIL_CALL_RE.match(api_name)
    return m.group(1) if m else api_name


class ResultFiles:
    """The result and details CSV files of one run (or one worker of a multi_acc_check run)."""

    def __init__(self, folder: Path, stamp: str, done: Optional[set] = None):
        self.folder = folder
        self.stamp = stamp
        self.result_path = folder / f"{RESULT_PREFIX}{stamp}.csv"
        self.details_path = folder / f"{DETAILS_PREFIX}{stamp}.csv"
        self.done: set = done if done is not None else set()
        self._result = open(self.result_path, "a", encoding="utf-8", newline="")
        self._details = open(self.details_path, "a", encoding="utf-8", newline="")

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(cls, folder: Path, stamp: Optional[str] = None) -> "ResultFiles":
        """New files in ``folder`` (created if missing) named by ``stamp`` (default: now); a stamp whose files
        exist already gets a ``_1``, ``_2``... suffix instead of overwriting them."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DumpPathError(f"-o {str(folder)!r}: cannot create the output folder ({e.strerror})") from None
        if not folder.is_dir():
            raise DumpPathError(f"-o {str(folder)!r}: not a folder")
        base = stamp or timestamp()
        for n in range(1000):
            candidate = base if n == 0 else f"{base}_{n}"
            try:
                with open(folder / f"{RESULT_PREFIX}{candidate}.csv", "x", encoding="utf-8", newline="") as f:
                    f.write(_line(RESULT_HEADER))
            except FileExistsError:
                continue
            try:
                with open(folder / f"{DETAILS_PREFIX}{candidate}.csv", "x", encoding="utf-8", newline="") as f:
                    f.write(_line(DETAILS_HEADER))
            except FileExistsError:
                os.unlink(folder / f"{RESULT_PREFIX}{candidate}.csv")
                continue
            return cls(folder, candidate)
        raise DumpPathError(f"{folder}: no free name for accuracy_checking_result_{base}*.csv")

    @classmethod
    def resume(cls, result_csv: Path) -> "ResultFiles":
        """Reopen an interrupted run's files (``-csv_path``): cut any incomplete tail, remember what is done."""
        stamp, details = check_result_csv(result_csv)
        done = _cut_result_tail(result_csv)
        _cut_details_tail(details, done)
        return cls(result_csv.parent, stamp, done)

    # ------------------------------------------------------------------ writing
    def write(self, api_name: str, forward: str, backward: str, message: str,
              details: Iterable[Sequence[object]] = ()) -> None:
        """One call: its details rows, then its result row (each file written once and flushed)."""
        rows = "".join(_line(r) for r in details)
        if rows:
            self._details.write(rows)
            self._details.flush()
        self._result.write(_line([api_name, forward, backward, message]))
        self._result.flush()
        self.done.add(api_name)

    def close(self) -> None:
        self._result.close()
        self._details.close()


def check_result_csv(result_csv: Path) -> tuple[str, Path]:
    """The timestamp and details file of a result CSV given as ``-csv_path``; ``DumpInputError`` when it is
    not one this tool wrote."""
    m = _RESULT_RE.match(result_csv.name)
    if not m:
        raise DumpInputError(f"-csv_path {str(result_csv)!r}: expected an accuracy_checking_result_{{timestamp}}.csv "
                             "file of an interrupted run")
    if not result_csv.is_file():
        raise DumpInputError(f"-csv_path {str(result_csv)!r}: no such file")
    details = result_csv.parent / f"{DETAILS_PREFIX}{m.group(1)}.csv"
    if not details.is_file():
        raise DumpInputError(f"-csv_path {str(result_csv)!r}: its details file {details.name} is missing next to it")
    for path, header in ((result_csv, RESULT_HEADER), (details, DETAILS_HEADER)):
        with open(path, encoding="utf-8", newline="") as f:
            first = next(csv.reader([f.readline()]), [])
        if first != header:
            raise DumpInputError(f"-csv_path: {path} does not start with the header {','.join(header)} "
                                 "(was it modified?)")
    return m.group(1), details


def _complete_lines(path: Path) -> tuple[list[str], int]:
    """The file's complete lines and the byte length they take (a half-written last line is left out)."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode("utf-8").splitlines(keepends=True), end


def _cut_result_tail(path: Path) -> set:
    lines, end = _complete_lines(path)
    done = set()
    for row in csv.reader(lines[1:]):
        if len(row) == len(RESULT_HEADER):
            done.add(row[0])
    os.truncate(path, end)
    return done


def _cut_details_tail(path: Path, done: set) -> None:
    lines, end = _complete_lines(path)
    offset = len(lines[0].encode("utf-8")) if lines else 0
    for line in lines[1:]:
        row = next(csv.reader([line]), [])
        if not row or detail_call(row[0]) not in done:
            end = offset
            break
        offset += len(line.encode("utf-8"))
    os.truncate(path, end)
