"""The MindSpore dump service (native MindSpore and MSAdapter's mindtorch): Cell/Module hooks, API wrappers,
record naming behind ``msprobe_core.mindspore.PrecisionDebugger``.

The core does the rest, shared with PyTorch: the record life cycle (``dump.service``: start/stop/step,
the dumping-thread policy, folders and "never overwrite", the crash-safe journal, JSON files at stop() once
the backward ran, close at exit, overflow_check on inputs and outputs, ``save``, ``module_dump``), the
config (``dump.config``), record selection (``dump.selection``), summaries (``dump.summarize``) and the
tensor-file writer process (``dump.tensor_files``: ``.npy`` files).

Records (msprobe's MindSpore and MSAdapter names):

- L0: ``Cell.{path}.{Class}.forward.{n}`` (native) or ``Module.{path}.{Class}.forward.{n}`` (mindtorch),
  with ``.backward.{n}`` and ``.parameters_grad.{k}``;
- L1: ``{Prefix}.{api}.{n}.forward`` / ``.backward`` (``Mint``, ``MintFunctional``, ``Functional``,
  ``Tensor``, ``Distributed``; mindtorch: ``Functional``, ``Tensor``, ``Torch``), and
  ``Primitive.{attribute}.{Class}.{n}.forward`` for the ``ops.Primitive`` instances of the model's cells.

Gradients are captured with MindSpore's tensor hooks (``Tensor.register_hook``'s registration), which
return nothing, for the calls recorded while ``value_and_grad`` / ``grad`` records the forward pass:
backward ``input`` holds the gradients of a call's outputs; backward ``output`` the gradient the call
itself sends to each tensor input (its share, when other calls use the input too, as PyTorch's dump
reports it), read on a view of the input made for that call (``_call_inputs``); ``parameters_grad`` the
parameters' gradients. The tool's own work only reads tensors and never feeds autograd, so losses and
gradients are bit-identical with the dump on (tested).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Optional

from msprobe_core.dump.config import DumpConfig
from msprobe_core.dump.service import Call, DumpServiceBase, saves_files
from msprobe_core.dump.tensor_files import TensorFiles
from msprobe_core.files.call_stack import StackCapture
from msprobe_core.mindspore import tensor_stats
from msprobe_core.mindspore.api_patch import ApiPatcher, PrimitiveWrapper
from msprobe_core.mindspore.runtime import (MINDTORCH, Parameter, Tensor, current_rank, framework, numel,
                                            odd_tensor_reason, recording_grad, register_grad_hook, tensors_on_host)
from msprobe_core.mindspore.summarize import Summarizer, tensors_in

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STACKS = StackCapture((_OWN_DIR,), ("mindspore/nn/cell.py", "mindtorch/nn/modules/module.py",
                                      "mindspore/ops/primitive.py", "mindspore/graph/_utils/check_jit_forbidden_api.py"))


class _Quiet:
    """The tool's own work needs no switch in MindSpore (it never feeds autograd); entering returns whether
    autograd records the current forward pass."""

    __slots__ = ()

    def __enter__(self) -> bool:
        return recording_grad()

    def __exit__(self, *exc) -> None:
        return None


_QUIET = _Quiet()


class DumpService(DumpServiceBase):
    """One process's MindSpore dump: configuration, current step, hooks and the step's recorders."""

    def __init__(self, cfg: DumpConfig, wrap_list: Optional[str] = None):
        name = framework()
        native = name != MINDTORCH
        on_host = tensors_on_host()
        files = TensorFiles() if saves_files(cfg) else None
        super().__init__(cfg, Summarizer(statistics=cfg.task != "structure", md5=cfg.summary_mode == "md5",
                                         on_host=on_host, read_pointers=native, files=files), files)
        self.framework = name
        self.module_prefix = "Cell" if native else "Module"
        self.module_word = "cells" if native else "modules"
        self.model_kind = "a mindspore.nn.Cell" if native else "a torch.nn.Module (mindtorch)"
        self._on_host = on_host
        self.set_patcher(ApiPatcher(self.framework, self._on_api_call, self.should_record, wrap_list)
                         if self._uses_l1 else None)
        self.primitives = PrimitiveWrapper(self._on_api_call, self.should_record) if self._uses_l1 and native else None
        self.hooks_l1_models = self.primitives is not None
        self._param_hooked: set[int] = set()

    # ================================================================== framework hooks
    def _current_rank(self) -> Optional[int]:
        return current_rank()

    def _is_model(self, obj: Any) -> bool:
        from mindspore import nn

        if isinstance(obj, nn.Cell):
            return True
        if self.framework == MINDTORCH:
            import torch  # mindtorch's

            return isinstance(obj, torch.nn.Module)
        return False

    def _named_modules(self, root: Any):
        return root.cells_and_names() if hasattr(root, "cells_and_names") else root.named_modules()

    def _own_parameters(self, cell: Any) -> list[tuple[str, Any]]:
        params = getattr(cell, "_params", None)
        if params is None:
            params = getattr(cell, "_parameters", None) or {}
        return [(k, v) for k, v in params.items() if v is not None]

    def _hook_param_grad(self, param: Any, hook: Callable) -> None:
        if param.requires_grad and id(param) not in self._param_hooked:  # a shared parameter: its first cell
            self._param_hooked.add(id(param))
            self._step_handles.append(register_grad_hook(param, hook))

    def _hook_tensor_grad(self, t: Tensor, hook: Callable) -> None:
        handle = register_grad_hook(t, hook)
        if isinstance(t, Parameter):  # hooks on parameters outlive the step's graph
            self._step_handles.append(handle)

    def _wants_grad(self, t: Tensor) -> bool:
        """Float and complex tensors get gradients; integer and bool tensors do not."""
        return tensor_stats.kind_of(t.dtype) in ("float", "complex")

    _tensors_in = staticmethod(tensors_in)

    def _on_device(self, tensors: list) -> bool:
        return not self._on_host

    def _overflow_flag(self, t: Tensor) -> bool:
        if not numel(t) or tensor_stats.kind_of(t.dtype) not in ("float", "complex") or odd_tensor_reason(t):
            return False
        if self._on_host:
            return tensor_stats.overflowed(tensor_stats.host_stats(t, self.summarizer.read_pointers))
        return not bool(tensor_stats.host_array(tensor_stats.device_all_finite(t), read_pointer=False))

    def _any_overflow(self, flags: list) -> bool:
        return any(flags)

    def _quiet(self) -> _Quiet:
        return _QUIET

    def _capture_stack(self) -> Any:
        return _STACKS.capture(3)

    def _grad_recording(self) -> bool:
        return recording_grad()

    def _before_hooking(self, cells: list) -> None:
        if self.primitives is not None:
            self.primitives.hook_cells(cells)

    def _unpatch(self) -> None:
        super()._unpatch()
        if self.primitives is not None:
            self.primitives.restore()

    def _finish_step(self) -> None:
        super()._finish_step()
        self._param_hooked.clear()

    # ================================================================== backward output records
    def _call_inputs(self, call: Call, args: tuple, kwargs: dict, api: str) -> tuple[tuple, dict]:
        """The call's arguments for its backward ``output`` record: the gradient this call sends to each of
        its tensor inputs (its share, for an input other calls also use, as PyTorch's dump reports it).
        Each input is passed as a view made for this call alone, whose gradient hook sees exactly that
        share; a view is free (no copy, no kernel) and leaves autograd's sums as they are. Parameters and
        the inputs of in-place APIs are hooked themselves (a view would take the in-place write)."""
        if not (call.grad and self.selection.keeps("backward", "output")):
            return args, kwargs
        in_place = _in_place(api)
        index = iter(range(1 << 30))
        parent = call.backward_parent()

        def hook(t: Tensor) -> Tensor:
            i = next(index)
            if not self._wants_grad(t):
                return t
            on_grad = partial(self._on_grad, call.backward, "output", i, call.save, parent)
            if in_place or isinstance(t, Parameter):
                self._hook_tensor_grad(t, on_grad)
                return t
            alias = _view(t, t.shape)
            register_grad_hook(alias, on_grad)
            return alias

        return _map_tensors(args, hook), _map_tensors(kwargs, hook)


_view = Tensor.view  # captured before any API is wrapped


def _in_place(api: str) -> bool:
    """Does the API write into its input (``add_``, ``__iadd__``, ``ops.assign``, ``inplace_add``,
    ``scatter_update``, an ``Assign`` primitive)?"""
    name = api.rsplit(".", 1)[-1]
    lower = name.lower()
    return ((name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
            or lower.startswith(("assign", "inplace")) or "update" in lower)


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, in ``tensors_in``'s order."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj
