"""The dump configuration: msprobe's config.json keys, validated into one immutable ``DumpConfig``.

A user's msprobe config.json works unchanged: keys msprobe documents but this tool does not use are
accepted with a warning (``IGNORED_KEYS``); any other unknown key is a ``UnknownKeyError`` with a
did-you-mean suggestion. Every invalid value is a ``ConfigError`` (a ``ValueError``) naming the field,
the value and what is allowed. Validation never touches the disk beyond reading the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from msprobe_core.errors import ConfigError, ConfigFileError, TokenRangeError, UnknownKeyError

logger = logging.getLogger("msprobe_core")

DEFAULT_DUMP_PATH = "./msprobe_dump"
"""Where dumps go when neither the config file nor the constructor names a ``dump_path``."""

TASKS = ("statistics", "tensor", "structure", "overflow_check")
TASK_ALIASES = {"nan_check": "overflow_check"}
"""Task names of other msprobe versions and what they are here (msprobe 26 calls overflow_check nan_check)."""
UNSUPPORTED_TASKS = ("acc_check", "run_ut", "free_benchmark", "grad_probe", "kernel_dump", "exception_dump")
LEVELS = ("L0", "L1", "mix", "debug")
DATA_MODES = ("all", "forward", "backward", "input", "output")
SUMMARY_MODES = ("statistics", "md5")

TOP_LEVEL_KEYS = ("task", "dump_path", "rank", "step", "level", "async_dump", "extra_info", "dump_enable")
SECTION_KEYS = ("scope", "list", "tensor_list", "data_mode", "summary_mode", "overflow_nums")

# Keys msprobe documents (config_introduction) that this tool accepts and ignores with a warning.
IGNORED_KEYS = frozenset({
    "acl_config", "seed", "is_deterministic", "enable_dataloader", "precision",
    "framework", "online_run_ut", "nfs_path", "host", "port", "tls_path", "master_ip", "master_port",
    "backward_input", "file_format", "white_list", "black_list", "error_data_path", "is_online",
    "rank_list", "check_mode", "fuzz_device", "pert_mode", "handler_type", "fuzz_level", "fuzz_stage",
    "if_preheat", "preheat_step", "max_sample", "bench_path", "grad_level", "param_list", "bounds",
    "online_run_ut_recompute", "op_generate", "dump_generate",
})
# Sections of tasks this tool does not run; a config may carry them (msprobe's default config does).
IGNORED_SECTIONS = frozenset(UNSUPPORTED_TASKS) | {"free_benchmark", "run_ut", "acc_check", "grad_probe"}


@dataclass(frozen=True)
class StepFilter:
    """A set of steps given as single ints and inclusive ranges; empty means every step."""

    singles: frozenset[int] = frozenset()
    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, step: int) -> bool:
        if not self.singles and not self.ranges:
            return True
        return step in self.singles or any(a <= step <= b for a, b in self.ranges)

    @property
    def is_all(self) -> bool:
        return not self.singles and not self.ranges

    def last(self) -> int | None:
        """The largest step selected, or None when every step is selected."""
        if self.is_all:
            return None
        return max([*self.singles, *(b for _, b in self.ranges)])


@dataclass(frozen=True)
class DumpConfig:
    """A validated dump configuration. Build it with ``load_dump_config``."""

    task: str = "statistics"
    dump_path: str = DEFAULT_DUMP_PATH
    rank: StepFilter = field(default_factory=StepFilter)
    step: StepFilter = field(default_factory=StepFilter)
    level: str = "L1"
    async_dump: bool = False
    extra_info: bool = True
    scope: tuple[str, ...] = ()
    api_list: tuple[str, ...] = ()
    tensor_list: tuple[str, ...] = ()
    data_mode: frozenset[str] = frozenset({"all"})
    summary_mode: str = "statistics"
    overflow_nums: int = 1
    source: str | None = None
    dump_enable: bool | None = None
    """msprobe's dynamic switch: None when the file has no ``dump_enable`` key (dumping as configured);
    True/False when it has one: the file is then re-read at every ``step()`` and dumping follows it."""

    def with_overrides(self, **overrides: Any) -> "DumpConfig":
        """A copy with constructor arguments (task, dump_path, level, step) applied and validated."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if not given:
            return self
        values: dict[str, Any] = {}
        if "task" in given:
            values["task"] = _check_task(given["task"], "argument")
        if "level" in given:
            values["level"] = _check_choice("level", given["level"], LEVELS, "argument")
        if "dump_path" in given:
            values["dump_path"] = _check_dump_path(given["dump_path"], "argument")
        if "step" in given:
            values["step"] = parse_int_filter("step", given["step"], "argument")
        return replace(self, **values)


