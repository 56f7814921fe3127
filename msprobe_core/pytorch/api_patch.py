"""L1 API wrapping: the torch attributes listed in support_wrap_ops.yaml, patched and restored exactly.

The plan (which attribute of which owner, its original value, whether the owner held it itself or
inherited it, and the wrapper) is built once per process; ``patch()`` and ``restore()`` are then tight
loops of setattr/delattr. After ``restore()`` every owner's ``__dict__`` is as it was before ``patch()``.

Operator dunders that ``torch.Tensor`` inherits from its C base (``__add__``, ``__getitem__``, ...) are
not set on the class: assigning and deleting one rewires CPython's type slots for good (a deleted
``__getitem__`` leaves ``torch.Tensor`` looking like a sequence, which breaks ``torch.tensor(list of
0-d tensors)`` under any TorchFunctionMode). They are seen through a ``TorchFunctionMode`` pushed
between ``patch()`` and ``restore()`` instead, which leaves the class untouched.

An ``aten`` section (ATen operators) is seen through a ``TorchDispatchMode`` pushed the same way
(``aten_dispatch``); the sections of msprobe's own file for libraries not hooked here (``NOT_HOOKED``:
torch_npu, mindspeed...) are skipped with a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from msprobe_core.dump import api_wrap
from msprobe_core.dump.api_wrap import make_wrapper
from msprobe_core.pytorch.aten_dispatch import AtenDispatch
from msprobe_core.pytorch.wrapper_names import FRAME_STRATEGIES, never_traced
from msprobe_core.stats.kernel import KERNEL

DEFAULT_WRAP_LIST = os.path.join(os.path.dirname(__file__), "support_wrap_ops.yaml")

# yaml section -> (record prefix, owner getter)
NAMESPACES: dict[str, tuple[str, Callable[[], Any]]] = {
    "functional": ("Functional", lambda: torch.nn.functional),
    "tensor": ("Tensor", lambda: torch.Tensor),
    "torch": ("Torch", lambda: torch),
    "_VF": ("VF", lambda: torch._VF),
    "distributed": ("Distributed", lambda: torch.distributed),
}
ATEN_SECTION = "aten"  # ATen operators, seen through a TorchDispatchMode (``aten_dispatch``)
NOT_HOOKED = ("torch_npu", "npu_distributed", "mindspeed", "triton")
"""Sections of msprobe's own support_wrap_ops.yaml for libraries this build does not hook: skipped with a warning."""

_stack_len = torch._C._len_torch_function_stack
_stack_at = torch._C._get_function_stack_at
_stack_pop = torch._C._pop_torch_function_stack
_stack_push = torch._C._push_on_torch_function_stack
_mode_on = torch._C._is_torch_function_mode_enabled
_ModePass = getattr(KERNEL, "ModePass", None) if FRAME_STRATEGIES else None
"""The mode's pass-through in C (``_DunderMode``); None without the extension, and on torch 2.6 (no frame
strategies), whose Dynamo reads the mode's ``__torch_function__.__func__`` (the pass-through has none) and, given
one, crashed (segmentation fault) compiling the frames the pass-through called inside compiled code."""
_dynamo_callback = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_dynamo_callback = getattr(_dynamo_callback, "get_eval_frame_callback", None)
"""torch's Dynamo callback of this thread (None outside compiled code; this function None: ``ModePass`` then
gives every planned function to the mode's method)."""

ApiHandler = api_wrap.ApiHandler
# (original, prefix, api, the usual wrapper) -> a faster wrapper for that API, or None (``api_fast``)
FastWrapper = Callable[[Callable, str, str, Callable], Optional[Callable]]


@dataclass
class PatchSlot:
    owner: Any
    attr: str
    original: Any
    owned: bool  # the attribute was in owner.__dict__ (restore with setattr) or inherited (restore with delattr)
    wrapper: Callable


