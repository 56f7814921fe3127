"""Checking a dump's API calls: replay each, judge every output, write the CSV rows (framework-neutral).

``acc_check()`` is the whole single-process run behind ``python -m msprobe_core acc_check``;
``check_call()`` is one call, shared with the workers of ``multi_acc_check``. A call that cannot be
replayed, or whose replay raises anything, is written as ``skip`` with the reason: one failing call
never stops the run.
"""

from __future__ import annotations

import math
import resource
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from msprobe_core.acc_check.api_calls import LOW_PRECISION, ApiCall, DumpFile, load_dump
from msprobe_core.acc_check.replay import OutputPair, Replay, ReplayBackend, Unreplayable, load_backend
from msprobe_core.acc_check.results import ResultFiles
from msprobe_core.acc_check.standards import ERROR, PASS, SKIP, judge
from msprobe_core.errors import DumpInputError
from msprobe_core.log import setup_logging

ERROR_DATA_DIR = "error_data"


@dataclass
class RunSummary:
    """What one run (or one worker) wrote and how its calls fared."""

    result_csv: Path
    details_csv: Path
    counts: Counter = field(default_factory=Counter)   # pass / error / skip, calls checked by this run
    failed: list[str] = field(default_factory=list)
    already_done: int = 0
    cpu_s: float = 0.0   # CPU time of the process that checked them

    def text(self) -> str:
        """The closing lines printed by the commands."""
        checked = sum(self.counts.values())
        lines = [f"acc_check: {checked} API calls checked: {self.counts[PASS]} pass, {self.counts[ERROR]} error, "
                 f"{self.counts[SKIP]} skip (not replayable)"
                 + (f"; {self.already_done} were done before (resumed)" if self.already_done else "")
                 + f"; CPU time {self.cpu_s:.1f} s"]
        if self.failed:
            lines.append(failing_line(self.failed))
        lines.append(f"results: {self.result_csv}")
        lines.append(f"details: {self.details_csv}")
        return "\n".join(lines)


def failing_line(names: Sequence[str], shown: int = 10) -> str:
    """``failing APIs: a, b, ... and N more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"failing APIs: {', '.join(names[:shown])}{more}"


def _num(x: Optional[float]) -> str:
    if x is None:
        return ""
    return "nan" if math.isnan(x) else f"{x:.10g}"


def _judge_pairs(pairs: Sequence[OutputPair]) -> tuple[list[list[object]], list[str], bool]:
    """Details rows, failure messages, and whether a float16/bfloat16 pair failed without its reference."""
    rows, failing, unreferenced = [], [], False
    for pair in pairs:
        verdict = judge(pair.tested, pair.bench, pair.precision, pair.reference)
        message = "; ".join(m for m in (verdict.message, pair.note) if m)
        rows.append([pair.name, pair.bench_dtype, pair.tested_dtype, str(list(pair.tested.shape)), _num(verdict.cosine),
                     _num(verdict.max_abs), _num(verdict.max_rel), verdict.status, message])
        if verdict.status == ERROR:
            failing.append(f"{pair.name}: {verdict.failure}")
            unreferenced = unreferenced or (pair.precision in LOW_PRECISION and pair.reference is None)
    return rows, failing, unreferenced


def _judge(replay: Replay) -> tuple[tuple[list, list], tuple[list, list]]:
    """(details rows, failures) of the forward and of the backward pairs. A float16/bfloat16 output is first
    judged against the correctly rounded benchmark, which no computation in that dtype beats: only when one
    fails there does the replay's in-dtype reference run, and the pairs are judged again against it."""
    forward, backward = _judge_pairs(replay.forward), _judge_pairs(replay.backward or [])
    if (forward[2] or backward[2]) and replay.reference is not None:
        try:
            replay.reference()
        except Exception as e:  # noqa: BLE001 - the verdict against the correctly rounded result stands
            replay.notes.append(f"no in-dtype reference ({type(e).__name__}: {e})")
        else:
            forward, backward = _judge_pairs(replay.forward), _judge_pairs(replay.backward or [])
    return forward[:2], backward[:2]