# --------------------------------------------------------------------------------------------- parsing
def load_dump_config(config_path: str | os.PathLike | Mapping[str, Any] | None = None, **overrides: Any) -> DumpConfig:
    """Read and validate a config.json (a path, a dict, or None for the defaults), then apply overrides.

    Raises ``ConfigFileError`` for an unreadable or non-JSON file, ``UnknownKeyError`` for an unknown key,
    and ``ConfigError`` for a bad value. Nothing is created on disk.
    """
    if config_path is None:
        raw: Mapping[str, Any] = {}
        source = None
    elif isinstance(config_path, Mapping):
        raw, source = config_path, "config"
    else:
        source = os.fspath(config_path)
        raw = read_json_object(source)
    return parse_dump_config(raw, source).with_overrides(**overrides)


MAX_CONFIG_BYTES = 64 << 20


def read_json_object(path: str) -> Mapping[str, Any]:
    """Load a JSON file whose top level is an object, or raise ``ConfigFileError``. Only a regular file of
    at most ``MAX_CONFIG_BYTES`` is read (a FIFO or a device would block or never end)."""
    try:
        if "\x00" in path:
            raise ConfigFileError(path, "the path holds a NUL character")
        if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
            raise ConfigFileError(path, "not a regular file (a FIFO, socket or device)")
        with open(path, encoding="utf-8") as f:
            if os.fstat(f.fileno()).st_size > MAX_CONFIG_BYTES:
                raise ConfigFileError(path, f"larger than {MAX_CONFIG_BYTES >> 20} MiB")
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigFileError(path, "no such file") from None
    except IsADirectoryError:
        raise ConfigFileError(path, "it is a directory") from None
    except PermissionError:
        raise ConfigFileError(path, "permission denied") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(path, f"not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ConfigFileError(path, f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigFileError(path, "JSON nested too deeply") from None
    except OSError as e:
        raise ConfigFileError(path, e.strerror or str(e)) from None
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"the top level is a {type(data).__name__}, not an object")
    return data


def parse_dump_config(raw: Mapping[str, Any], source: str | None = None) -> DumpConfig:
    """Validate a config mapping (msprobe's config.json layout) into a ``DumpConfig``."""
    known_top = set(TOP_LEVEL_KEYS) | set(TASKS) | set(TASK_ALIASES) | IGNORED_SECTIONS
    for key in raw:
        if key in known_top:
            continue
        if key in IGNORED_KEYS:
            logger.warning("msprobe config key '%s' is accepted but not used by this tool", key)
            continue
        raise UnknownKeyError(key, known_top | IGNORED_KEYS, source)

    given_task = raw.get("task", "statistics")
    task = _check_task(given_task, source)
    level = _check_choice("level", raw.get("level", "L1"), LEVELS, source)
    dump_path = _check_dump_path(raw.get("dump_path", DEFAULT_DUMP_PATH), source)
    rank = parse_int_filter("rank", raw.get("rank", []), source)
    step = parse_int_filter("step", raw.get("step", []), source)
    async_dump = _check_bool("async_dump", raw.get("async_dump", False), source)
    extra_info = _check_bool("extra_info", raw.get("extra_info", True), source)
    dump_enable = raw.get("dump_enable")
    if dump_enable is not None:
        dump_enable = _check_bool("dump_enable", dump_enable, source)

    section = raw.get(given_task, raw.get(task, {}))  # nan_check's section may be named either way
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ConfigError(given_task, section, "an object with the task's keys (scope, list, data_mode, ...)", source)
    for other in (*TASKS, *TASK_ALIASES):
        if other not in (task, given_task) and other in raw and not isinstance(raw[other], Mapping):
            raise ConfigError(other, raw[other], "an object", source)
    for key in section:
        if key in SECTION_KEYS:
            continue
        if key in IGNORED_KEYS:
            logger.warning("msprobe config key '%s.%s' is accepted but not used by this tool", given_task, key)
            continue
        raise UnknownKeyError(f"{given_task}.{key}", [f"{given_task}.{k}" for k in (*SECTION_KEYS, *IGNORED_KEYS)], source)

    scope = _check_str_list(f"{given_task}.scope", section.get("scope", []), source)
    if len(scope) not in (0, 2):
        raise ConfigError(f"{given_task}.scope", list(scope), "an empty list or exactly two module/API names [first, last]", source)
    api_list = _check_str_list(f"{given_task}.list", section.get("list", []), source)
    tensor_list = _check_str_list(f"{given_task}.tensor_list", section.get("tensor_list", []), source)
    data_mode = _check_data_mode(f"{given_task}.data_mode", section.get("data_mode", ["all"]), source)
    summary_mode = _check_choice(f"{given_task}.summary_mode", section.get("summary_mode", "statistics"), SUMMARY_MODES, source)
    overflow_nums = section.get("overflow_nums", 1)
    if isinstance(overflow_nums, bool) or not isinstance(overflow_nums, int) or (overflow_nums < 1 and overflow_nums != -1):
        raise ConfigError(f"{given_task}.overflow_nums", overflow_nums, "an int >= 1, or -1 for no limit", source)

    return DumpConfig(task=task, dump_path=dump_path, rank=rank, step=step, level=level, async_dump=async_dump,
                      extra_info=extra_info, scope=scope, api_list=api_list, tensor_list=tensor_list,
                      data_mode=data_mode, summary_mode=summary_mode, overflow_nums=overflow_nums, source=source,
                      dump_enable=dump_enable)


