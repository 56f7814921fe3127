"""The project's own exception types.

Every error a user can cause with bad input is a ``ValueError`` subclass whose message names the field
(or file), the value that was given and what is allowed.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable


class MsprobeError(Exception):
    """Base class of every error raised by this toolkit."""


class ConfigError(MsprobeError, ValueError):
    """A configuration file, key or value is invalid."""

    def __init__(self, field: str, value: Any, allowed: str, source: str | None = None):
        self.field = field
        self.value = value
        self.allowed = allowed
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}field '{field}' = {value!r} is invalid; allowed: {allowed}")


class UnknownKeyError(ConfigError):
    """A key that neither this tool nor msprobe documents."""

    def __init__(self, field: str, known: Iterable[str], source: str | None = None):
        close = difflib.get_close_matches(field, list(known), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'? " if close else ""
        known_list = ", ".join(sorted(known))
        super().__init__(field, field, f"{hint}known keys: {known_list}", source)
        self.args = (f"{source + ': ' if source else ''}unknown key '{field}'; {hint}known keys: {known_list}",)

    def __str__(self) -> str:  # keep the did-you-mean wording, not the generic one
        return self.args[0]


class ConfigFileError(ConfigError):
    """The configuration file cannot be read or is not JSON."""

    def __init__(self, path: str, reason: str):
        super().__init__("config_path", path, "a readable JSON file with an object at the top", None)
        self.args = (f"config file '{path}' is not usable: {reason}; expected a readable JSON file "
                     "with an object at the top",)

    def __str__(self) -> str:
        return self.args[0]


class OutputDirError(MsprobeError, ValueError):
    """A folder the toolkit writes into (``dump_path``, ``MONITOR_OUTPUT_DIR``) cannot be used: it is a file,
    lies under a file, or cannot be created or written."""


class DumpPathError(OutputDirError):
    """The dump path cannot be used (it is a file, holds another run's dump, or cannot be written)."""


class TokenRangeError(ConfigError):
    """A ``token_range`` that is not two ints with 0 <= start <= end."""

    def __init__(self, value: Any):
        super().__init__("token_range", value, "a list or tuple of two ints [start, end] with 0 <= start <= end")


class DumpInputError(MsprobeError, ValueError):
    """A path given to an analysis command is not a dump (or not a compatible one)."""


class MonitorInputError(MsprobeError, ValueError):
    """A path given to a monitor command is not a monitor output (or holds an unreadable file)."""


class DumpStateError(MsprobeError, RuntimeError):
    """The debugger API was called in an order that cannot work (for example step() before start())."""


class MissingExtraError(MsprobeError, ImportError):
    """A feature or integration was used without the optional package it needs; names the extra to install."""

    def __init__(self, module: str, extra: str, feature: str):
        super().__init__(f"{feature} needs the '{module}' package, which is not installed; "
                         f"install it with: pip install 'msprobe-toolkit[{extra}]'")
        self.name = module
        self.extra = extra


def require(module: str, extra: str, feature: str) -> Any:
    """Imports ``module`` or raises ``MissingExtraError`` naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the framework is there but something it needs is missing: its own error says what
        raise MissingExtraError(module, extra, feature) from e


def require_installed(module: str, extra: str, feature: str) -> None:
    """Like ``require``, without importing ``module`` (for an integration that imports its framework only when
    used): raises ``MissingExtraError`` naming the extra when ``module`` cannot be found."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package of ``module`` is missing
        found = False
    if not found:
        raise MissingExtraError(module, extra, feature)
