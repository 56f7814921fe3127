"""L1 API wrapping: the torch attributes listed in support_wrap_ops.yaml, patched and restored exactly.

The plan (which attribute of which owner, its original value, whether the owner held it itself or
inherited it, and the wrapper) is built once per process; ``patch()`` and ``restore()`` are then tight
loops of setattr/delattr. After ``restore()`` every owner's ``__dict__`` is as it was before ``patch()``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from msprobe_core.errors import ConfigError

DEFAULT_WRAP_LIST = os.path.join(os.path.dirname(__file__), "support_wrap_ops.yaml")

# yaml section -> (record prefix, owner getter)
NAMESPACES: dict[str, tuple[str, Callable[[], Any]]] = {
    "functional": ("Functional", lambda: torch.nn.functional),
    "tensor": ("Tensor", lambda: torch.Tensor),
    "torch": ("Torch", lambda: torch),
    "_VF": ("VF", lambda: torch._VF),
    "distributed": ("Distributed", lambda: torch.distributed),
}

# Handler signature: handler(original, prefix, api_name, args, kwargs) -> result
ApiHandler = Callable[[Callable, str, str, tuple, dict], Any]


@dataclass
class PatchSlot:
    owner: Any
    attr: str
    original: Any
    owned: bool  # the attribute was in owner.__dict__ (restore with setattr) or inherited (restore with delattr)
    wrapper: Callable


def load_wrap_list(path: Optional[str] = None) -> dict[str, list[str]]:
    """Read a support_wrap_ops.yaml (msprobe's layout: namespace -> list of API names)."""
    import yaml

    path = path or DEFAULT_WRAP_LIST
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError("wrap_list", path, f"a readable YAML file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError("wrap_list", path, f"valid YAML ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError("wrap_list", path, "a YAML mapping of namespace -> list of API names")
    for section, names in doc.items():
        if section not in NAMESPACES:
            raise ConfigError(f"wrap_list.{section}", section, ", ".join(NAMESPACES))
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"wrap_list.{section}", names, "a list of API names")
    return doc


def make_wrapper(original: Callable, prefix: str, api: str, handler: ApiHandler,
                 should_record: Callable[[], bool]) -> Callable:
    """A wrapper that calls ``handler`` while recording, and ``original`` directly otherwise."""

    def wrapper(*args, **kwargs):
        if should_record():
            return handler(original, prefix, api, args, kwargs)
        return original(*args, **kwargs)

    try:
        functools.update_wrapper(wrapper, original)
    except (AttributeError, TypeError):
        pass
    wrapper.__msprobe_original__ = original  # type: ignore[attr-defined]
    return wrapper


# torch's own entry points whose internal API calls (e.g. ``torch.ones_like`` for the initial gradient)
# are not the user's: while they run, nothing is recorded.
SILENT = (("autograd", "backward"), ("autograd", "grad"))


class ApiPatcher:
    """Builds the patch plan from a wrap list and applies/restores it."""

    def __init__(self, handler: ApiHandler, should_record: Callable[[], bool], wrap_list: Optional[str] = None,
                 silence: Optional[Callable[[Callable], Callable]] = None):
        self._handler = handler
        self._silence = silence
        self._should_record = should_record
        self._wrap_list = wrap_list
        self._slots: Optional[list[PatchSlot]] = None
        self.patched = False

    def _plan(self) -> list[PatchSlot]:
        if self._slots is not None:
            return self._slots
        slots: list[PatchSlot] = []
        for section, names in load_wrap_list(self._wrap_list).items():
            prefix, get_owner = NAMESPACES[section]
            try:
                owner = get_owner()
            except (AttributeError, RuntimeError):
                continue
            if section == "distributed" and not torch.distributed.is_available():
                continue
            own_dict = owner.__dict__ if hasattr(owner, "__dict__") else {}
            for name in dict.fromkeys(names):
                try:
                    original = getattr(owner, name)
                except AttributeError:
                    continue  # not in this torch version
                if not callable(original) or getattr(original, "__msprobe_original__", None) is not None:
                    continue
                slots.append(PatchSlot(owner, name, own_dict.get(name, original), name in own_dict,
                                       make_wrapper(original, prefix, name, self._handler, self._should_record)))
        if self._silence is not None:
            for owner_name, name in SILENT:
                owner = getattr(torch, owner_name)
                original = owner.__dict__[name]
                slots.append(PatchSlot(owner, name, original, True, self._silence(original)))
        self._slots = slots
        return slots

    def patch(self) -> None:
        if self.patched:
            return
        for s in self._plan():
            setattr(s.owner, s.attr, s.wrapper)
        self.patched = True

    def restore(self) -> None:
        if not self.patched:
            return
        for s in self._slots or ():
            if s.owned:
                setattr(s.owner, s.attr, s.original)
            else:
                try:
                    delattr(s.owner, s.attr)
                except AttributeError:
                    pass
        self.patched = False

    def prepare(self) -> int:
        """Build the patch plan now (reading and checking the wrap list); returns how many APIs it wraps."""
        return len(self._plan())
