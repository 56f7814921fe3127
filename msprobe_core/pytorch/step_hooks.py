"""The hooks the dump installs for a step (gradient hooks) or between start() and stop() (module hooks), kept
for their removal as hook dicts and keys instead of torch's handle objects; and a model's module hooks kept
from one start() to the next (``HookPlan``), put back as dict entries instead of registered again.

A torch hook handle (``RemovableHandle``) is two to four objects Python's garbage collector tracks (the
handle and its weak references to the hook dicts). Kept for the whole step, thousands of them (one per
hooked call, two per module) add to the objects that reach the collector's oldest generation and bring on
full collections of the training's whole heap. Here the handle is dropped at once; its key and hook dicts
go into one flat list, and ``remove`` deletes exactly those keys, as ``RemovableHandle.remove`` would.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from msprobe_core.stats.kernel import KERNEL

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_remove_fast = getattr(KERNEL, "remove_hooks", None)  # ``StepHooks.remove``'s loop in C (None: no kernel)
_valid_fast = getattr(KERNEL, "plan_valid", None)  # ``HookPlan.still_valid``'s loop in C (None: no kernel)
_hooks_fast = getattr(KERNEL, "tensor_hooks", None)  # ``StepHooks.tensor_hooks``' loop in C (None: no kernel)


def next_hook_id() -> int:
    """A key no torch hook dict uses: the next ``RemovableHandle`` id, taken as torch takes it."""
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    return key


def add_tensor_hook(t: Any, hook: Callable) -> Optional[tuple[int, dict]]:
    """``t.register_hook(hook)`` for a plain tensor (``torch.Tensor``, ``Parameter``) without the handle object:
    the entry torch's ``register_hook`` makes (a fresh int key at the end of the tensor's ``_backward_hooks``,
    the dict made and given to its ``grad_fn`` on first use), about a fifth of its cost. Returns (key, the hook
    dict) for the caller to remove it by; None, with nothing done, for a subclass (which takes
    ``register_hook``: it may route the call elsewhere)."""
    if type(t) is not _Tensor and type(t) is not _Parameter:
        return None
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()  # an OrderedDict, as torch's (handles weakref it)
        fn = t.grad_fn
        if fn is not None:
            fn._register_hook_dict(t)
    key = RemovableHandle.next_id  # ``next_hook_id``, inline: one frame less per hook
    RemovableHandle.next_id = key + 1
    hooks[key] = hook
    return key, hooks


class StepHooks:
    """Hook handles, held without the handle objects."""

    __slots__ = ("_flat",)

    def __init__(self) -> None:
        self._flat: list[Any] = []  # key, number of dicts, the dicts, key, number of dicts, ...

    def __bool__(self) -> bool:
        return bool(self._flat)

    def keep(self, handle: Any) -> None:
        """Hold ``handle``'s hook (a ``torch.utils.hooks.RemovableHandle``) for ``remove``."""
        flat = self._flat
        extra = handle.extra_dict_ref or ()
        flat.append(handle.id)
        flat.append(1 + len(extra))
        flat.append(handle.hooks_dict_ref())
        for ref in extra:
            flat.append(ref())

    def keep_keys(self, flat: list) -> None:
        """Hold hooks put in their dicts without a handle, given as ``flat``: key, number of dicts, the dicts,
        key, ... (the form ``remove`` reads)."""
        self._flat += flat

    def tensor_hook(self, t: Any, hook: Callable) -> None:
        """``t.register_hook(hook)``, held for ``remove`` (``add_tensor_hook``: no handle for a plain tensor)."""
        added = add_tensor_hook(t, hook)
        if added is None:  # a subclass: torch's own way
            self.keep(t.register_hook(hook))
        else:
            self._flat += (added[0], 1, added[1])

    def tensor_hooks(self, pairs: list, other: Callable[[Any, Callable], None]) -> None:
        """``tensor_hook(t, hook)`` of each (t, hook) in ``pairs`` that is a plain tensor (``torch.Tensor``,
        ``Parameter``) requiring grad, in one loop (a model's parameter hooks at each start(): no frames per
        parameter but ``add_tensor_hook``'s); ``other(t, hook)`` for each one that is not a plain tensor."""
        flat = self._flat
        if _hooks_fast is not None:  # the same loop in C (no frame per parameter)
            _hooks_fast(flat, pairs, other, _Tensor, _Parameter, RemovableHandle, OrderedDict)
            return
        for t, hook in pairs:
            if type(t) is not _Tensor and type(t) is not _Parameter:
                other(t, hook)
            elif t.requires_grad:
                key, hooks = add_tensor_hook(t, hook)
                flat += (key, 1, hooks)

    def remove(self) -> None:
        """Remove every hook kept since the last ``remove``."""
        flat, self._flat = self._flat, []
        if _remove_fast is not None:
            _remove_fast(flat)
            return
        i, end = 0, len(flat)
        while i < end:
            key, n = flat[i], flat[i + 1]
            i += 2
            if n == 1:  # the usual case (a tensor's or a node's hook): no slice made
                hooks = flat[i]
                if hooks is not None:
                    hooks.pop(key, None)
            else:
                for hooks in flat[i:i + n]:
                    if hooks is not None:
                        hooks.pop(key, None)
            i += n


