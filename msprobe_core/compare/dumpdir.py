"""Finding and reading dumps: rank folders, step folders and whole dump paths.

A *rank folder* (``step0/rank0`` or ``step0/proc1234``) holds ``dump.json``, ``stack.json``,
``construct.json`` and, for task ``tensor``, ``dump_tensor_data/``. A *step folder* holds rank folders;
a *dump path* holds step folders. ``pair_dumps`` resolves the two paths given to ``compare`` into pairs
of rank folders; anything that is not a dump, or two dumps whose steps or ranks differ, is a
``DumpInputError`` naming the path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from msprobe_core.errors import DumpInputError

DUMP_JSON_NAMES = ("dump.json", "debug.json")
JOURNAL_GLOB = ".*.journal"
TENSOR_DIR_NAME = "dump_tensor_data"
STEP_RE = re.compile(r"^step(\d+)$")
RANK_RE = re.compile(r"^(rank|proc)(\d*)$")
RECOVER_HINT = "run `python -m msprobe_core recover {path}` to rebuild it from the crash journal"


def _read_json(path: Path, what: str) -> Any:
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
        local = self.path / TENSOR_DIR_NAME
        if not local.is_dir() and self.dump_data_dir and Path(self.dump_data_dir).is_dir():
            return Path(self.dump_data_dir)
        return local

    @cached_property
    def stack(self) -> dict[str, list[str]]:
        """stack.json as ``{record name: [frame, ...]}`` (innermost frame last); {} when absent.

        Also reads msprobe 8's grouped layout ``{"0": [[frames...], [names...]]}``.
        """
        path = self.path / "stack.json"
        if not path.is_file():
            return {}
        raw = _read_json(path, "stack.json")
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
    json_path = next(path / n for n in DUMP_JSON_NAMES if (path / n).is_file())
    raw = _read_json(json_path, "dump.json")
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), dict):
        raise DumpInputError(f"{json_path}: not a dump.json (expected an object with a 'data' object)")
    construct: dict[str, Optional[str]] = {}
    construct_path = path / "construct.json"
    if construct_path.is_file():
        loaded = _read_json(construct_path, "construct.json")
        if isinstance(loaded, dict):
            construct = {str(k): (v if isinstance(v, str) else None) for k, v in loaded.items()}
    return RankDump(path=path, json_path=json_path, task=str(raw.get("task") or "statistics"),
                    level=str(raw.get("level") or ""), framework=str(raw.get("framework") or "pytorch"),
                    data=raw["data"], construct=construct, dump_data_dir=raw.get("dump_data_dir"))


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
    return any((path / n).is_file() for n in DUMP_JSON_NAMES) or any(path.glob(JOURNAL_GLOB))


def discover(path: Path) -> tuple[str, list[DumpUnit]]:
    """Classify ``path`` as ``rank``, ``step`` or ``dump`` level and list its rank folders."""
    path = Path(path)
    if not path.exists():
        raise DumpInputError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name in DUMP_JSON_NAMES:
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


def _pair_ranks(step: Optional[str], target: list[DumpUnit], golden: list[DumpUnit],
                t_path: Path, g_path: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    t_names = [u.rank for u in target]
    g_names = [u.rank for u in golden]
    where = f" in {step}" if step else ""
    # proc{pid} folders never share names between runs: pair them by position when counts agree.
    if all(n.startswith("proc") for n in t_names + g_names):
        if len(t_names) != len(g_names):
            raise DumpInputError(f"different number of process folders{where}: target {t_path} has "
                                 f"{len(t_names)} ({', '.join(t_names)}), golden {g_path} has {len(g_names)} "
                                 f"({', '.join(g_names)})")
        return list(zip(target, golden))
    if set(t_names) != set(g_names):
        raise DumpInputError(_set_difference("ranks" + where, t_names, g_names, t_path, g_path))
    by_name = {u.rank: u for u in golden}
    return [(u, by_name[u.rank]) for u in target]


def _set_difference(what: str, t_names: list[str], g_names: list[str], t_path: Path, g_path: Path) -> str:
    only_t = [n for n in t_names if n not in set(g_names)]
    only_g = [n for n in g_names if n not in set(t_names)]
    parts = [f"the two dumps have different {what}: target {t_path} has {', '.join(t_names) or 'none'}; "
             f"golden {g_path} has {', '.join(g_names) or 'none'}"]
    if only_t:
        parts.append(f"only in target: {', '.join(only_t)}")
    if only_g:
        parts.append(f"only in golden: {', '.join(only_g)}")
    return "; ".join(parts) + " (compare matching rank or step folders directly)"


def check_finished(path: Path) -> None:
    """Raise ``DumpInputError`` unless the rank folder ``path`` holds a dump.json."""
    if any((path / n).is_file() for n in DUMP_JSON_NAMES):
        return
    if any(path.glob(JOURNAL_GLOB)):
        raise DumpInputError(f"{path}: not a finished dump (a crash journal but no dump.json); "
                             + RECOVER_HINT.format(path=_dump_root(path)))
    raise DumpInputError(f"{path}: not a dump (no dump.json)")


def _dump_root(rank_dir: Path) -> Path:
    step_dir = rank_dir.parent
    return step_dir.parent if STEP_RE.match(step_dir.name) else rank_dir


def pair_dumps(target: Path, golden: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    """Every (target, golden) pair of rank folders to compare, in step then rank order.

    Every rank folder is checked for a dump.json before anything is compared.
    """
    pairs = _pair_units(Path(target), Path(golden))
    for t_unit, g_unit in pairs:
        check_finished(t_unit.path)
        check_finished(g_unit.path)
    return pairs


def _pair_units(target: Path, golden: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    t_level, t_units = discover(Path(target))
    g_level, g_units = discover(Path(golden))
    if t_level != g_level:
        if len(t_units) == 1 and len(g_units) == 1:
            return [(t_units[0], g_units[0])]
        raise DumpInputError(f"cannot match a {t_level} folder ({target}, {len(t_units)} rank folder(s)) "
                             f"against a {g_level} folder ({golden}, {len(g_units)} rank folder(s)); "
                             "pass two folders of the same kind")
    if t_level == "rank":
        return [(t_units[0], g_units[0])]
    if t_level == "step":
        return _pair_ranks(None, t_units, g_units, Path(target), Path(golden))
    t_steps = list(dict.fromkeys(u.step for u in t_units))
    g_steps = list(dict.fromkeys(u.step for u in g_units))
    if set(t_steps) != set(g_steps):
        raise DumpInputError(_set_difference("steps", t_steps, g_steps, Path(target), Path(golden)))
    pairs = []
    for step in t_steps:
        pairs.extend(_pair_ranks(step, [u for u in t_units if u.step == step],
                                 [u for u in g_units if u.step == step], Path(target), Path(golden)))
    return pairs
