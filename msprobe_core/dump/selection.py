"""Which records a dump keeps: the ``scope``, ``list``, ``tensor_list`` and ``data_mode`` of the config.

Decided once per record name at the start of the call; the hot path asks ``record(name)`` and, for
each field, ``keeps(direction, field)`` (a precomputed lookup).
"""

from __future__ import annotations

from typing import Iterable

from msprobe_core.dump.config import DumpConfig


def _call_key(name: str) -> str:
    """``Functional.relu.0.backward`` and its forward share one key, so list entries select both."""
    return name.replace(".backward", ".forward")


def matches(name: str, entries: Iterable[str]) -> bool:
    """msprobe's list semantics: a full record name, or a fragment such as an API name ("relu")."""
    key = _call_key(name)
    for e in entries:
        if e == name or e == key or e in key:
            return True
    return False


class RecordSelection:
    """The config's record filters, evaluated in execution order (``scope`` is stateful)."""

    def __init__(self, cfg: DumpConfig):
        self._list = cfg.api_list
        self._tensor_list = cfg.tensor_list
        self._scope = cfg.scope
        self._in_scope = not cfg.scope
        self._scope_done = False
        self._scope_closer: str | None = None
        modes = cfg.data_mode
        directions = {m for m in modes if m in ("forward", "backward")} or {"forward", "backward"}
        fields = {m for m in modes if m in ("input", "output")} or {"input", "output"}
        if "all" in modes:
            directions, fields = {"forward", "backward"}, {"input", "output"}
        self._keep = {(d, f): d in directions and f in fields for d in ("forward", "backward") for f in ("input", "output")}
        self.forward = "forward" in directions
        self.backward = "backward" in directions
        self.filters = bool(self._scope or self._list)
        """Does ``record`` (and ``call_finished``) depend on the name? Otherwise every call is recorded."""

    def reset_step(self) -> None:
        self._in_scope = not self._scope
        self._scope_done = False
        self._scope_closer = None

    def keeps(self, direction: str, field: str) -> bool:
        """Does data_mode keep this part (``field`` is 'input' or 'output') of a record?"""
        return self._keep[(direction, field)]

    def record(self, forward_name: str) -> bool:
        """Is this forward call (and later its backward) recorded? Call once, when the call starts."""
        if self._scope and not self._enter_scope(forward_name):
            return False
        if self._list and not matches(forward_name, self._list):
            return False
        return True

    def saves_tensor(self, name: str) -> bool:
        """``tensor_list``: records whose tensors are saved although the task is statistics."""
        return bool(self._tensor_list) and matches(name, self._tensor_list)

    # --------------------------------------------------------------- scope [first, last]
    def _enter_scope(self, name: str) -> bool:
        if self._scope_done:
            return False
        first, last = self._scope
        if not self._in_scope and (name == first or name.startswith(first + ".") or _call_key(name) == first):
            self._in_scope = True
        if self._in_scope and (name == last or name.startswith(last + ".") or _call_key(name) == last):
            self._scope_closer = name
        return self._in_scope

    def call_finished(self, forward_name: str) -> None:
        """Close the scope after the call that matched its last entry has returned."""
        if self._scope_closer is not None and forward_name == self._scope_closer:
            self._in_scope = False
            self._scope_done = True
            self._scope_closer = None