def _same(mine: dict, kept: dict) -> bool:
    """Does ``mine`` hold exactly ``kept``'s entries (the same objects)?"""
    if len(mine) != len(kept):
        return False
    if mine:  # (a leaf module has no children, an activation no parameters: nothing to walk)
        for k, v in mine.items():
            if kept.get(k, mine) is not v:
                return False
    return True


class HookPlan:
    """The module hooks and parameter-gradient hooks one start() installed on a model, to put back at the next
    start() as they were (same hooks, same keys, each at the end of its dict as registering it puts it) while
    the model is as it was: the same modules, classes and parameters, nothing compiled. Holds no reference to
    the model's root (a plan lives as long as its root, in a ``WeakKeyDictionary``)."""

    __slots__ = ("prefix", "entries", "flat", "params", "modules", "usable")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix  # the names' model index ("0." of a list of models), part of what the hooks record
        self.usable = True    # False: a hook the plan cannot put back by itself (sharded parameters)
        self.entries: list[tuple[dict, int, Any]] = []  # the module hooks' dict entries: dict, key, value
        self.flat: list[Any] = []                        # the same for their removal (``StepHooks.keep_keys``)
        self.params: list[tuple[Any, Callable]] = []     # parameter, its gradient hook
        self.modules: list[tuple[Any, type, dict, dict]] = []  # module, class, children, parameters (copies)

    def add_forward(self, handle: RemovableHandle) -> None:
        """A module hook just registered (``handle``): its dict entries, as registering made them."""
        key = handle.id
        dicts = [d for d in (handle.hooks_dict_ref(), *(ref() for ref in handle.extra_dict_ref or ()))
                 if d is not None and key in d]
        self.entries += [(d, key, d[key]) for d in dicts]
        self.flat += (key, len(dicts), *dicts)

    def seal(self, root: Any, modules: list) -> None:
        """The plan is complete: note the model's structure (``modules``, root first) to check it at ``still_valid``."""
        self.modules = [(m, type(m), dict(m._modules), dict(m._parameters)) for m in modules if m is not root]
        self.modules.insert(0, (None, type(root), dict(root._modules), dict(root._parameters)))

    def still_valid(self, root: Any) -> bool:
        """Is ``root`` still the model the plan was made for (same modules, classes, parameters; not compiled)?"""
        if _valid_fast is not None:
            valid = _valid_fast(root, self.modules)
            if valid is not None:  # (None: a module's dicts are not plain dicts of str keys: decided below)
                return valid
        for m, cls, children, params in self.modules:
            if m is None:
                m = root
            if type(m) is not cls or getattr(m, "_compiled_call_impl", None) is not None:
                return False
            if not (_same(m._modules, children) and _same(m._parameters, params)):
                return False
        return True

    def install(self, hooks: StepHooks) -> None:
        """Put the module hooks back, each held by ``hooks`` for its removal."""
        for d, key, value in self.entries:
            d[key] = value
        hooks.keep_keys(self.flat)
