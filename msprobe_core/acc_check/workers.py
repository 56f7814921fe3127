"""``multi_acc_check``: the API calls of one dump split over worker processes (framework-neutral).

One worker per ``-d`` ID: on a machine with accelerators worker ``k`` runs on device ``ID``; without
one, the IDs only name CPU worker processes, which share the CPUs (each gets CPUs / workers threads).
Workers take the next unchecked call from a shared counter (a slow call does not hold the others up),
the costliest calls first, so that the last ones handed out are small and the workers finish together;
and each writes its own ``accuracy_checking_result_{timestamp}.csv`` / ``..._details_...`` in its own
folder ``OUT/device{ID}_{timestamp}/``; a run never writes into another run's folders.

Resuming (``-csv_path`` = the result CSV of any worker of the interrupted run): every worker folder of
that run (same timestamp) is cut back to its last complete call, the calls any of them finished are
skipped, and each new worker appends to the folder of its ID (a new ID gets a new folder of that run).
"""

from __future__ import annotations

import queue as queue_module
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from msprobe_core.acc_check.fork_server import worker_context
from msprobe_core.acc_check.api_calls import ApiCall, load_dump
from msprobe_core.acc_check.replay import load_backend, prefer_passive_openmp
from msprobe_core.acc_check.results import RESULT_PREFIX, ResultFiles, check_result_csv, timestamp
from msprobe_core.acc_check.runner import RunSummary, check_call, check_resumable, cpu_seconds, failing_line
from msprobe_core.acc_check.standards import ERROR
from msprobe_core.errors import ConfigError, DumpPathError
from msprobe_core.log import setup_logging

_POLL_S = 0.5


@dataclass
class _Job:
    framework: str
    calls: list[ApiCall]   # the calls to check, in the order the workers take them
    folder: str
    stamp: str
    device: int
    workers: int
    done: frozenset
    save_error_data: bool


@dataclass
class MultiResult:
    """The workers' summaries, and whether every worker finished."""

    workers: list[RunSummary]
    complete: bool = True
    died: list[str] = field(default_factory=list)

    def text(self) -> str:
        counts = sum((w.counts for w in self.workers), start=Counter())
        failed = [n for w in self.workers for n in w.failed]
        workers = f"{len(self.workers)} worker{'s' if len(self.workers) > 1 else ''}"
        cpu = " + ".join(f"{w.cpu_s:.1f}" for w in self.workers)
        lines = [f"multi_acc_check: {workers} checked {sum(counts.values())} API calls: "
                 f"{counts['pass']} pass, {counts['error']} error, {counts['skip']} skip (not replayable); "
                 f"workers' CPU time {cpu} s"]
        if failed:
            lines.append(failing_line(failed))
        lines += [f"worker {w.result_csv.parent.name}: {w.result_csv}" for w in self.workers]
        lines += [f"worker {d} died before finishing; rerun with -csv_path to check what it left" for d in self.died]
        return "\n".join(lines)


def _worker(job: _Job, counter, messages) -> None:
    """One worker process: check calls taken from the shared counter, report each on ``messages``."""
    backend = load_backend(job.framework, job.device, job.workers)
    files = ResultFiles(Path(job.folder), job.stamp, set(job.done))
    try:
        while True:
            with counter.get_lock():
                index = counter.value
                counter.value += 1
            if index >= len(job.calls):
                break
            call = job.calls[index]
            messages.put((job.device, call.name, check_call(call, backend, files, job.save_error_data)))
    finally:
        files.close()
        messages.put((job.device, None, cpu_seconds()))


def _work_order(calls: Sequence[ApiCall], done: set, workers: int) -> list[ApiCall]:
    """The calls still to check in the order the workers take them: the dump's for one worker; for several,
    the costliest first (by the elements of their tensors), so the tail is made of small calls."""
    todo = [c for c in calls if c.name not in done]
    if workers > 1:
        todo.sort(key=lambda c: -sum(s.numel for s in (*c.input_tensors(), *c.output_tensors())))
    return todo


def _check_devices(devices: Sequence[int]) -> list[int]:
    devices = list(devices)
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise ConfigError("-d", devices, "distinct device IDs >= 0, e.g. -d 0 1")
    return devices


def _folder_name(device: int, stamp: str) -> str:
    return f"device{device}_{stamp}"


