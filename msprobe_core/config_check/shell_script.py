"""Hyperparameters from a launch script of any shape, without running it.

The script is cut into statements the way bash does (quotes, ``\\``-newline continuations, comments,
``;``/``&&``/``||``/``|``, multi-line ``( ... )`` arrays and ``$( ... )``, here-documents), variables are
followed in order (``LR=1e-4``, ``export``, ``declare``, ``${LR:-1e-4}``, arrays ``ARGS=(--lr 1e-4)`` used
as ``"${ARGS[@]}"``, ``$((GPUS * NODES))``, ``source other.sh``), each statement is expanded and split
with ``shlex``, and the training commands are recognised: ``torchrun``, ``python -m
torch.distributed.launch|run``, ``deepspeed``, ``accelerate launch``, ``msrun``, ``mpirun``/``srun`` wrappers and a
plain ``python train.py``. Their arguments become hyperparameters (``--flag=value``, ``--flag value``,
``--flag v1 v2``, boolean ``--flag``). Whatever cannot be followed (command substitution, undefined
variables, loops, unbalanced quotes) is reported in ``issues``, never raised.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from msprobe_core.config_check.shell_lexer import NAME, Expander, Statement, split_statements
from msprobe_core.config_check.values import REDACTED, looks_secret

_ASSIGN = re.compile(rf"^({NAME})(\+?)=(.*)$", re.DOTALL)
_ARRAY_ASSIGN = re.compile(rf"^\s*(?:(?:export|declare|typeset|local|readonly)(?:\s+-\w+)*\s+)?({NAME})(\+?)=\((.*)\)\s*$",
                           re.DOTALL)
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}
_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "{", "}", "!", "time", "nohup",
             "exec", "command", "builtin"}
_PYTHON = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")
LAUNCHER_MODULES = {"torch.distributed.launch": "torch.distributed.launch", "torch.distributed.run": "torchrun",
                    "deepspeed.launcher.runner": "deepspeed", "deepspeed.launcher.launch": "deepspeed",
                    "accelerate.commands.launch": "accelerate launch", "mindspore.parallel.cluster.run": "msrun"}
LAUNCHERS = {"torchrun", "deepspeed", "msrun", "mpirun", "mpiexec", "srun", "horovodrun", "ds", "colossalai"}
_SOURCE_DEPTH = 4


@dataclass
class Command:
    """One training command found in a script."""

    line: int
    launcher: str
    entry: str
    args: dict[str, Any]
    launcher_args: dict[str, Any] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "launcher": self.launcher, "entry": self.entry, "args": self.args,
                "launcher_args": self.launcher_args, "positional": self.positional, "env": self.env}


@dataclass
class ScriptResult:
    """What a script sets: its training commands, its variables, what it exports, and what was not followed."""

    path: str
    commands: list[Command] = field(default_factory=list)
    variables: dict[str, Any] = field(default_factory=dict)
    exported: dict[str, str] = field(default_factory=dict)
    issues: list[dict[str, Any]] = field(default_factory=list)
    config_files: list[str] = field(default_factory=list)

    def issue(self, line: int, text: str, reason: str, path: Optional[str] = None) -> None:
        self.issues.append({"file": path or self.path, "line": line, "text": _short(text), "reason": reason})

    def args(self) -> dict[str, Any]:
        """The training commands' arguments merged in order (a later command's value wins)."""
        merged: dict[str, Any] = {}
        for cmd in self.commands:
            merged.update(cmd.args)
        return merged

    def launcher_args(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for cmd in self.commands:
            merged.update(cmd.launcher_args)
        return merged

    def to_json(self) -> dict[str, Any]:
        return {"commands": [c.to_json() for c in self.commands], "variables": _redact(self.variables),
                "exported": _redact(self.exported), "config_files": self.config_files}


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _redact(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if looks_secret(k) else v) for k, v in values.items()}


# ------------------------------------------------------------------------------------------ arguments
def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token in ("-", "--"):
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


def parse_args(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``--flag=value``, ``--flag value``, ``--flag v1 v2`` (a list) and boolean ``--flag`` (True);
    keys lose their dashes and read ``-`` as ``_``. Returns the flags and the positional words."""
    flags: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not _is_flag(token):
            positional.append(token)
            continue
        name, eq, value = token.partition("=")
        key = name.lstrip("-").replace("-", "_")
        if eq:
            flags[key] = value
            continue
        values = []
        while i < len(tokens) and not _is_flag(tokens[i]):
            values.append(tokens[i])
            i += 1
        flags[key] = True if not values else values[0] if len(values) == 1 else values
    for key in flags:
        if looks_secret(key):
            flags[key] = REDACTED
    return flags, positional


