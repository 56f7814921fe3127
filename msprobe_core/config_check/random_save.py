"""msprobe's ``random_save(output_path="./output")``: where the model calls randomness APIs, as a CSV.

Call it once near the top of the training script (before the model is built, so that ``nn.init`` is seen)::

    from msprobe_core.pytorch import random_save
    random_save(output_path="./output")

Every random API call goes through the recording wrappers of ``random_patch`` (torch's random functions
and in-place ``Tensor.uniform_`` / ``normal_`` / ..., ``torch.nn.functional.dropout`` and friends,
``numpy.random.*``, Python's ``random.*``), which call the original with the same arguments: the numbers
drawn do not change. Each distinct call site (API and the first frame outside the libraries) becomes one
row of ``{output_path}/random_{rank|proc}_{timestamp}.csv`` (``random_rank0_...`` once
``torch.distributed`` is initialised, else ``random_proc{pid}_...``) with msprobe's columns ``api_name``
and ``stack`` (stack.json's frame format, innermost last). Rows are appended and flushed as sites are
found, so a crash loses none; a forked worker process writes its own file.
"""

from __future__ import annotations

import csv
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

from msprobe_core.common.rank_folder import rank_folder_name
from msprobe_core.config_check.random_patch import RECORDER, apply_patches
from msprobe_core.errors import ConfigError
from msprobe_core.files.call_stack import format_frame

logger = logging.getLogger("msprobe_core")

COLUMNS = ("api_name", "stack")


def _frame(text: str) -> str:
    """``path:line in func`` (random_patch's stack entry) in stack.json's format."""
    where, _, func = text.rpartition(" in ")
    path, _, line = where.rpartition(":")
    return format_frame((path, int(line), func)) if line.isdigit() else text


class RandomCallSites:
    """The CSV of one process: opened at the first call site found, one flushed row per new site."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.path: Optional[Path] = None
        self._pid = os.getpid()
        self._file: Any = None
        self._writer: Any = None
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._failed = False

    def _open(self) -> None:
        from msprobe_core.pytorch.ranks import current_rank

        self.output_dir.mkdir(parents=True, exist_ok=True)
        stem = f"random_{rank_folder_name(current_rank())}_{time.strftime('%Y%m%d%H%M%S')}"
        for n in range(1000):  # never overwrite another run's file
            path = self.output_dir / (f"{stem}.csv" if n == 0 else f"{stem}_{n}.csv")
            try:
                self._file = open(path, "x", newline="", encoding="utf-8")
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"{self.output_dir}/{stem}*.csv")
        self.path = path
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS)
        logger.info("random_save: randomness API call sites go to %s", path)

    def add(self, entry: dict[str, Any]) -> None:
        """A call site ``random_patch`` saw for the first time (its listener)."""
        key = (entry["api"], entry["location"])
        with self._lock:
            if os.getpid() != self._pid:  # a forked worker: its own file, not the parent's handle
                self._pid, self._file, self.path, self._seen, self._failed = os.getpid(), None, None, set(), False
            if key in self._seen or self._failed:
                return
            self._seen.add(key)
            try:
                if self._file is None:
                    self._open()
                stack = "\n".join(_frame(f) for f in reversed(entry["stack"]))
                self._writer.writerow((entry["api"], stack))
                self._file.flush()
            except OSError as e:  # the training's random call must go on
                self._failed = True
                logger.error("random_save: cannot write to %s (%s); no further call sites are saved",
                             self.output_dir, e)


_ACTIVE: Optional[RandomCallSites] = None


def random_save(output_path: str | os.PathLike = "./output") -> None:
    """Find the randomness API calls the model makes and save them to
    ``{output_path}/random_{rank|proc}_{timestamp}.csv`` (columns ``api_name``, ``stack``); lasts for the
    process. Calling it again changes nothing (the first output path stays)."""
    global _ACTIVE
    if not isinstance(output_path, (str, os.PathLike)) or not os.fspath(output_path):
        raise ConfigError("output_path", output_path, "a non-empty path string")
    out = Path(os.fspath(output_path))
    if out.exists() and not out.is_dir():
        raise ConfigError("output_path", os.fspath(output_path), "a directory (or a path that does not exist yet)")
    if _ACTIVE is not None:
        if _ACTIVE.output_dir.absolute() != out.absolute():
            logger.warning("random_save: already saving to %s; %s is not used", _ACTIVE.output_dir, out)
        return
    _ACTIVE = RandomCallSites(out)
    RECORDER.listeners.append(_ACTIVE.add)
    apply_patches("pytorch")
