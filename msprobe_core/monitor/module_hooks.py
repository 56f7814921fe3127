"""Activation statistics from module hooks that cannot change the numbers.

* Forward: ``register_forward_hook(with_kwargs=True)`` sees a module's inputs and outputs; statistics are
  computed at once (under ``no_grad``, on detached tensors) so later in-place ops cannot alter them.
* Backward: a tensor hook (``Tensor.register_hook``) on each monitored input/output that requires grad
  receives the gradient of the loss with respect to that tensor; the hook returns None, so the gradient
  flows on untouched. ``register_full_backward_hook`` is never used: it wraps inputs and outputs in
  identity autograd nodes and changes the graph.
* A tensor seen twice (the output of ``ln`` is the input of the next ``linear``) is summarised once and
  gets both names; the backward hook is registered once per tensor.
* Micro-batches are counted by a forward pre-hook on each model chunk. Forward calls made while
  autograd runs backward (activation recomputation for gradient checkpointing) and calls of modules in
  eval mode are skipped. Inputs that do not require grad get no backward hook (so no placeholder NaN).
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msprobe_core.monitor.collector import StepCollector
from msprobe_core.monitor.config import IOSpec
from msprobe_core.monitor.records import ACTV, ACTV_GRAD
from msprobe_core.common.tool_guard import tool_work
from msprobe_core.pytorch.native_shards import local_view
from msprobe_core.pytorch.wrapper_names import is_compiled, opaque_to_compiler, unwrapped_modules

logger = logging.getLogger("msprobe_core.monitor")

ROOT_NAME = "model"
"""Name used for a model chunk's root module (whose ``named_modules`` name is empty)."""

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. recomputation in gradient checkpointing)."""
    return _graph_task_id is not None and _graph_task_id() != -1


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) and x.numel() > 0


def tensor_leaves(obj: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Floating-point tensors in a module's arguments or output: (index path, tensor), two levels deep."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)] if _is_float(obj) else []
    out: list[tuple[str, torch.Tensor]] = []
    if depth > 2:
        return out
    if isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            out.extend(tensor_leaves(item, f"{prefix}.{i}" if prefix else str(i), depth + 1))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            out.extend(tensor_leaves(item, f"{prefix}.{key}" if prefix else str(key), depth + 1))
    return out


def _identity(t: torch.Tensor) -> tuple[int, int, int]:
    """Same object, same version, same storage: the values cannot have changed in between."""
    local = local_view(t)
    return id(t), local._version, local.data_ptr()


def _select(leaves: list[tuple[str, torch.Tensor]], index: int | None) -> list[tuple[str, torch.Tensor]]:
    if index is None:
        return []
    if index < 0:
        return leaves
    return [leaves[index]] if index < len(leaves) else []


def _named(base: str, direction: str, leaves: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    if len(leaves) == 1:
        return [(f"{base}.{direction}", leaves[0][1])]
    return [(f"{base}.{direction}.{suffix}", t) for suffix, t in leaves]


class ActivationHooks:
    """Installs and removes the activation hooks of a list of model chunks."""

    def __init__(self, collector: StepCollector, *, forward: bool, backward: bool,
                 is_active: Callable[[], bool], step_token: Callable[[], int]):
        self.collector = collector
        self.forward = forward
        self.backward = backward
        self._is_active = is_active
        self._step_token = step_token
        self._handles: list[Any] = []
        self._micro: list[int] = []
        self._calls: dict[str, int] = {}
        self._fwd_rows: dict[tuple[int, int, int], tuple[weakref.ref, tuple[torch.device, int]]] = {}
        self._bwd_names: dict[tuple[int, int, int], tuple[weakref.ref, list[tuple[str, str]]]] = {}
        self._failed = False
        self.module_names: list[str] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self, chunks: Sequence[nn.Module], select: Callable[[str], IOSpec | None]) -> list[str]:
        """Hook every module for which ``select(qualified name)`` gives a spec; returns the hooked names."""
        self.remove()
        self._micro = [-1] * len(chunks)
        multi = len(chunks) > 1
        compiled = is_compiled(chunks)  # hooks inside compiled code run eagerly (no recompiles for the tool)
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(partial(self._on_chunk_start, c)))
            for name, module in unwrapped_modules(chunk):
                qualified = (f"{c}:" if multi else "") + (name or ROOT_NAME)
                spec = select(qualified)
                if spec is None:
                    continue
                hook = partial(self._on_forward, qualified, spec, c)
                if compiled:
                    hook = opaque_to_compiler(hook)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
                self.module_names.append(qualified)
        return list(self.module_names)

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.module_names.clear()
        self.new_step()

    def new_step(self) -> None:
        """Forget micro-batch counters and per-step tensor identities."""
        self._micro = [-1] * len(self._micro)
        self._calls.clear()
        self._fwd_rows.clear()
        self._bwd_names.clear()

    # ------------------------------------------------------------------------------------------ hooks
    def _on_chunk_start(self, chunk: int, module: nn.Module, args: Any) -> None:
        if module.training and not in_backward() and self._is_active():
            self._micro[chunk] += 1
            if chunk == 0:
                self._calls.clear()
                self._fwd_rows.clear()
                self._bwd_names.clear()

    def _on_forward(self, name: str, spec: IOSpec, chunk: int, module: nn.Module, args: Any,
                    kwargs: Any, output: Any) -> None:
        if not module.training or not self._is_active() or in_backward():
            return
        try:
            with tool_work():  # the monitor's own tensor work never shows up in an L1 dump
                self._capture(name, spec, max(self._micro[chunk], 0), args, kwargs, output)
        except Exception:  # never break the training step
            if not self._failed:
                self._failed = True
                logger.exception("monitor: activation hook of '%s' failed; activation statistics may be incomplete", name)

    def _capture(self, name: str, spec: IOSpec, micro: int, args: Any, kwargs: Any, output: Any) -> None:
        count = self._calls.get(name, 0)
        self._calls[name] = count + 1
        base = name if count == 0 else f"{name}.call{count}"
        ins = tensor_leaves(args) + tensor_leaves(kwargs, "")
        outs = tensor_leaves(output)
        if self.forward:
            selected = _named(base, "input", _select(ins, spec.input)) + _named(base, "output", _select(outs, spec.output))
            if selected:
                self._record_forward(name, selected, micro)
        if self.backward:
            selected = (_named(base, "input", _select(ins, spec.input_grad))
                        + _named(base, "output", _select(outs, spec.output_grad)))
            for full, t in selected:
                if t.requires_grad:
                    self._register_grad(full, name, t, micro)

    def _record_forward(self, module: str, selected: list[tuple[str, torch.Tensor]], micro: int) -> None:
        todo: list[torch.Tensor] = []
        keys: list[tuple[int, int, int]] = []
        places: list[tuple[torch.device, int] | None] = []
        for _, t in selected:
            key = _identity(t)
            hit = self._fwd_rows.get(key)
            if hit is not None and hit[0]() is t:
                places.append(hit[1])
            else:
                places.append(None)
                if key not in keys:
                    todo.append(t)
                    keys.append(key)
        if todo:
            computed = self.collector.compute(todo)
            for t, key, where in zip(todo, keys, computed):
                self._fwd_rows[key] = (weakref.ref(t), where)
        for (full, t), where in zip(selected, places):
            if where is None:
                where = self._fwd_rows[_identity(t)][1]
            self.collector.add_entry(ACTV, full, module, micro, t.numel(), where, external=not t.requires_grad)

    def _register_grad(self, full: str, module: str, t: torch.Tensor, micro: int) -> None:
        key = _identity(t)
        hit = self._bwd_names.get(key)
        if hit is not None and hit[0]() is t:
            hit[1].append((full, module))
            return
        names = [(full, module)]
        self._bwd_names[key] = (weakref.ref(t), names)
        t.register_hook(self._grad_hook(names, micro, self._step_token()))

    def _grad_hook(self, names: list[tuple[str, str]], micro: int, token: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if token != self._step_token() or not self._is_active() or not _is_float(grad):
                return None
            try:
                with tool_work():
                    where = self.collector.compute([grad])[0]
                for full, module in names:
                    self.collector.add_entry(ACTV_GRAD, full, module, micro, grad.numel(), where)
            except Exception:  # never break the backward pass
                if not self._failed:
                    self._failed = True
                    logger.exception("monitor: gradient hook of '%s' failed", names[0][0])
            return None

        return hook
