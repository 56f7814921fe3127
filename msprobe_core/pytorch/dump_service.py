"""The PyTorch dump service: hooks, naming and step life cycle behind ``PrecisionDebugger``.

The record life cycle (start/stop/step, folders, journal, JSON files, overflow_check, the dumping thread,
module pre/post, ``save``, ``module_dump``) is the core's (``msprobe_core.dump.service``); this module
holds what touches torch. Decide once, run fast: the API patch plan and the module hook plan are built
when dumping starts; a call that is not recorded costs one flag test. Gradients are captured with tensor
hooks and autograd node hooks that return None (never ``register_full_backward_hook``, which inserts
identity nodes and can change the order in which autograd sums gradients), so losses and gradients are
bit-identical with the tool on or off.

Backward records: ``input`` holds the gradients of the call's outputs (tensor hooks); ``output`` the
gradients the call itself sends to its tensor inputs, read on the edges of its own graph nodes
(``backward_capture``): for an input that other calls also use, this call's share only.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from functools import partial
from typing import Any, Callable, Optional

import torch

from msprobe_core.dump.config import DumpConfig
from msprobe_core.dump.call_records import SKIPPED
from msprobe_core.dump.service import Call, DumpServiceBase, saves_files
from msprobe_core.files.call_stack import StackCapture
from msprobe_core.files.step_recorder import TextFields
from msprobe_core.pytorch.api_fast import fast_wrapper_maker
from msprobe_core.pytorch.api_patch import ApiPatcher
from msprobe_core.pytorch.backward_capture import InputEdges, capture, usual_capture
from msprobe_core.pytorch.step_hooks import HookPlan, StepHooks
from msprobe_core.pytorch.compiled_records import CompiledModuleRecords
from msprobe_core.pytorch.compiled_taps import compiled_as_a_whole
from msprobe_core.pytorch.inplace_comm import written_tensors
from msprobe_core.pytorch.native_shards import FlatSlot, fsdp1_slots, is_dtensor, local_view
from msprobe_core.pytorch.pt_writer import TensorFiles
from msprobe_core.pytorch.ranks import current_rank
from msprobe_core.pytorch.sharded_grads import Combined, ShardedGrads, every_rank_dumps
from msprobe_core.pytorch.summarize import Summarizer, tensors_in
from msprobe_core.pytorch.tensor_stats import has_inf_or_nan
from msprobe_core.pytorch.wrapper_names import is_compiled, opaque_to_compiler, unwrapped_class_name, unwrapped_modules
from msprobe_core.stats.kernel import KERNEL

_graph_task_id = torch._C._current_graph_task_id
_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_no_torch_function = torch._C.DisableTorchFunction  # the tool's own tensor work skips every TorchFunctionMode
_thread_id = threading.get_ident
_torch_function_mode_on = torch._C._is_torch_function_mode_enabled
_sequence_nr = torch._C._autograd._get_sequence_nr
_is_compiling = torch.compiler.is_compiling  # constant True while Dynamo traces, a flag read otherwise
_Uninitialized = torch.nn.parameter.UninitializedTensorMixin
# L0 module and gradient hooks in C (None: the kernel is not built or is off)
_ModuleHooks = getattr(KERNEL, "ModuleHooks", None)
_ParamGrad = getattr(KERNEL, "ParamGrad", None)
_CallGrads = getattr(KERNEL, "CallGrads", None)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Quiet:
    """``torch.no_grad()`` and ``DisableTorchFunction`` for the tool's own work at a fraction of
    ``no_grad``'s cost (two C calls, and none when autograd is already off, as in backward hooks)."""

    __slots__ = ("prev", "modes")

    def __enter__(self) -> bool:
        """Returns whether autograd was on."""
        self.modes = _no_torch_function()
        self.modes.__enter__()
        self.prev = _is_grad_enabled()
        if self.prev:
            _set_grad_enabled(False)
        return self.prev

    def __exit__(self, *exc) -> None:
        if self.prev:
            _set_grad_enabled(True)
        self.modes.__exit__(*exc)


_STACKS = StackCapture((_OWN_DIR,), ("torch/nn/modules/module.py", "torch/utils/hooks.py"))


# APIs whose output holds exactly the input's values (same multiset): statistics are shared, not recomputed
_SAME_VALUES = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "contiguous",
                          "flatten", "squeeze", "unsqueeze", "movedim", "swapaxes", "swapdims", "clone", "detach",
                          "unflatten", "adjoint"})