_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_int_filter(name: str, value: Any, source: str | None = None) -> StepFilter:
    """Parse msprobe's ``step``/``rank`` lists: ints >= 0 and "a-b" ranges with a <= b."""
    allowed = 'a list of ints >= 0 and "a-b" ranges with a <= b, e.g. [0, 2, "5-8"]; [] means all'
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(name, value, allowed, source)
    singles: set[int] = set()
    ranges: list[tuple[int, int]] = []
    for item in value:
        if isinstance(item, bool):
            raise ConfigError(name, item, allowed, source)
        if isinstance(item, int):
            if item < 0:
                raise ConfigError(name, item, allowed, source)
            singles.add(item)
            continue
        if isinstance(item, str):
            if item.strip().isdigit():
                singles.add(int(item))
                continue
            m = _RANGE.match(item)
            if m and int(m.group(1)) <= int(m.group(2)):
                ranges.append((int(m.group(1)), int(m.group(2))))
                continue
        raise ConfigError(name, item, allowed, source)
    return StepFilter(frozenset(singles), tuple(ranges))


def check_task_and_level(task: Any, level: Any, prefix: str = "", source: str | None = None) -> tuple[str, str]:
    """A ``task`` and a ``level`` as the dump config accepts them (an alias gives the task it names), for
    another config that starts a dump; a ``ConfigError`` names ``{prefix}task`` / ``{prefix}level``."""
    return _check_task(task, source, f"{prefix}task"), _check_choice(f"{prefix}level", level, LEVELS, source)


def _check_task(value: Any, source: str | None, name: str = "task") -> str:
    """A task name (an alias such as msprobe 26's ``nan_check`` gives the task it names)."""
    if isinstance(value, str) and value in UNSUPPORTED_TASKS:
        raise ConfigError(name, value, f"{', '.join((*TASKS, *TASK_ALIASES))} ('{value}' is an msprobe task this "
                                         "tool does not run)", source)
    if isinstance(value, str) and value in TASK_ALIASES:
        return TASK_ALIASES[value]
    return _check_choice(name, value, (*TASKS, *TASK_ALIASES), source)


def _check_choice(name: str, value: Any, choices: Iterable[str], source: str | None) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(name, value, ", ".join(choices), source)
    return value


def _check_bool(name: str, value: Any, source: str | None) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, value, "true or false (a JSON boolean, not a string)", source)
    return value


def _check_str_list(name: str, value: Any, source: str | None) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(name, value, "a list of non-empty strings", source)
    return tuple(value)


def _check_data_mode(name: str, value: Any, source: str | None) -> frozenset[str]:
    allowed = f"a list of {', '.join(DATA_MODES)} ('all' alone)"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or any(v not in DATA_MODES for v in value):
        raise ConfigError(name, value, allowed, source)
    if "all" in value and len(value) > 1:
        raise ConfigError(name, value, allowed, source)
    return frozenset(value)


def _check_dump_path(value: Any, source: str | None) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError("dump_path", value, "a non-empty path string", source)
    path = os.fspath(value)
    if "\x00" in path:
        raise ConfigError("dump_path", path, "a path without NUL characters", source)
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError("dump_path", path, "a directory (or a path that does not exist yet), not a file", source)
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError("dump_path", path, f"a path whose parent '{parent}' is a directory, not a file", source)
            break
    return path


def validate_token_range(token_range: Any) -> tuple[int, int] | None:
    """``None`` or two ints [start, end] with 0 <= start <= end; else ``TokenRangeError``."""
    if token_range is None:
        return None
    if (not isinstance(token_range, (list, tuple)) or len(token_range) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in token_range)
            or token_range[0] < 0 or token_range[0] > token_range[1]):
        raise TokenRangeError(token_range)
    return int(token_range[0]), int(token_range[1])
