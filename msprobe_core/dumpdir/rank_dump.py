"""Reading one rank folder: dump.json (or debug.json), construct.json, stack.json and where its tensor files are.

Every file is read through ``read_json``, so a damaged one is a ``DumpInputError`` naming the file and
what is wrong with it (not JSON, not UTF-8, nested too deeply, unreadable) instead of a traceback.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from msprobe_core.dumpdir.layout import check_finished
from msprobe_core.errors import DumpInputError
from msprobe_core.files.safe_names import is_plain_file_name
from msprobe_core.files.step_recorder import JSON_NAMES, TENSOR_DIR_NAME


def read_json(path: Path, what: str) -> Any:
    """The JSON content of ``path``; ``DumpInputError`` naming the file (as ``what``) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DumpInputError(f"{path}: {what} is not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise DumpInputError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise DumpInputError(f"{path}: {what} is nested too deeply to be a dump") from None
    except OSError as e:
        raise DumpInputError(f"{path}: cannot read {what} ({e.strerror})") from None


def read_dump_json(json_path: Path) -> dict[str, Any]:
    """dump.json's top-level object (``task``, ``level``, ``framework``, ``dump_data_dir``, ``data``);
    ``DumpInputError`` when it is not one."""
    raw = read_json(json_path, "dump.json")
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise DumpInputError(f"{json_path}: not a dump.json (expected an object with a 'data' object)")
    return raw


def tensor_dir(folder: Path, recorded: Optional[str]) -> Path:
    """``dump_tensor_data`` of the rank folder ``folder``; dumps get moved, so the path dump.json recorded
    (``dump_data_dir``) is used only when the folder has none."""
    local = folder / TENSOR_DIR_NAME
    if not local.is_dir() and recorded and Path(recorded).is_dir():
        return Path(recorded)
    return local


def data_file(summary: dict, tensor_dir: Optional[str | Path]) -> Optional[str]:
    """The tensor file a summary names (its ``data_name`` in ``tensor_dir``), when it exists."""
    name = summary.get("data_name")
    if not tensor_dir or not is_plain_file_name(name):  # never a path out of the tensor folder
        return None
    path = os.path.join(tensor_dir, name)
    return path if os.path.isfile(path) else None


@dataclass
class RankDump:
    """The content of one rank folder; stack.json is read only when asked for."""

    path: Path
    json_path: Path
    task: str
    level: str
    framework: str
    data: dict[str, Any]
    construct: dict[str, Optional[str]] = field(default_factory=dict)
    dump_data_dir: Optional[str] = None

    @property
    def tensor_dir(self) -> Path:
        """``dump_tensor_data`` next to dump.json (dumps get moved, so the recorded path is a fallback)."""
        return tensor_dir(self.path, self.dump_data_dir)

    @cached_property
    def stack(self) -> dict[str, list[str]]:
        """stack.json as ``{record name: [frame, ...]}`` (innermost frame last); {} when absent.

        Also reads msprobe 8's grouped layout ``{"0": [[frames...], [names...]]}``.
        """
        path = self.path / "stack.json"
        if not path.is_file():
            return {}
        raw = read_json(path, "stack.json")
        if not isinstance(raw, dict):
            return {}
        out: dict[str, list[str]] = {}
        for key, value in raw.items():
            if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)
                    and value[1] and all(isinstance(n, str) and n in self.data for n in value[1])):
                for name in value[1]:
                    out[name] = [str(x) for x in value[0]]
            elif isinstance(value, list):
                out[key] = [str(x) for x in value]
            elif isinstance(value, str):
                out[key] = [value]
        return out


def load_rank_dump(path: Path) -> RankDump:
    """Read dump.json and construct.json of a rank folder, checking that it is a finished dump."""
    check_finished(path)
    json_path = next(path / n for n in JSON_NAMES if (path / n).is_file())
    raw = read_dump_json(json_path)
    construct: dict[str, Optional[str]] = {}
    construct_path = path / "construct.json"
    if construct_path.is_file():
        loaded = read_json(construct_path, "construct.json")
        if isinstance(loaded, dict):
            construct = {str(k): (v if isinstance(v, str) else None) for k, v in loaded.items()}
    return RankDump(path=path, json_path=json_path, task=str(raw.get("task") or "statistics"),
                    level=str(raw.get("level") or ""), framework=str(raw.get("framework") or "pytorch"),
                    data=raw["data"], construct=construct, dump_data_dir=raw.get("dump_data_dir"))
