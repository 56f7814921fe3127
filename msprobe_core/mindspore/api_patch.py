"""L1 API wrapping for MindSpore and mindtorch: the attributes a support_wrap_ops.yaml lists, patched between
``start()`` and ``stop()`` through the core's ``PatchHandle`` and restored exactly.

Native MindSpore uses ``msprobe_core/mindspore/support_wrap_ops.yaml`` (msprobe's MindSpore layout; record
prefixes ``Functional`` for ``mindspore.ops``, ``Tensor``, ``Mint`` for ``mindspore.mint``,
``MintFunctional`` for ``mindspore.mint.nn.functional``, ``Distributed``). Under mindtorch the code is
PyTorch's, so the PyTorch list applies (``msprobe_core/pytorch/support_wrap_ops.yaml``: ``Functional``,
``Tensor``, ``Torch``, ``Distributed``), as in msprobe. ``ops.Primitive`` instances held by the model's
cells are wrapped by their class (``PrimitiveWrapper``): ``Primitive.{attribute}.{Class}.{n}.forward``; a
``mindspore.jit`` function or cell is one record per call, ``Jit.{name}.{n}.forward``.

The plan (owner, name, wrapper) is built once; each ``patch()`` / ``restore()`` is a loop of
``PatchHandle``s. While dumping is off a wrapper costs one flag test.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

from msprobe_core.common.patch import PatchHandle, patch
from msprobe_core.dump.api_wrap import ApiHandler, is_api_wrapper, load_wrap_list, make_wrapper
from msprobe_core.mindspore.runtime import MINDTORCH

_HERE = os.path.dirname(os.path.abspath(__file__))
MINDSPORE_WRAP_LIST = os.path.join(_HERE, "support_wrap_ops.yaml")
PYTORCH_WRAP_LIST = os.path.join(os.path.dirname(_HERE), "pytorch", "support_wrap_ops.yaml")

def _mindspore_namespaces() -> dict[str, tuple[str, Callable[[], Any]]]:
    import mindspore

    def comm_func() -> Any:
        from mindspore.communication import comm_func as module
        return module

    return {"ops": ("Functional", lambda: mindspore.ops),
            "tensor": ("Tensor", lambda: mindspore.Tensor),
            "mint.ops": ("Mint", lambda: mindspore.mint),
            "mint.nn.functional": ("MintFunctional", lambda: mindspore.mint.nn.functional),
            "communication.comm_func": ("Distributed", comm_func)}


def _mindtorch_namespaces() -> dict[str, tuple[str, Callable[[], Any]]]:
    import torch  # mindtorch's proxy: PyTorch's names on MindSpore

    return {"functional": ("Functional", lambda: torch.nn.functional),
            "tensor": ("Tensor", lambda: torch.Tensor),
            "torch": ("Torch", lambda: torch),
            "_VF": ("VF", lambda: torch._VF),
            "distributed": ("Distributed", lambda: torch.distributed)}


def namespaces(framework: str) -> dict[str, tuple[str, Callable[[], Any]]]:
    """yaml section -> (record prefix, owner getter) of ``framework`` ('mindspore' or 'mindtorch')."""
    return _mindtorch_namespaces() if framework == MINDTORCH else _mindspore_namespaces()


class ApiPatcher:
    """The wrap list's patch plan for one framework, applied by ``patch()`` and undone by ``restore()``."""

    def __init__(self, framework: str, handler: ApiHandler, should_record: Callable[[], bool],
                 wrap_list: Optional[str] = None):
        self._framework = framework
        self._handler = handler
        self._should_record = should_record
        self._wrap_list = wrap_list or (PYTORCH_WRAP_LIST if framework == MINDTORCH else MINDSPORE_WRAP_LIST)
        self._plan: Optional[list[tuple[Any, str, Callable]]] = None
        self._handles: list[PatchHandle] = []

    def prepare(self) -> int:
        """Build the plan now (reading and checking the wrap list); returns how many APIs it wraps."""
        if self._plan is None:
            sections = namespaces(self._framework)
            plan = []
            for section, names in load_wrap_list(self._wrap_list, sections).items():
                prefix, get_owner = sections[section]
                try:
                    owner = get_owner()
                except (AttributeError, ImportError, RuntimeError):
                    continue  # not in this build (e.g. communication without its libraries)
                for name in dict.fromkeys(names):
                    original = getattr(owner, name, None)
                    if not callable(original) or isinstance(original, type) \
                            or is_api_wrapper(original):
                        continue  # absent in this version, a class, or already ours
                    plan.append((owner, name, make_wrapper(original, prefix, name, self._handler,
                                                           self._should_record)))
            executor = _jit_executor()
            if executor is not None:
                plan.append((executor, "__call__", self._jit_wrapper(executor.__call__)))
            self._plan = plan
        return len(self._plan)

    def _jit_wrapper(self, original_call: Callable) -> Callable:
        """``mindspore.jit`` functions and cells run as one compiled graph: each call is one record,
        ``Jit.{function or Cell class}.{n}.forward`` (msprobe's ``Jit`` prefix)."""
        handler, should_record = self._handler, self._should_record

        def __call__(executor, *args, **kwargs):
            if should_record():
                obj = getattr(executor, "obj", None)
                if obj is not None and args and args[0] is obj:  # a jit cell: the cell is not an input
                    return handler(functools.partial(original_call, executor, obj), "Jit", type(obj).__name__,
                                   args[1:], kwargs)
                name = getattr(executor.fn, "__name__", "jit")
                return handler(functools.partial(original_call, executor), "Jit", name, args, kwargs)
            return original_call(executor, *args, **kwargs)

        return __call__

    @property
    def patched(self) -> bool:
        return bool(self._handles)

    def patch(self) -> None:
        if self._handles:
            return
        self.prepare()
        assert self._plan is not None
        self._handles = [patch(owner, name, lambda _, w=wrapper: w) for owner, name, wrapper in self._plan]

    def restore(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []

    @staticmethod
    def call(original: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a recorded API's original (the PyTorch patcher's hook for its operator mode; none here)."""
        return original(*args, **kwargs)


def _jit_executor() -> Optional[type]:
    """MindSpore's executor of ``jit`` calls (created and called once per call), if this version has it."""
    try:
        from mindspore.common import api
    except ImportError:  # pragma: no cover
        return None
    executor = getattr(api, "_JitExecutor", None) or getattr(api, "_MindsporeFunctionExecutor", None)
    return executor if isinstance(executor, type) and "__call__" in vars(executor) else None


class PrimitiveWrapper:
    """Records calls of the ``ops.Primitive`` instances a model's cells hold as attributes.

    A primitive is called through its class's ``__call__``, so each hooked instance gets, for the time of
    the dump, a subclass (made once per primitive class) whose ``__call__`` asks the handler; ``restore()``
    gives every instance its class back.
    """

    PREFIX = "Primitive"

    def __init__(self, handler: ApiHandler, should_record: Callable[[], bool]):
        self._handler = handler
        self._should_record = should_record
        self._subclasses: dict[type, type] = {}
        self._names: dict[int, str] = {}  # id(primitive) -> "{attribute}.{Class}"
        self._hooked: list[tuple[Any, type]] = []

    def hook_cells(self, cells) -> None:
        """Wrap every primitive held by ``cells`` (an iterable of cells)."""
        from mindspore.ops import Primitive

        seen = {id(p) for p, _ in self._hooked}
        for cell in cells:
            held = dict(getattr(cell, "_primitives", None) or {})
            held.update({k: v for k, v in vars(cell).items() if isinstance(v, Primitive)})
            for attr, prim in held.items():
                if not isinstance(prim, Primitive) or id(prim) in seen:
                    continue
                seen.add(id(prim))
                cls = type(prim)
                self._names[id(prim)] = f"{attr}.{cls.__name__}"
                prim.__class__ = self._subclass(cls)
                self._hooked.append((prim, cls))

    def _subclass(self, cls: type) -> type:
        sub = self._subclasses.get(cls)
        if sub is None:
            original_call = cls.__call__
            handler, should_record, names, prefix = self._handler, self._should_record, self._names, self.PREFIX

            def __call__(prim, *args, **kwargs):
                if should_record():
                    return handler(functools.partial(original_call, prim), prefix, names[id(prim)], args, kwargs)
                return original_call(prim, *args, **kwargs)

            sub = self._subclasses[cls] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                                       "__module__": cls.__module__})
        return sub

    def restore(self) -> None:
        for prim, cls in self._hooked:
            prim.__class__ = cls
        self._hooked.clear()
        self._names.clear()