def load_wrap_list(path: Optional[str] = None) -> dict[str, list[str]]:
    """Read a support_wrap_ops.yaml (msprobe's layout: namespace -> list of API names)."""
    return api_wrap.load_wrap_list(path or DEFAULT_WRAP_LIST, [*NAMESPACES, ATEN_SECTION], NOT_HOOKED)


# torch's own entry points whose internal API calls (e.g. ``torch.ones_like`` for the initial gradient)
# are not the user's: while they run, nothing is recorded.
SILENT = (("autograd", "backward"), ("autograd", "grad"))


def _probe_dunder(name: str) -> Optional[Callable]:
    """The function a TorchFunctionMode receives when ``torch.Tensor.<name>`` runs (e.g. ``Tensor.add``
    for ``__add__``), found by calling it once on small tensors; None if no call shape works."""
    seen: list = []

    class _Probe(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not seen:
                seen.append(func)
            return func(*args, **(kwargs or {}))

    method = getattr(torch.Tensor, name)
    for make in (lambda: (torch.ones(2),), lambda: (torch.ones(2), torch.ones(2)), lambda: (torch.ones(2), 1),
                 lambda: (torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)),
                 lambda: (torch.ones(2), 0, 1.0), lambda: (torch.ones(2, 2), torch.ones(2, 2))):
        seen.clear()
        args = make()
        try:
            with torch.no_grad(), _Probe():
                result = method(*args)
        except Exception:
            continue
        if seen and result is not NotImplemented:
            return seen[0]
    return None


class _DunderMode(TorchFunctionMode):
    """Sees the inherited operator dunders of the plan (``funcs``: mode func -> (prefix, dunder name, the fast
    route's wrapper or None)).

    torch sends every overridable call through the mode while it is on (``.grad``, ``is_complex``, ``item``...):
    where the extension has it, the instance's ``__torch_function__`` is ``ModePass`` (``stats/_fast_api.c``),
    which calls a function outside the plan itself, without a Python frame, a function with the fast route's
    wrapper that wrapper (as the method below would) outside compiled code, and gives the others to the method
    below.

    Invisible to ``torch.compile`` (``never_traced``): a function compiled while the mode is on (vLLM compiles
    ``get_masked_input_and_mask`` even in eager mode) would otherwise have Dynamo trace the mode's lookups and
    the dump's state, guard on them and fail ("Guard failed on the same frame it was created") or recompile at
    every call. Dynamo breaks the graph at each operator the mode sees instead; the operator runs eagerly
    through the mode, recorded like any eager call, and computes what it computes without the tool."""

    def __init__(self, funcs: dict, handler: ApiHandler, should_record: Callable[[], bool]):
        super().__init__()
        self.funcs = funcs
        self.handler = handler
        self.should_record = should_record
        if _ModePass is not None:  # torch looks ``__torch_function__`` up on the mode: the compiled pass-through
            self.__torch_function__ = _ModePass(funcs, self.__torch_function__, _dynamo_callback)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = self.funcs.get(func)
        if entry is not None and entry[2] is not None:  # it decides itself whether to record
            return entry[2](*args, **kwargs)
        if entry is not None and self.should_record():
            return self.handler(func, entry[0], entry[1], args, kwargs)
        return func(*args, **kwargs)


never_traced(_DunderMode.__torch_function__)