class DumpService(DumpServiceBase):
    """One process's PyTorch dump: configuration, current step, hooks and recorders."""

    framework = "pytorch"
    model_kind = "a torch.nn.Module"
    same_values = _SAME_VALUES
    stacks = _STACKS  # the records' stack capture (``_capture_stack``; ``api_fast`` calls it directly)

    def __init__(self, cfg: DumpConfig, wrap_list: Optional[str] = None):
        files = TensorFiles() if saves_files(cfg) else None
        super().__init__(cfg, Summarizer(statistics=cfg.task != "structure", md5=cfg.summary_mode == "md5",
                                         files=files), files)
        # the record when torch.compile traces an API call: made once Dynamo is loaded (importing it costs a second)
        self._api_opaque: Optional[Callable] = None
        self._prepare_for_compiler()
        self.set_patcher(ApiPatcher(self._api_entry, self.should_record, wrap_list, silence=self._silenced,
                                    fast=fast_wrapper_maker(self)) if self._uses_l1 else None)
        # the C hooks' test for a TorchFunctionMode in the way of their usual call: this dump's own operator mode (mix)
        # is not (``ApiPatcher.foreign_mode_on``)
        self._foreign_mode_on = self.patcher.foreign_mode_on if self.patcher is not None else _torch_function_mode_on
        self._compiled = False
        self._in_graph: Optional[CompiledModuleRecords] = None  # the model being hooked: records in its graph
        self._compiled_records: Optional[CompiledModuleRecords] = None
        self._fsdp1: dict[int, list[tuple[str, FlatSlot]]] = {}  # id(module) -> its original parameters in FSDP1 units
        self._own_grad_hook = self._on_own_grad  # bound once: a call's hook holds a context tuple, no new partial
        self._own_grad_error = self._on_own_grad_error
        self._output_grad_hook = self._on_output_grad
        self._both_grads_hook = self._on_both_grads
        grad_text = self.summarizer.grad_text
        if _CallGrads is not None and grad_text is not None and self.records.grads_by_c:
            self._both_grads_hook = _CallGrads(records=self.records, service=self, grad_text=grad_text,
                                               grad_enabled=_is_grad_enabled, mode_enabled=self._foreign_mode_on,
                                               tls=self._tls)
        self._call_hooks: dict = {}  # the hooks of calls with one edge to one input, reused step after step
        self._own_grads_c: Optional[Callable] = None  # ``_hook_own_grads`` in C (``_usual_capture``)
        self._step_hooks = StepHooks()  # torch hook handles of the step, removed with the step's other handles
        self._module_hooks = StepHooks()  # module hook handles, removed at stop() with the other forward handles
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> its HookPlan (``_rehook``)
        self._planning: Optional[HookPlan] = None  # the plan of the model being hooked
        self.sharded_grads = ShardedGrads(self._deliver_sharded_grad, every_rank_dumps(cfg.rank))

    def limit_to(self, module: torch.nn.Module) -> None:
        """Until ``stop()``, record only while ``module`` runs forward: the module, its submodules and the
        APIs it calls (their backward records follow their forward ones). Call it after ``start()``."""
        depth = [0]

        def enter(*_: Any) -> None:
            depth[0] += 1
            self._inside = True
            self._update_recording()

        def leave(*_: Any) -> None:
            depth[0] -= 1
            self._inside = depth[0] > 0
            self._update_recording()

        self._inside = False
        self._update_recording()
        self.forward_handles += [module.register_forward_pre_hook(enter, prepend=True),
                                  module.register_forward_hook(leave)]

    # ================================================================== framework hooks
    def should_record(self) -> bool:
        """Hot path of every wrapped API: record this call? Not inside a backward pass, and only the
        dumping thread's calls (``_other_thread``)."""
        if not (self._recording and self._tls.depth == 0 and _graph_task_id() == -1):
            return False
        return _thread_id() == self.dumping_thread or self._other_thread()

    def _may_record_exclusive(self) -> bool:
        return self._collecting and self._tls.depth == 0 and _graph_task_id() == -1

    def _current_rank(self) -> Optional[int]:
        return current_rank()

    def _is_model(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def _api_entry(self, original: Callable, prefix: str, api: str, args: tuple, kwargs: dict) -> Any:
        # Traced by torch.compile (a compiled model, or a compiled function called from eager code): the
        # record runs eagerly at a graph break, so Dynamo never traces the tool's code or state and the
        # compiled code computes what it computes without the tool. Eagerly: one flag read per recorded call.
        if _is_compiling():
            opaque = self._api_opaque
            if opaque is None:  # Dynamo was loaded after start(): the op alone, unrecorded, never a changed number
                return original(*args, **kwargs)
            return opaque(original, prefix, api, args, kwargs)
        return self._on_api_call(original, prefix, api, args, kwargs)

    def _named_modules(self, root: torch.nn.Module):
        self._compiled = is_compiled([root])  # decided per model, before its hooks are installed
        self._in_graph = self._records_in_graph() if self._compiled and compiled_as_a_whole([root]) else None
        if self._in_graph is not None:  # torch.compile(model) at L0: records from inside its graph
            self._in_graph.watch(root)
        named = list(unwrapped_modules(root))  # named as in the model without FSDP1 / checkpoint / compile wrappers
        paths = dict(named)
        slots: dict[int, list[tuple[str, FlatSlot]]] = {}
        for name, slot in fsdp1_slots(root):  # FSDP1: autograd sees the flat parameters, not the original ones
            owner, _, pname = name.rpartition(".")
            if owner in paths:
                slots.setdefault(id(paths[owner]), []).append((pname, slot))
        self._fsdp1.update(slots)  # (re)built at every start()
        return named

    def _grad_parameters(self, module: torch.nn.Module) -> list[tuple[str, Any]]:
        slots = self._fsdp1.get(id(module))
        if not slots:
            return self._own_parameters(module)
        sliced = {pname for pname, _ in slots}
        return [(k, v) for k, v in self._own_parameters(module) if k not in sliced] + list(slots)

    def _class_name(self, module: torch.nn.Module) -> str:
        return unwrapped_class_name(module)  # FSDP2's FSDPLinear is a Linear

    def _records_in_graph(self) -> Optional[CompiledModuleRecords]:
        """The in-graph module records (made once), where they can stand for the eager hooks: level L0, task
        statistics, no checksum and no tensor file."""
        cfg = self.cfg
        if cfg.level != "L0" or cfg.task != "statistics" or cfg.summary_mode == "md5" or self.files is not None:
            return None
        if self._compiled_records is None:
            self._compiled_records = CompiledModuleRecords(self.records, self.summarizer, self.forward_handles)
        return self._compiled_records

    def _in_graph_hooks(self, module: torch.nn.Module, base: str) -> Optional[tuple[Callable, Callable]]:
        return self._in_graph.hooks(module, base) if self._in_graph is not None else None

    def _opaque(self, hook: Callable) -> Callable:
        # hooks inside compiled code run eagerly: no recompiles for the tool's state
        return opaque_to_compiler(hook) if self._compiled else hook

    def _prepare_for_compiler(self) -> None:
        """Make the eager record for traced API calls once ``torch._dynamo`` is loaded (``torch.compile`` loads
        it when it wraps a model or a function, before anything is traced)."""
        if self._api_opaque is None and "torch._dynamo" in sys.modules:
            self._api_opaque = opaque_to_compiler(self._on_api_call)

    def _before_hooking(self, modules: list) -> None:
        self._prepare_for_compiler()
        for module in modules:  # FSDP2 units: sharded gradients are recorded after FSDP's end of backward
            state = getattr(module, "_get_fsdp_state", None)
            if state is not None and hasattr(state(), "_root_post_backward_final_callback"):
                self.sharded_grads.after_fsdp_backward(state())

    def _rehook(self, root: torch.nn.Module, prefix: str) -> bool:
        plan = self._plans.get(root)
        self._planning = HookPlan(prefix)
        if plan is None or plan.prefix != prefix or not plan.still_valid(root):
            return False
        self._planning = None
        self._compiled = False  # what _named_modules decides for a model (a plan is made only for eager ones)
        self._in_graph = None
        self._prepare_for_compiler()
        hooks = self._module_hooks
        if not hooks:
            self.forward_handles.append(hooks)
        plan.install(hooks)
        grads = self._step_hooks
        if plan.params and not grads:
            self._step_handles.append(grads)  # its remove() runs with the step's other handles
        # a plain parameter's hook as ``_hook_param_grad`` puts it in, the others through it
        grads.tensor_hooks(plan.params, self._hook_param_grad)
        return True

    def _hooked(self, root: torch.nn.Module, modules: list) -> None:
        plan, self._planning = self._planning, None
        if plan is None or not plan.usable or self._compiled or self._in_graph is not None \
                or any(id(m) in self._fsdp1 or hasattr(m, "_get_fsdp_state") for m in modules):
            self._plans.pop(root, None)
            return
        plan.seal(root, modules)
        self._plans[root] = plan

    def _grads_by_node(self, module: torch.nn.Module) -> bool:
        # an eager model's plain modules (compiled models, FSDP1/FSDP2 units: tensor hooks, as before)
        return not self._compiled and self._in_graph is None and id(module) not in self._fsdp1 \
            and not hasattr(module, "_get_fsdp_state")

    def _grad_by_node(self, call: Call, t: torch.Tensor) -> bool:
        edges = call.edges
        if edges is None or type(t) is not torch.Tensor or not t.requires_grad:
            return False
        edges.output = t  # ``capture`` hooks the node that makes it, or the tensor itself
        return True

    def _module_hooks(self, base: str, pre: Callable, post: Callable) -> Optional[tuple[Callable, Callable]]:
        text = self.summarizer.record_text
        if _ModuleHooks is None or text is None:
            return None
        hooks = _ModuleHooks(
            records=self.records, service=self, text=text, base=base, pre=pre, post=post, call=Call, skipped=SKIPPED,
            tensor=torch.Tensor, parameter=torch.nn.Parameter, graph_task_id=_graph_task_id,
            grad_enabled=_is_grad_enabled, mode_enabled=self._foreign_mode_on, tls=self._tls,
            # the stack from the hook's caller on (no Python frame of the tool's between)
            capture_stack=partial(_STACKS.capture, 1) if self.cfg.extra_info else None, interned=_STACKS.interned,
            backward=bool(self.selection.backward),
            hook_own_grads=self._usual_capture(), input_edges=InputEdges, sequence_nr=_sequence_nr,
            # the usual call's reads with the operator mode off, as the Python route's (the mix level)
            no_torch_function=_no_torch_function() if self.patcher is not None else None)
        return hooks.pre, hooks.post

    def _usual_capture(self) -> Callable[[Call, Any], None]:
        """``_hook_own_grads``, in C for the usual call (``backward_capture.usual_capture``), made once."""
        if self._own_grads_c is None:
            self._own_grads_c = usual_capture(self._hook_own_grads, self._own_grad_hook, self._own_grad_error,
                                              self._output_grad_hook, self._both_grads_hook, self._keep_hook,
                                              self._call_hooks, self._step_hooks) or self._hook_own_grads
        return self._own_grads_c

    def _param_grad_hook(self, base: str, pname: str, count: int, hook: Callable, fields: Callable) -> Callable:
        grad_text = self.summarizer.grad_text
        if _ParamGrad is None or grad_text is None:
            return hook
        return _ParamGrad(records=self.records, service=self, grad_text=grad_text, grad_enabled=_is_grad_enabled,
                          mode_enabled=self._foreign_mode_on, tls=self._tls, base=base, pname=pname, count=count,
                          fallback=hook, fields=fields, text_fields=TextFields)

    def _own_parameters(self, module: torch.nn.Module) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in module._parameters.items() if v is not None]  # without named_parameters' generator

    def _hook_param_grad(self, param: torch.Tensor, hook: Callable) -> None:
        plan = self._planning
        if plan is not None:
            if isinstance(param, FlatSlot) or is_dtensor(param):
                plan.usable = False
            plan.params.append((param, hook))
        # a lazy module's parameter is not a tensor yet (hooked from the next start() on)
        if isinstance(param, FlatSlot):  # the full gradient's statistics at the end of backward
            self._step_handles.append(self.sharded_grads.add(param, hook))
            self._step_handles.append(param.flat.register_hook(self.sharded_grads.arm))
        elif param.requires_grad and not isinstance(param, _Uninitialized):
            if is_dtensor(param):  # sharded: the full gradient's statistics at the end of backward
                self._step_handles.append(self.sharded_grads.add(param, hook))
                hook = self.sharded_grads.arm
            self._keep_tensor_hook(param, hook)

    def _deliver_sharded_grad(self, hook: Callable, grad: torch.Tensor, combined: Optional[Combined]) -> None:
        if combined is not None:
            self.summarizer.combined[id(grad)] = combined
        try:
            hook(grad)
        finally:
            self.summarizer.combined.pop(id(grad), None)

    def _hook_tensor_grad(self, t: torch.Tensor, hook: Callable) -> None:
        # removed when the step ends (a leaf's hook outlives the graph; a backward run after step()
        # belongs to no recorded step)
        self._keep_tensor_hook(t, hook)

    def _hook_saved_tensor(self, t: torch.Tensor, hook: Callable) -> None:
        if isinstance(t, _Uninitialized):
            return
        handle = t.register_hook(hook)
        if t.is_leaf:
            self._keep_hook(handle)

    def _keep_forward_handles(self, handles: list) -> None:
        hooks = self._module_hooks
        if not hooks:
            self.forward_handles.append(hooks)  # its remove() runs with the other forward handles at stop()
        plan = self._planning
        for h in handles:
            hooks.keep(h)
            if plan is not None:
                plan.add_forward(h)

    def _keep_hook(self, handle: Any) -> None:
        """Hold a torch hook handle for its removal when the step ends (``StepHooks``: no handle object kept)."""
        hooks = self._step_hooks
        if not hooks:
            self._step_handles.append(hooks)  # its remove() runs with the step's other handles
        hooks.keep(handle)

    def _keep_keys(self, flat: list) -> None:
        """Hold hooks put in their dicts without a handle (``StepHooks.keep_keys``' ``flat``) for their removal when
        the step ends."""
        hooks = self._step_hooks
        if not hooks:
            self._step_handles.append(hooks)
        hooks.keep_keys(flat)

    def _keep_tensor_hook(self, t: torch.Tensor, hook: Callable) -> None:
        """``t.register_hook(hook)`` until the step ends, made without a handle object (``StepHooks``)."""
        hooks = self._step_hooks
        if not hooks:
            self._step_handles.append(hooks)
        hooks.tensor_hook(t, hook)

    def _wants_grad(self, t: torch.Tensor) -> bool:
        return t.requires_grad

    _tensors_in = staticmethod(tensors_in)

    def _on_device(self, tensors: list) -> bool:
        return bool(tensors) and not tensors[0].is_cpu

    def _overflow_flag(self, t: torch.Tensor) -> torch.Tensor:
        return has_inf_or_nan(local_view(t))

    def _any_overflow(self, flags: list) -> bool:
        return bool(torch.stack([f.to("cpu") for f in flags]).any())

    def _quiet(self) -> _Quiet:
        return _Quiet()

    def _capture_stack(self) -> Any:
        return _STACKS.capture(3)

    def _grad_recording(self) -> bool:
        return torch.is_grad_enabled()

    # ================================================================== L1 APIs
    def _silenced(self, original: Callable) -> Callable:
        tls = self._tls

        def silent(*args, **kwargs):
            tls.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                tls.depth -= 1

        silent.__wrapped__ = original  # type: ignore[attr-defined]
        return silent

    def _collective_result(self, name: str, api: str, original: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        """What a ``Distributed`` call's record shows as output: the tensors an in-place collective wrote,
        as they are after the call (see ``inplace_comm``), whose cached statistics are dropped; else ``out``."""
        try:
            target, is_async = written_tensors(api, original, args, kwargs)
            if target is None:
                return out
            with _no_torch_function():
                for t in tensors_in(target):
                    self.summarizer.forget(t)
        except Exception as e:  # the tool must never break the user's call
            self._error(name, e)
            return out
        return out if is_async else target

    # ================================================================== backward output records
    def _prepare_backward(self, call: Call, inputs: list) -> None:
        call.edges = InputEdges.of(inputs)  # its inputs' gradient edges, until its end hooks its own nodes

    def _end(self, call: Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call`` with its output; ``same_values_as`` is an input the output only rearranges (a view,
        reshape, ...): its statistics are reused."""
        with _Quiet() as grad_enabled:
            if same_values_as is not None and type(out) is torch.Tensor and isinstance(same_values_as, torch.Tensor) \
                    and out.dtype == same_values_as.dtype and out.numel() == same_values_as.numel():
                self.summarizer.share(same_values_as, out)
            self._end_record(call, out, grad_enabled)
            if call.edges is not None:
                self._hook_own_grads(call, out)

    def _hook_own_grads(self, call: Call, out: Any) -> None:
        """The backward record's ``output``: each input's gradient from this call only (backward_capture)."""
        edges, call.edges = call.edges, None
        capture(edges, tensors_in(out), self._own_grad_hook, self._own_grad_error,
                (call.backward, call.save, call.backward_parent()), self._keep_hook,
                self._output_grad_hook, self._hook_output_grad, self._call_hooks, self._both_grads_hook)

    def _on_own_grad(self, context: tuple, index: int, grad) -> None:
        backward, save, parent = context
        self._on_grad(backward, "output", index, save, parent, grad)

    def _on_output_grad(self, context: tuple, index: int, grad) -> None:
        backward, save, parent = context
        self._on_grad(backward, "input", index, save, parent, grad)

    def _on_both_grads(self, context: tuple, index: int, received: torch.Tensor, sent: torch.Tensor) -> bool:
        backward, save, parent = context
        return self.records.on_call_grads(backward, save, parent, index, received, sent)

    def _hook_output_grad(self, context: tuple, t: torch.Tensor) -> None:
        """The gradient of a call's one output by a tensor hook (its node does not deliver it)."""
        backward, save, parent = context
        self._hook_tensor_grad(t, partial(self._on_grad, backward, "input", 0, save, parent))

    def _on_own_grad_error(self, context: tuple, exc: BaseException) -> None:
        self._error(context[0], exc)
