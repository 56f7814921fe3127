"""The one way the toolkit patches an attribute, with ``torch.utils.hooks.RemovableHandle`` semantics.

Every patch the toolkit and its integrations make goes through here: an optimizer instance's ``step``
(the monitor, Megatron), a class method (``DeepSpeedEngine._take_model_step``,
``Accelerator.clip_grad_norm_``), an engine instance's methods (DeepSpeed), module-level functions
(Megatron-LM's ``train_step``, wherever it was imported by name) and torch's random and dropout functions
(``seed_all``)::

    handle = patch(owner, "name", lambda original: replacement)    # any replacement
    handle = wrap(owner, "name", before=..., after=...)              # callbacks around the original
    handle = wrap(optimizer, "step", after=lambda token, result: ...)  # after sees the original's result
    handle.remove()                                                   # idempotent
    with wrap(optimizer, "step", after=...):                          # removed on leaving the block
        ...

- ``remove()`` may be called any number of times. It restores what was there before (the owner's own
  attribute, or nothing when the attribute was inherited) only while the attribute is still this patch's
  replacement. If something else was patched on top meanwhile (an LR scheduler wrapping
  ``optimizer.step``, another tool), that chain is left intact and a ``wrap`` replacement turns into a plain
  pass-through.
- ``wrap`` runs ``before`` / ``after`` under the "never break training" guard
  (``msprobe_core.common.never_break``): an exception there is logged and training goes on with the original's
  result (``guard=False`` for the few callbacks whose errors the user must see, such as the dump refusing a
  dump path that holds another run's files). Exceptions of the original itself always propagate.
- A function the toolkit puts in place carries one marker, ``MARKER``, whose value names the patch that
  made it (``mark`` / ``marked``), and ``__wrapped__``, the function it replaces (``functools``' convention).
  A patch that must not stack on itself (random_patch, seed_all's reseeding, the dump's API wrappers,
  Megatron's decorators) asks ``marked(fn, kind)`` before wrapping ``fn``.

The dump's L1 API wrapping (``msprobe_core.pytorch.api_patch``) is the one exception: it patches hundreds
of torch attributes at every ``start()`` and restores them at ``stop()`` from a plan built once, in tight
setattr loops, and restores them exactly (``stop()`` leaves torch as it was).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from types import ModuleType
from typing import Any, Callable, Optional, TypeVar

from msprobe_core.common.never_break import never_break

_MISSING = object()
_NO_GUARD = contextlib.nullcontext()

Before = Callable[..., Any]
"""``before(*args, **kwargs)`` gets the call's arguments (``self`` first for a class attribute); what it
returns is handed to ``after``."""
After = Callable[[Any, Any], Any]
"""``after(token, result)`` runs once the original returned; ``token`` is what ``before`` returned (or None),
``result`` what the original returned."""

MARKER = "__msprobe_patch__"
"""The attribute marking a function as one of the toolkit's replacements; its value is the patch's kind."""

_F = TypeVar("_F", bound=Callable[..., Any])


def mark(replacement: _F, kind: str, original: Any = _MISSING) -> _F:
    """Mark ``replacement`` as the toolkit's patch of kind ``kind`` (``wrap``, ``api``, ``random_patch``,
    ``no_dropout``, ``reseed``, ``megatron``); ``original``, when given, becomes its ``__wrapped__``."""
    setattr(replacement, MARKER, kind)
    if original is not _MISSING:
        replacement.__wrapped__ = original  # type: ignore[attr-defined]
    return replacement


def marked(fn: Any, kind: str) -> bool:
    """True when ``fn`` is the toolkit's replacement of kind ``kind`` (see ``mark``)."""
    return getattr(fn, MARKER, None) == kind


def _own(owner: Any) -> dict:
    try:
        return vars(owner)
    except TypeError:  # __slots__ objects have no __dict__
        return {}


class PatchHandle:
    """One attribute of one owner replaced by the toolkit. See the module docstring."""

    __slots__ = ("owner", "name", "original", "replacement", "_saved", "_active", "__weakref__")

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]):
        self.owner = owner
        self.name = name
        self._saved = _own(owner).get(name, _MISSING)
        # a class's own function as stored (called with self); else what attribute lookup gives
        self.original = self._saved if isinstance(owner, type) and self._saved is not _MISSING else getattr(owner, name)
        self.replacement = make(self.original)
        self._active = False
        self._set(self.replacement)
        self._active = True

    @property
    def active(self) -> bool:
        """True until ``remove()``."""
        return self._active

    @property
    def installed(self) -> bool:
        """True while the owner's attribute is this patch's replacement."""
        return _own(self.owner).get(self.name, _MISSING) is self.replacement

    def remove(self) -> None:
        """Undo the patch (idempotent); only where the attribute is still ours (see the module docstring)."""
        if not self._active:
            return
        self._active = False
        if not self.installed:
            return
        if self._saved is _MISSING:
            self._delete()
        else:
            self._set(self._saved)

    def _set(self, value: Any) -> None:
        if isinstance(self.owner, (type, ModuleType)):
            setattr(self.owner, self.name, value)
        else:  # an instance: bypass __setattr__ overrides (torch.nn.Module registers modules and parameters)
            object.__setattr__(self.owner, self.name, value)

    def _delete(self) -> None:
        if isinstance(self.owner, type):
            delattr(self.owner, self.name)
        else:
            _own(self.owner).pop(self.name, None)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        owner = getattr(self.owner, "__name__", type(self.owner).__name__)
        return f"<PatchHandle {owner}.{self.name} {'active' if self._active else 'removed'}>"


def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> PatchHandle:
    """Replace ``owner.name`` by ``make(original)`` (the original as found: a bound method for an instance,
    the function itself for a class or module) and return the handle that undoes it."""
    return PatchHandle(owner, name, make)


def wrap(owner: Any, name: str, *, before: Optional[Before] = None, after: Optional[After] = None,
         where: Optional[str] = None, logger: Optional[logging.Logger] = None, guard: bool = True) -> PatchHandle:
    """Patch ``owner.name`` with a wrapper that calls ``before`` and ``after`` around the original, each
    under the "never break training" guard; after ``remove()`` the wrapper (if still reachable through
    another patch on top) only calls the original. ``after(token, result)`` gets what ``before`` returned
    and what the original returned (it cannot change what the caller gets).

    ``guard=False`` lets the callbacks' exceptions through: for work whose failure the user must see
    before the step runs (the dump refusing a dump path that holds another run's files).
    """
    label = where or f"msprobe around {getattr(owner, '__name__', type(owner).__name__)}.{name}"
    holder: list[PatchHandle] = []
    protect = (lambda what: never_break(f"{label} ({what})", logger)) if guard else (lambda what: _NO_GUARD)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not holder or not holder[0].active:
                return original(*args, **kwargs)
            token = None
            if before is not None:
                with protect("before"):
                    token = before(*args, **kwargs)
            result = original(*args, **kwargs)
            if after is not None:
                with protect("after"):
                    after(token, result)
            return result

        return mark(wrapper, "wrap")

    handle = PatchHandle(owner, name, make)
    holder.append(handle)
    return handle
