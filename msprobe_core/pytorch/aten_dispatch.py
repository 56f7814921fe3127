"""msprobe's ``Aten`` records: the ATen operators a wrap list's ``aten`` section names, seen through a
``TorchDispatchMode`` pushed between ``start()`` and ``stop()``.

A listed operator is recorded as ``Aten.{op}.{overload}.{n}.forward`` (``Aten.addmm.default.0.forward``)
when it runs outside every recorded call: called directly (``torch.ops.aten.addmm(...)``), or inside an
API or method the wrap list does not name. Inside a recorded ``Torch``/``Functional``/``Tensor`` call its
ATen operators are that call's own work and are not recorded again, as for every nested call. The mode
sits below autograd, where a call's outputs have no ``grad_fn`` yet, so ``Aten`` records have no backward
record. The operator runs exactly as without the mode: the numbers are the same.

The section lists operator names (``addmm``, every overload) or overloads (``addmm.default``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PREFIX = "Aten"

_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_UNSEEN = object()


class AtenDispatch(TorchDispatchMode):
    """Hands each listed ATen operator to ``handler(op, "Aten", "addmm.default", args, kwargs)`` while
    ``should_record()``; runs every other operator as is."""

    def __init__(self, names: Iterable[str], handler: Callable, should_record: Callable[[], bool]):
        super().__init__()
        self.names = frozenset(names)
        self.handler = handler
        self.should_record = should_record
        self._apis: dict[Any, Optional[str]] = {}  # operator overload -> its record name, None if not listed

    def _api(self, func: Any) -> Optional[str]:
        if getattr(func, "namespace", None) != "aten":
            return None
        packet = func.overloadpacket.__name__
        full = f"{packet}.{func._overloadname}"
        return full if packet in self.names or full in self.names else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        api = self._apis.get(func, _UNSEEN)
        if api is _UNSEEN:
            api = self._apis[func] = self._api(func)
        if api is None or not self.should_record():
            return func(*args, **kwargs)
        grad = _is_grad_enabled()
        if grad:  # below autograd: the record takes no gradient hooks (see the module docstring)
            _set_grad_enabled(False)
        try:
            return self.handler(func, PREFIX, api, args, kwargs)
        finally:
            if grad:
                _set_grad_enabled(True)
