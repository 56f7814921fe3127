"""Static collection: environment, installed packages and hyperparameters into a pack.

``python -m msprobe_core config_check -f pytorch -d run.sh conf.yaml -o pack.zip`` runs
``collect_static``; ``ConfigChecker`` uses ``static_members`` for rank 0's part of a dynamic pack.
The hyperparameters document is ``msprobe_core.hparams.capture``'s (normalized names, raw sections,
versions) with a ``config_check`` section that says where each value came from and what could not be
parsed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from msprobe_core import hparams
from msprobe_core.config_check import pack
from msprobe_core.config_check.config_files import load_config
from msprobe_core.config_check.environment import collect_env, pip_document
from msprobe_core.config_check.shell_script import CONFIG_SUFFIXES, parse_script

logger = logging.getLogger("msprobe_core.config_check")
FRAMEWORKS = ("pytorch", "mindspore")
SOURCE = "config_check"
SCRIPT_SUFFIXES = (".sh", ".bash", "")


def _has_shell_shebang(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"sh" in first


def _as_paths(paths: Optional[Iterable[str | os.PathLike] | str | os.PathLike]) -> list[Path]:
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def hyperparameter_sections(paths: Iterable[str | os.PathLike]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(sections, details)`` from launch scripts and config files. Sections: ``launch_args`` (the
    training commands' arguments), ``launcher_args`` (torchrun/deepspeed/... options) and one
    ``config:<file>`` per config file (given, or named by a script argument such as ``--deepspeed
    ds.json``). Details: per script its commands and variables, and ``unparsed``: what was not followed."""
    launch: dict[str, Any] = {}
    launcher: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    scripts: dict[str, Any] = {}
    exported: dict[str, str] = {}
    unparsed: list[dict[str, Any]] = []
    queue = [Path(p) for p in paths]
    seen: set[str] = set()
    while queue:
        path = queue.pop(0)
        key = str(path.resolve()) if path.exists() else str(path)
        if key in seen:
            continue
        seen.add(key)
        if not path.is_file():
            unparsed.append({"file": str(path), "line": 0, "text": "", "reason": "no such file"})
            continue
        if path.suffix.lower() in CONFIG_SUFFIXES:
            content, reason = load_config(path)
            if content is None:
                unparsed.append({"file": str(path), "line": 0, "text": "", "reason": reason})
            else:
                configs[f"config:{path.name}"] = content
            continue
        if path.suffix.lower() not in SCRIPT_SUFFIXES and not _has_shell_shebang(path):
            unparsed.append({"file": str(path), "line": 0, "text": "",
                             "reason": "neither a launch script (.sh, .bash, a #! shell script) nor a config "
                                       "file (.yaml, .yml, .json)"})
            continue
        result = parse_script(path)
        scripts[str(path)] = result.to_json()
        unparsed.extend(result.issues)
        if not result.commands:
            unparsed.append({"file": str(path), "line": 0, "text": "",
                             "reason": "no training command (python/torchrun/deepspeed/accelerate/msrun ...) found"})
        launch.update(result.args())
        launcher.update(result.launcher_args())
        exported.update(result.to_json()["exported"])
        queue.extend(Path(p) for p in result.config_files)
    sections: dict[str, Any] = {}
    if launch:
        sections["launch_args"] = launch
    if launcher:
        sections["launcher_args"] = launcher
    sections.update(configs)
    details = {"inputs": [str(p) for p in _as_paths(paths)], "scripts": scripts, "script_env": exported,
               "unparsed": unparsed}
    return sections, details


def hyperparameters_document(paths: Iterable[str | os.PathLike] = (),
                             recorded: Optional[Mapping[str, Mapping[str, Any]]] = None) -> dict[str, Any]:
    """``hyperparameters.json``: ``recorded`` sections (Megatron's arguments, what an integration hands
    over; they win over the scripts' values) first, then the scripts' and config files' sections."""
    sections, details = hyperparameter_sections(paths)
    ordered = {**{k: v for k, v in (recorded or {}).items() if v}, **sections}
    doc = hparams.capture(SOURCE, ordered)
    doc[SOURCE] = {**details, "sections": list(ordered)}
    return doc


def static_members(paths: Iterable[str | os.PathLike] = (),
                   recorded: Optional[Mapping[str, Mapping[str, Any]]] = None) -> dict[str, Any]:
    """The run-wide members of a pack: ``env.json``, ``pip.json``, ``hyperparameters.json``."""
    doc = hyperparameters_document(paths, recorded)
    env = {"process": collect_env(), "script": doc[SOURCE]["script_env"]}
    return {pack.ENV: env, pack.PIP: pip_document(), pack.HYPERPARAMETERS: doc}


def collect_static(framework: str, paths: Iterable[str | os.PathLike] = (),
                   output: str | os.PathLike = pack.DEFAULT_PACK) -> dict[str, Any]:
    """Write a static pack (an existing ``output`` is an error, never overwritten); returns the members."""
    members = static_members(paths)
    writer = pack.PackWriter(output, meta={"framework": framework, "mode": "static"})
    writer.update(members)
    unparsed = members[pack.HYPERPARAMETERS][SOURCE]["unparsed"]
    for item in unparsed:
        where = f"{item['file']}:{item['line']}" if item.get("line") else item["file"]
        logger.warning("not parsed: %s: %s%s", where, item["reason"], f" ({item['text']})" if item.get("text") else "")
    return members