def _new_run(out: Path, devices: list[int]) -> tuple[str, dict[int, ResultFiles]]:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DumpPathError(f"-o {str(out)!r}: cannot create the output folder ({e.strerror})") from None
    base = timestamp()
    for n in range(1000):
        stamp = base if n == 0 else f"{base}_{n}"
        folders = [out / _folder_name(d, stamp) for d in devices]
        if any(f.exists() for f in folders):
            continue
        try:
            for f in folders:
                f.mkdir()
        except FileExistsError:  # another run took this stamp meanwhile
            continue
        return stamp, {d: ResultFiles.create(f, stamp) for d, f in zip(devices, folders)}
    raise DumpPathError(f"{out}: no free device*_{base}* folder name")


def _resumed_run(result_csv: Path, devices: list[int]) -> tuple[str, dict[int, ResultFiles], set]:
    stamp, _ = check_result_csv(result_csv)
    run_dir = result_csv.parent.parent
    pattern = re.compile(rf"^device(\d+)_{re.escape(stamp)}$")
    files: dict[int, ResultFiles] = {}
    done: set = set()
    for folder in sorted(run_dir.iterdir()):
        m = pattern.match(folder.name)
        if m and (folder / f"{RESULT_PREFIX}{stamp}.csv").is_file():
            resumed = ResultFiles.resume(folder / f"{RESULT_PREFIX}{stamp}.csv")
            done |= resumed.done
            files[int(m.group(1))] = resumed
    if result_csv.parent not in {f.folder for f in files.values()}:
        raise DumpPathError(f"-csv_path {str(result_csv)!r}: not in a multi_acc_check worker folder "
                            f"(device{{ID}}_{stamp}); resume an acc_check run with acc_check")
    for d in devices:
        if d not in files:
            folder = run_dir / _folder_name(d, stamp)
            folder.mkdir()
            files[d] = ResultFiles.create(folder, stamp)
    return stamp, files, done


def multi_acc_check(api_info: Union[str, Path], devices: Sequence[int] = (0,), out_path: Union[str, Path] = "./",
                    result_csv_path: Optional[Union[str, Path]] = None, save_error_data: bool = False) -> MultiResult:
    """Check every API call of ``api_info`` with one worker process per device ID; see the module docstring."""
    from msprobe_core.acc_check.progress import Progress

    log = setup_logging()
    devices = _check_devices(devices)
    dump = load_dump(api_info)
    backend = prefer_passive_openmp(dump.framework)  # checks the framework before any folder is made
    if result_csv_path:
        stamp, files, done = _resumed_run(Path(result_csv_path), devices)
        check_resumable(dump, done, Path(result_csv_path))
    else:
        (stamp, files), done = _new_run(Path(out_path), devices), set()
    for f in files.values():
        f.close()  # the workers append to them
    summaries = {d: RunSummary(files[d].result_path, files[d].details_path) for d in devices}
    log.info("multi_acc_check: %d API calls of %s over %d workers (%s)", len(dump.calls), dump.path, len(devices),
             ", ".join(str(files[d].folder) for d in devices))
    result = MultiResult([summaries[d] for d in devices])
    if len(done) >= len(dump.calls):
        log.info("multi_acc_check: every API call is done already")
        return result
    context = worker_context(backend)  # already running when the command started it (``fork_server.start_early``)
    counter = context.Value("q", 0)
    messages = context.Queue()
    calls = _work_order(dump.calls, done, len(devices))
    processes = {d: context.Process(target=_worker, name=f"acc_check-device{d}", daemon=True,
                                    args=(_Job(dump.framework, calls, str(files[d].folder), stamp, d, len(devices),
                                               frozenset(done), save_error_data), counter, messages))
                 for d in devices}
    for p in processes.values():
        p.start()
    progress = Progress(len(dump.calls), desc="multi_acc_check", initial=len(done))
    running = set(devices)
    try:
        while running:
            try:
                device, name, status = messages.get(timeout=_POLL_S)
            except queue_module.Empty:
                for d in list(running):
                    if not processes[d].is_alive() and processes[d].exitcode not in (0, None):
                        running.discard(d)
                        result.complete = False
                        result.died.append(f"device{d} (exit code {processes[d].exitcode})")
                continue
            if name is None:  # the worker finished; ``status`` is its CPU time
                running.discard(device)
                summaries[device].cpu_s = status
                continue
            summaries[device].counts[status] += 1
            if status == ERROR:
                summaries[device].failed.append(name)
            progress.update()
    finally:
        progress.close()
        for p in processes.values():
            p.join(timeout=30)
    for d, p in processes.items():
        if p.exitcode != 0 and not any(x.startswith(f"device{d} ") for x in result.died):
            result.complete = False
            result.died.append(f"device{d} (exit code {p.exitcode})")
    return result