class ApiPatcher:
    """Builds the patch plan from a wrap list and applies/restores it."""

    def __init__(self, handler: ApiHandler, should_record: Callable[[], bool], wrap_list: Optional[str] = None,
                 silence: Optional[Callable[[Callable], Callable]] = None, fast: Optional[FastWrapper] = None):
        self._handler = handler
        self._fast = fast  # the dump's fast route, asked once per API when the plan is built
        self._silence = silence
        self._should_record = should_record
        self._wrap_list = wrap_list
        self._slots: Optional[list[PatchSlot]] = None
        self._dunders: dict = {}
        self._mode: Optional[_DunderMode] = None
        self._aten_names: frozenset[str] = frozenset()
        self._aten: Optional[AtenDispatch] = None
        self.patched = False

    def _plan(self) -> list[PatchSlot]:
        if self._slots is not None:
            return self._slots
        slots: list[PatchSlot] = []
        for section, names in load_wrap_list(self._wrap_list).items():
            if section == ATEN_SECTION:
                self._aten_names = frozenset(names)
                continue
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
                if owner is torch.Tensor and name.startswith("__") and name not in own_dict:
                    func = _probe_dunder(name)
                    if func is not None:
                        self._dunders.setdefault(func, (prefix, name))
                    continue
                if not callable(original) or api_wrap.is_api_wrapper(original):
                    continue
                slots.append(PatchSlot(owner, name, own_dict.get(name, original), name in own_dict,
                                       self._wrapper(original, prefix, name)))
        # An operator reaches the mode as the *current* torch.Tensor attribute of the method it dispatches to:
        # our wrapper when that method is patched too (``a + b`` -> the ``add`` wrapper), so key it as well.
        for slot in slots:
            if slot.owner is torch.Tensor and slot.wrapper.__wrapped__ in self._dunders:
                self._dunders.setdefault(slot.wrapper, self._dunders[slot.wrapper.__wrapped__])
        for func, (prefix, name) in self._dunders.items():
            self._dunders[func] = (prefix, name, self._fast_route(func, prefix, name))
        if self._silence is not None:
            for owner_name, name in SILENT:
                owner = getattr(torch, owner_name)
                original = owner.__dict__[name]
                slots.append(PatchSlot(owner, name, original, True, self._silence(original)))
        self._slots = slots
        return slots

    def _wrapper(self, original: Callable, prefix: str, api: str) -> Callable:
        """The wrapper standing for ``original`` while patched: the fast route's where it has one."""
        plain = make_wrapper(original, prefix, api, self._handler, self._should_record)
        fast = self._fast_route(original, prefix, api, plain)
        return plain if fast is None else api_wrap.as_wrapper(fast, original)

    def _fast_route(self, original: Callable, prefix: str, api: str, plain: Optional[Callable] = None
                    ) -> Optional[Callable]:
        """The fast route's wrapper of ``original`` (``plain``: the usual one, which it runs while Dynamo
        traces), or None: that API, or an operator the mode sees, is recorded through the handler."""
        if self._fast is None:
            return None
        return self._fast(original, prefix, api,
                          plain or make_wrapper(original, prefix, api, self._handler, self._should_record))

    def patch(self) -> None:
        if self.patched:
            return
        for s in self._plan():
            setattr(s.owner, s.attr, s.wrapper)
        if self._dunders:
            self._mode = _DunderMode(self._dunders, self._handler, self._should_record)
            self._mode.__enter__()
        if self._aten_names:
            self._aten = AtenDispatch(self._aten_names, self._handler, self._should_record)
            self._aten.__enter__()
        self.patched = True

    def call(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a recorded API's original with the operator mode off when it is the innermost mode (it
        would only pass the call through again); other modes and tensor subclasses still see it."""
        mode = self._mode
        depth = _stack_len() if mode is not None else 0
        if depth == 0 or _stack_at(depth - 1) is not mode:
            return original(*args, **kwargs)
        _stack_pop()
        try:
            return original(*args, **kwargs)
        finally:
            _stack_push(mode)

    def foreign_mode_on(self) -> bool:
        """Is a TorchFunctionMode on other than this patcher's operator mode? The compiled L0 hooks' test for
        their usual call (``mode_enabled``): the operator mode passes every attribute read of theirs through
        unchanged (no read is an operator of the plan, and they read at the tool's depth), so under it alone (the
        mix level) their records are the Python route's, made without its frames."""
        if not _mode_on():
            return False
        mode = self._mode
        return mode is None or _stack_len() != 1 or _stack_at(0) is not mode

    def restore(self) -> None:
        if not self.patched:
            return
        if self._aten is not None:
            self._aten.__exit__(None, None, None)
            self._aten = None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
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