def check_call(call: ApiCall, backend: ReplayBackend, files: ResultFiles, save_error_data: bool = False) -> str:
    """Replay, judge and write one call; returns its overall status (pass, error or skip)."""
    reason = call.problem or backend.unreplayable(call)
    if not reason:
        try:
            return _check_replayable(call, backend, files, save_error_data)
        except Unreplayable as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - one failing call never stops the run
            reason = f"replay failed: {type(e).__name__}: {e}"
    files.write(call.name, SKIP, "", reason)
    return SKIP


def _check_replayable(call: ApiCall, backend: ReplayBackend, files: ResultFiles, save_error_data: bool) -> str:
    replay = backend.replay(call, keep_data=save_error_data)
    (rows, failing), (backward_rows, backward_failing) = _judge(replay)
    if replay.forward_failure:
        forward = ERROR
    elif replay.forward:
        forward = ERROR if failing else PASS
    else:
        forward = SKIP
        replay.notes.append("no tensor or number output to compare")
    if replay.backward_skip:
        backward = SKIP
    elif replay.backward_failure or backward_failing:
        backward = ERROR
    else:
        backward = PASS if replay.backward else ""
    messages = [replay.forward_failure, replay.backward_failure, replay.backward_skip, *failing, *backward_failing,
                *replay.notes]
    if save_error_data and ERROR in (forward, backward) and replay.save is not None:
        folder = files.folder / ERROR_DATA_DIR / files.stamp
        try:
            replay.save(folder, backward == ERROR)
        except OSError as e:
            messages.append(f"error data not saved ({e.strerror})")
    files.write(call.name, forward, backward, "; ".join(m for m in messages if m), rows + backward_rows)
    return ERROR if ERROR in (forward, backward) else (PASS if PASS in (forward, backward) else SKIP)


def check_calls(calls: Sequence[ApiCall], backend: ReplayBackend, files: ResultFiles, save_error_data: bool,
                on_checked: Callable[[str, str], None]) -> None:
    """Check every call ``files`` does not list as done yet, in order; ``on_checked(name, status)`` after each."""
    for call in calls:
        if call.name not in files.done:
            on_checked(call.name, check_call(call, backend, files, save_error_data))


def open_files(out_path: Union[str, Path], result_csv_path: Optional[Union[str, Path]]) -> ResultFiles:
    """New result files in ``out_path``, or an interrupted run's files reopened when ``result_csv_path`` is given."""
    if result_csv_path:
        return ResultFiles.resume(Path(result_csv_path))
    return ResultFiles.create(Path(out_path))


def check_resumable(dump: DumpFile, done: set, result_csv: Path) -> None:
    """A ``-csv_path`` of another dump would silently mix results: refuse it."""
    stray = done - {c.name for c in dump.calls}
    if stray:
        raise DumpInputError(f"-csv_path {str(result_csv)!r} lists {len(stray)} API calls this dump does not have "
                             f"(e.g. {sorted(stray)[0]}): it belongs to another dump")


def acc_check(api_info: Union[str, Path], out_path: Union[str, Path] = "./",
              result_csv_path: Optional[Union[str, Path]] = None, save_error_data: bool = False) -> RunSummary:
    """Replay every API call of ``api_info`` (a dump.json) and write the two CSV files; see the package docs."""
    from msprobe_core.acc_check.progress import Progress

    log = setup_logging()
    dump = load_dump(api_info)
    backend = load_backend(dump.framework)
    files = open_files(out_path, result_csv_path)
    try:
        check_resumable(dump, files.done, files.result_path)
        mode = "real data" if dump.has_tensor_data else "random inputs"
        log.info("acc_check: %d API calls of %s (%s) on %s; %d non-API records skipped", len(dump.calls),
                 dump.path, mode, backend.device, dump.skipped_records)
        summary = RunSummary(files.result_path, files.details_path, already_done=len(files.done))
        progress = Progress(len(dump.calls), initial=len(files.done))

        def checked(name: str, status: str) -> None:
            summary.counts[status] += 1
            if status == ERROR:
                summary.failed.append(name)
            progress.update()

        try:
            check_calls(dump.calls, backend, files, save_error_data, checked)
        finally:
            progress.close()
    finally:
        files.close()
    summary.cpu_s = cpu_seconds()
    return summary


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