def _entry_index(tokens: list[str], start: int) -> Optional[int]:
    for j in range(start, len(tokens)):
        if tokens[j].endswith(".py") or tokens[j] in ("-m", "--module") or _PYTHON.match(tokens[j]):
            return j
    return None


def analyze_command(tokens: list[str], line: int, env: dict[str, str]) -> Optional[Command] | str:
    """A training command from one expanded statement, ``None`` when it is not one, or a reason text
    when it looks like one that cannot be read."""
    i = 0
    while i < len(tokens) and (tokens[i] in _KEYWORDS or tokens[i] == "env" or _ASSIGN.match(tokens[i])):
        i += 1
    if i >= len(tokens):
        return None
    head = os.path.basename(tokens[i])
    if _PYTHON.match(head):
        j = i + 1
        while j < len(tokens) and tokens[j].startswith("-") and tokens[j] not in ("-m",):
            j += 2 if tokens[j] in ("-W", "-X") else 1
        if j < len(tokens) and tokens[j] == "-m" and j + 1 < len(tokens):
            module = tokens[j + 1]
            if module in LAUNCHER_MODULES:
                return _launched(tokens, j + 2, line, env, LAUNCHER_MODULES[module])
            return _command(line, "python", module, tokens[j + 2:], env)
        if j < len(tokens):
            return _command(line, "python", tokens[j], tokens[j + 1:], env)
        return None
    if head == "accelerate" and i + 1 < len(tokens) and tokens[i + 1] == "launch":
        return _launched(tokens, i + 2, line, env, "accelerate launch")
    if head in LAUNCHERS:
        return _launched(tokens, i + 1, line, env, head)
    if head.endswith(".py"):
        return _command(line, "", tokens[i], tokens[i + 1:], env)
    return None


def _launched(tokens: list[str], start: int, line: int, env: dict[str, str], launcher: str) -> Command | str:
    j = _entry_index(tokens, start)
    if j is None:
        return f"{launcher}: no training script (*.py or -m MODULE) found in the command"
    launcher_args, _ = parse_args(tokens[start:j])
    if tokens[j] in ("-m", "--module"):
        if j + 1 >= len(tokens):
            return f"{launcher}: -m without a module"
        cmd = _command(line, launcher, tokens[j + 1], tokens[j + 2:], env)
    elif _PYTHON.match(os.path.basename(tokens[j])):  # mpirun/srun ... python train.py
        inner = analyze_command(tokens[j:], line, env)
        if not isinstance(inner, Command):
            return inner or f"{launcher}: no training script after {tokens[j]}"
        inner.launcher = f"{launcher} {inner.launcher}".strip()
        cmd = inner
    else:
        cmd = _command(line, launcher, tokens[j], tokens[j + 1:], env)
    cmd.launcher_args = {**launcher_args, **cmd.launcher_args}
    return cmd


def _command(line: int, launcher: str, entry: str, rest: list[str], env: dict[str, str]) -> Command:
    args, positional = parse_args(rest)
    return Command(line=line, launcher=launcher, entry=entry, args=args, positional=positional, env=dict(env))


# ------------------------------------------------------------------------------------------ the script
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def parse_script(path: str | os.PathLike, env: Optional[Mapping[str, str]] = None,
                 positional: Optional[list[str]] = None) -> ScriptResult:
    """Follow a launch script statement by statement (see the module docstring). ``env`` is the
    environment undefined variables fall back to (default: this process's)."""
    result = ScriptResult(path=str(path))
    walker = _Walker(result, os.environ if env is None else env)
    walker.run(Path(path), positional or [], depth=0)
    result.variables = walker.variables
    return result


