"""The framework back-end of the dump: ``DumpBackend``, the one interface a framework's dump service fills in.

``dump.service.DumpServiceBase`` and its parts (``dump.call_records.CallRecords``, ``dump.user_api.UserApi``)
do everything that does not touch a framework (steps, folders, records, selection, files); what touches
tensors, models and autograd they ask of the back-end through the methods below, and nothing else. A new
framework subclasses ``DumpServiceBase`` and provides them, as ``msprobe_core.pytorch.dump_service.DumpService``
and ``msprobe_core.mindspore.dump_service.DumpService`` do (``tests/msprobe_core/dump/test_backend_interface.py``
holds both to this list). Its ``__init__`` makes the summarizer and the tensor-file writer, passes them to
``DumpServiceBase.__init__(cfg, summarizer, files)``, then gives its API patcher to ``set_patcher`` (the
patcher calls the records' ``_on_api_call``, which exists once the base is initialized).

Class attributes (or set in ``__init__``):

============================  ==========================================================================
``framework``                 dump.json's ``framework``
``model_kind``                what ``start(model)`` takes, for messages (``"a torch.nn.Module"``)
``module_word``               what the models are made of, for messages (``"modules"``, ``"cells"``)
``module_prefix``             L0 record names: ``{module_prefix}.{path}.{Class}.forward.{n}``
``hooks_l1_models``           does level L1 look into start()'s models (``_before_hooking``)?
``same_values``               APIs whose output only rearranges their first input (statistics shared)
``patcher``                   L1 API wrapping (``prepare``/``patch``/``restore``/``call``), or None
``files``                     the tensor-file writer (``flush``/``close``), or None when no file is written
``summarizer``                statistics and tensor files of one value (``files.summarize``-like)
============================  ==========================================================================

Methods: required ones are abstract (a back-end that misses one cannot be instantiated); the others have
the default given here. The parts bind them once when the service is made (bound methods): no indirection
on the hot path. The shared code's own override points, which a back-end may extend with ``super()``, are
``should_record`` and ``_may_record_exclusive`` (when not to record: PyTorch skips its backward pass),
``_end`` (the end of a call's record) and ``_finish_step`` (per-step state of the back-end). What a
back-end calls of the shared code: ``_on_api_call`` (its patchers' handler), ``_on_grad`` (a gradient of
a backward record), ``_end_record`` (the shared end of a record, from its ``_end``), ``_error``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

from msprobe_core.dump.call import Call


class DumpBackend(ABC):
    """What a framework supplies to the shared dump service: its models, tensors, gradients and stacks."""

    framework = ""
    model_kind = "a model"
    module_word = "modules"
    module_prefix = "Module"  # L0 record names: ``{module_prefix}.{path}.{Class}.forward.{n}``
    hooks_l1_models = False  # does level L1 look into start()'s models (``_before_hooking``)?
    same_values: frozenset = frozenset()  # APIs whose output only rearranges their first input
    patcher: Any
    files: Any
    summarizer: Any

    def _current_rank(self) -> Optional[int]:
        """The framework's rank of this process (None when not distributed)."""
        return None

    @abstractmethod
    def _is_model(self, obj: Any) -> bool:
        """Is ``obj`` a model of this framework (what ``start(model)`` and ``module_dump`` take)?"""
        raise NotImplementedError

    @abstractmethod
    def _named_modules(self, root: Any):
        """(path, module) of ``root`` and everything inside it, root first (path '')."""
        raise NotImplementedError

    @abstractmethod
    def _own_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """The parameters a module holds itself (not its children's), by attribute name."""
        raise NotImplementedError

    def _keep_forward_handles(self, handles: list) -> None:
        """Hold module hook handles for their removal at stop() (a back-end may hold them more compactly)."""
        self.forward_handles.extend(handles)

    @abstractmethod
    def _hook_param_grad(self, param: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the parameter's gradients until the step ends (or not at all, where the
        parameter gets none)."""
        raise NotImplementedError

    @abstractmethod
    def _hook_tensor_grad(self, t: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the gradient of ``t`` (a forward output or input)."""
        raise NotImplementedError

    @abstractmethod
    def _wants_grad(self, t: Any) -> bool:
        """Does ``t`` get a gradient worth a hook?"""
        raise NotImplementedError

    @abstractmethod
    def _tensors_in(self, obj: Any) -> list:
        """The framework's tensors in ``obj`` (nested lists, tuples, dicts), in order."""
        raise NotImplementedError

    @abstractmethod
    def _overflow_flag(self, t: Any) -> Any:
        """Does ``t`` hold an Inf or a NaN? (may be a device value: ``_any_overflow`` reads it)"""
        raise NotImplementedError

    @abstractmethod
    def _any_overflow(self, flags: list) -> bool:
        """Does any of ``_overflow_flag``'s results say Inf/NaN? (one host read for all of them)"""
        raise NotImplementedError

    @abstractmethod
    def _quiet(self) -> Any:
        """A context for the tool's own tensor work; entering it returns whether autograd records."""
        raise NotImplementedError

    @abstractmethod
    def _capture_stack(self) -> Any:
        """The user's call stack of the call being recorded (stack.json)."""
        raise NotImplementedError

    def _grad_recording(self) -> bool:
        """Does autograd record the tensors made now (``save``'s gradients)?"""
        return False

    def _prepare_backward(self, call: Call, inputs: list) -> None:
        """At a call's start (autograd on): get ready to record the gradient it sends to its inputs."""

    def _grads_by_node(self, module: Any) -> bool:
        """May ``module``'s calls have their output's gradient delivered by their own backward node
        (``_grad_by_node``)? Decided when its hooks go in (default: no)."""
        return False

    def _grad_by_node(self, call: Call, t: Any) -> bool:
        """Deliver the gradient of ``t``, the call's one output, from the call's own backward node (the
        gradient the call receives, after every hook on ``t``) instead of a tensor hook on ``t``: True when it
        is so (the call's end then hooks its node, or ``t`` where the graph has another shape)."""
        return False

    def _module_hooks(self, base: str, pre: Callable, post: Callable) -> Optional[tuple[Callable, Callable]]:
        """A module's forward pre and post hooks doing the work of ``pre`` and ``post`` (the records' Python route,
        which they take for any call they do not handle) faster, for the usual call of a plain module whose
        output gradient comes by node, at the level and configuration ``CallRecords`` gives them to (``base``: its
        records' name stem); None: ``pre`` and ``post`` are the hooks (default)."""
        return None

    def _param_grad_hook(self, base: str, pname: str, count: int, hook: Callable, fields: Callable) -> Callable:
        """A parameter's gradient hook doing the work of ``hook`` (the records' Python route, which it takes for
        any gradient it does not handle) faster, for the modules and configurations ``_module_hooks`` serves
        (``base``: the module's records' name stem, ``pname`` the parameter's name, ``count`` how many the
        record holds, ``fields`` its ``TextFields`` maker); default ``hook`` itself."""
        return hook

    def _call_inputs(self, call: Call, args: tuple, kwargs: dict, api: str) -> tuple[tuple, dict]:
        """The arguments the call runs on (a framework may pass views to see each input's gradient)."""
        return args, kwargs

    def _collective_result(self, name: str, api: str, original: Callable, args: tuple, kwargs: dict, out: Any) -> Any:
        """What a ``Distributed`` call's record shows as output (default: its return value)."""
        return out

    def _grad_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """The parameters whose gradients a module's ``parameters_grad`` records hold (default: its own)."""
        return self._own_parameters(module)

    def _class_name(self, module: Any) -> str:
        """The class name in a module's record name (a framework strips its wrappers' generated classes)."""
        return type(module).__name__

    def _opaque(self, hook: Callable) -> Callable:
        """A module hook as installed (a framework may shield it from its graph compiler)."""
        return hook

    def _in_graph_hooks(self, module: Any, base: str) -> Optional[tuple[Callable, Callable]]:
        """(pre, post) module hooks that a graph compiler traces, recording ``module`` as ``base`` from inside
        its graph (PyTorch: a ``torch.compile(model)`` at L0, ``pytorch.compiled_records``); None: the usual
        hooks."""
        return None

    def _before_hooking(self, modules: list) -> None:
        """Called with the modules of each model given to start(), before any is hooked."""

    def _rehook(self, root: Any, prefix: str) -> bool:
        """At start(), before hooking the modules of ``root`` (named with ``prefix``): put back the hooks the
        last start() installed on it, if it is unchanged (True: nothing more to do), else False (the model is
        hooked module by module, then ``_hooked`` is called)."""
        return False

    def _hooked(self, root: Any, modules: list) -> None:
        """``root``'s ``modules`` (root first) are hooked (after ``_rehook`` said False)."""

    def _unpatch(self) -> None:
        """Undo start()'s API wrapping."""
        if self.patcher is not None:
            self.patcher.restore()

    def _on_device(self, tensors: list) -> bool:
        """Are these a device's tensors (their statistics are resolved in batches)?"""
        return False

    def _hook_saved_tensor(self, t: Any, hook: Callable) -> None:
        """``save()``'s gradient hook on one of its tensors (default: as a forward output's)."""
        self._hook_tensor_grad(t, hook)
