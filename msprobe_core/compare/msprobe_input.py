"""msprobe's compare input file: ``compare -i compare.json -o OUT`` as msprobe users run it.

::

    {
      "npu_path": "./npu_dump/step0/rank0/dump.json",
      "bench_path": "./bench_dump/step0/rank0/dump.json",
      "stack_path": "./npu_dump/step0/rank0/stack.json",
      "is_print_compare_log": true
    }

``npu_path`` is the run under test (TARGET), ``bench_path`` the trusted one (GOLDEN): each a dump.json
(its rank folder is compared) or a folder (rank, step or dump path, as ``-t`` / ``-g`` take). ``stack_path``
(optional) adds the NPU_Stack_Info column, as msprobe's ``-s``; it must be the stack.json of the npu dump
(each rank folder's own stack.json is what is read). ``is_print_compare_log`` (default true) prints
progress; false is ``--quiet``. Relative paths are taken from the current folder, else from the folder
holding compare.json. Any other key, or a value of the wrong kind, is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from msprobe_core.dump.config import read_json_object
from msprobe_core.errors import ConfigError, UnknownKeyError
from msprobe_core.files.step_recorder import JSON_NAMES

KEYS = ("npu_path", "bench_path", "stack_path", "is_print_compare_log")


@dataclass(frozen=True)
class CompareInput:
    """What a compare.json asks for, resolved to the paths ``compare_dumps`` takes."""

    target: Path
    golden: Path
    stack_path: Optional[Path]
    print_log: bool
    source: str


def _path(raw: dict, key: str, base: Path, source: str, required: bool = True) -> Optional[Path]:
    value = raw.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "a path string (a dump.json, or a rank, step or dump folder)", source)
    path = Path(value).expanduser()
    if not path.is_absolute() and not path.exists() and (base / path).exists():
        path = base / path
    if not path.exists():
        raise ConfigError(key, value, f"an existing path (not found from {os.getcwd()} nor from {base})", source)
    return path


def _dump_folder(path: Path, key: str, source: str) -> Path:
    if path.is_dir():
        return path
    if path.name not in JSON_NAMES:
        raise ConfigError(key, str(path), "a dump.json (or debug.json) or a folder holding dumps", source)
    return path.parent


def load_compare_input(path: str | os.PathLike) -> CompareInput:
    """Read and check msprobe's compare.json; raises ``ConfigFileError`` / ``ConfigError``."""
    source = os.fspath(path)
    raw: dict[str, Any] = dict(read_json_object(source))
    for key in raw:
        if key not in KEYS:
            raise UnknownKeyError(key, KEYS, source)
    base = Path(source).absolute().parent
    npu = _path(raw, "npu_path", base, source)
    bench = _path(raw, "bench_path", base, source)
    target, golden = _dump_folder(npu, "npu_path", source), _dump_folder(bench, "bench_path", source)
    stack = _path(raw, "stack_path", base, source, required=False)
    if stack is not None and not (stack.name == "stack.json" and stack.is_file()
                                  and stack.resolve().parent.is_relative_to(target.resolve())):
        raise ConfigError("stack_path", str(stack), f"the stack.json of the npu dump (inside {target}): each rank "
                                                   "folder's own stack.json is read", source)
    print_log = raw.get("is_print_compare_log", True)
    if not isinstance(print_log, bool):
        raise ConfigError("is_print_compare_log", print_log, "true or false", source)
    return CompareInput(target, golden, stack, print_log, source)