class _Walker:
    def __init__(self, result: ScriptResult, env: Mapping[str, str]):
        self.result = result
        self.env = env
        self.variables: dict[str, Any] = {}

    def run(self, path: Path, positional: list[str], depth: int) -> None:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            self.result.issue(0, str(path), f"cannot read: {e.strerror or e}", str(path))
            return
        statements, problems = split_statements(text)
        for line, reason in problems:
            self.result.issue(line, "", reason, str(path))
        for stmt in statements:
            self.statement(stmt, path, positional, depth)

    def statement(self, stmt: Statement, path: Path, positional: list[str], depth: int) -> None:
        where = str(path)
        expander = Expander(self.variables, self.env, positional, str(path))
        m = _ARRAY_ASSIGN.match(stmt.text)
        if m:
            name, append, body = m.groups()
            try:
                items = shlex.split(expander.expand(body), comments=True)
            except ValueError as e:
                self.result.issue(stmt.line, stmt.text, f"array {name}: {e}", where)
                return
            old = self.variables.get(name) if append else None
            self.variables[name] = (old if isinstance(old, list) else [old] if old else []) + items
            self._report(expander, stmt, where)
            return
        text = stmt.text
        first = text.split(None, 1)[0] if text.split() else ""
        if first in ("for", "select", "case", "function") or re.match(rf"^{NAME}\s*\(\s*\)", text):
            if first in ("for", "select"):
                self.result.issue(stmt.line, text, "loop: its variable takes several values and is not followed",
                                  where)
            return
        try:
            tokens = shlex.split(expander.expand(text), comments=False)
        except ValueError as e:
            self.result.issue(stmt.line, text, f"cannot split into words: {e}", where)
            return
        self._report(expander, stmt, where)
        tokens = self._strip_redirections(tokens)
        if not tokens:
            return
        if tokens[0] in ("source", ".") and len(tokens) > 1:
            self._source(tokens[1], tokens[2:], stmt, path, depth)
            return
        if tokens[0] in ("bash", "sh") and len(tokens) > 1 and tokens[1].endswith(".sh"):
            self._source(tokens[1], tokens[2:], stmt, path, depth)  # followed as if sourced
            return
        if tokens[0] in _DECLARE:
            for tok in tokens[1:]:
                if tok.startswith("-"):
                    continue
                m2 = _ASSIGN.match(tok)
                name = m2.group(1) if m2 else tok
                if m2:
                    self._assign(m2)
                if tokens[0] == "export" and re.fullmatch(NAME, name):
                    value = self.variables.get(name, self.env.get(name))
                    if value is not None:
                        self.result.exported[name] = REDACTED if looks_secret(name) else str(value)
            return
        prefix_env: dict[str, str] = {}
        k = 0
        while k < len(tokens) and _ASSIGN.match(tokens[k]):
            m2 = _ASSIGN.match(tokens[k])
            prefix_env[m2.group(1)] = m2.group(3)
            k += 1
        if k == len(tokens):  # plain assignments
            for tok in tokens:
                self._assign(_ASSIGN.match(tok))
            return
        found = analyze_command(tokens, stmt.line, prefix_env)
        if isinstance(found, Command):
            self.result.commands.append(found)
            self._follow_configs(found, path)
        elif isinstance(found, str):
            self.result.issue(stmt.line, text, found, where)

    def _assign(self, m: re.Match) -> None:
        name, append, value = m.groups()
        old = self.variables.get(name, "") if append else ""
        self.variables[name] = f"{old}{value}" if not isinstance(old, list) else old + [value]

    def _report(self, expander: Expander, stmt: Statement, where: str) -> None:
        for problem in dict.fromkeys(expander.problems):
            self.result.issue(stmt.line, stmt.text, problem, where)

    @staticmethod
    def _strip_redirections(tokens: list[str]) -> list[str]:
        out: list[str] = []
        skip = False
        for tok in tokens:
            if skip:
                skip = False
                continue
            if re.fullmatch(r"\d*(>>?|<|&>|>&)", tok):
                skip = True
                continue
            if re.fullmatch(r"\d*(>>?|<|&>)\S+|\d*>&\d+", tok):
                continue
            out.append(tok)
        return out

    def _source(self, name: str, args: list[str], stmt: Statement, path: Path, depth: int) -> None:
        target = Path(name)
        if not target.is_absolute():
            target = path.parent / target if (path.parent / target).exists() else Path.cwd() / target
        if depth >= _SOURCE_DEPTH or not target.is_file():
            self.result.issue(stmt.line, stmt.text, f"script {name} not found or nested too deep", str(path))
            return
        self.run(target, args, depth + 1)

    def _follow_configs(self, cmd: Command, path: Path) -> None:
        values = [v for v in list(cmd.args.values()) + list(cmd.launcher_args.values())]
        for value in values:
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, str) or not item.lower().endswith(CONFIG_SUFFIXES):
                    continue
                for candidate in (Path(item), path.parent / item):
                    if candidate.is_file():
                        resolved = str(candidate)
                        if resolved not in self.result.config_files:
                            self.result.config_files.append(resolved)
                        break
