"""The fork server multi_acc_check's workers start from (light: imports neither NumPy nor a framework).

The server imports the replay backend (and its framework: ~1.2 s for torch) once; every worker is a fork of
it. That import is the serial part of a multi_acc_check run, so ``start_early`` begins it before the
command imports the rest of acc_check and reads the dump, which then run beside it.
"""

from __future__ import annotations

import multiprocessing
import re
from multiprocessing import forkserver
from pathlib import Path
from typing import Optional, Union

from msprobe_core.acc_check.replay import BACKENDS, BackendInfo, prefer_passive_openmp

WORKER_MODULE = "msprobe_core.acc_check.workers"
"""The module holding the workers' entry point, imported by the server with the backend."""
_HEAD_BYTES = 4096
_FRAMEWORK = re.compile(r'"framework"\s*:\s*"([^"]+)"')


def worker_context(backend: BackendInfo):
    """The multiprocessing context of the workers: a fork server that imported the backend (and its framework)
    and ``backend.preload``, started now (``spawn`` where there is no fork server). Neither inherits anything
    the parent did with the framework (CUDA contexts, OpenMP thread pools). Call ``prefer_passive_openmp``
    first: the server keeps the environment it starts with."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([backend.module, *backend.preload, WORKER_MODULE])
    forkserver.ensure_running()
    return context


def recorded_framework(api_info: Union[str, Path]) -> Optional[str]:
    """dump.json's "framework" field read from the file's head (the dumpers write it before "data"), or None
    when it is not there (``records.load_dump`` decides then)."""
    try:
        with open(api_info, "rb") as f:
            head = f.read(_HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    match = _FRAMEWORK.search(head.split('"data"', 1)[0])
    return match.group(1) if match else None


def start_early(api_info: Union[str, Path]) -> None:
    """Start the fork server for the framework of ``api_info`` now, if its head names a known one; nothing
    otherwise (``multi_acc_check`` starts it after reading the dump)."""
    framework = recorded_framework(api_info)
    if framework in BACKENDS:
        worker_context(prefer_passive_openmp(framework))
