"""What a framework's dump service supplies to the shared one (``dump.service.DumpServiceBase``): the
class attributes that name its models and records, and the hooks that touch its tensors, models and
autograd. ``msprobe_core.pytorch.dump_service`` and ``msprobe_core.mindspore.dump_service`` define them."""

from __future__ import annotations

from typing import Any, Callable, Optional

from msprobe_core.dump.call_records import Call


class FrameworkHooks:
    """The framework side of a dump service, with the defaults of the optional hooks.

    A subclass defines ``framework`` (dump.json's ``framework``), ``model_kind`` and ``module_word`` (for
    messages), ``patcher`` (L1 API wrapping, or None), ``files`` (tensor files, or None), ``summarizer``;
    ``_current_rank``, ``_is_model``, ``_named_modules``, ``_own_parameters``, ``_hook_param_grad``,
    ``_hook_tensor_grad``, ``_wants_grad``, ``_tensors_in``, ``_overflow_flag``, ``_any_overflow``,
    ``_quiet``, ``_capture_stack``; optionally ``_prepare_backward``, ``_call_inputs``,
    ``_collective_result``, ``_before_hooking``, ``_unpatch``, ``_grad_recording``, ``_on_device``,
    ``_hook_saved_tensor``, ``_may_record_exclusive``, ``_class_name``, ``_opaque``, ``_grad_parameters`` (and ``should_record``, the hot path)."""

    framework = ""
    model_kind = "a model"
    module_word = "modules"
    module_prefix = "Module"  # L0 record names: ``{module_prefix}.{path}.{Class}.forward.{n}``
    hooks_l1_models = False  # does level L1 look into start()'s models (``_before_hooking``)?
    same_values: frozenset = frozenset()  # APIs whose output only rearranges their first input

    def _current_rank(self) -> Optional[int]:
        """The framework's rank of this process (None when not distributed)."""
        return None

    def _is_model(self, obj: Any) -> bool:
        raise NotImplementedError

    def _named_modules(self, root: Any):
        """(path, module) of ``root`` and everything inside it, root first (path '')."""
        raise NotImplementedError

    def _own_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """The parameters a module holds itself (not its children's), by attribute name."""
        raise NotImplementedError

    def _hook_param_grad(self, param: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the parameter's gradients until the step ends (or not at all, where the
        parameter gets none)."""
        raise NotImplementedError

    def _hook_tensor_grad(self, t: Any, hook: Callable) -> None:
        """Call ``hook(grad)`` with the gradient of ``t`` (a forward output or input)."""
        raise NotImplementedError

    def _wants_grad(self, t: Any) -> bool:
        """Does ``t`` get a gradient worth a hook?"""
        raise NotImplementedError

    def _tensors_in(self, obj: Any) -> list:
        raise NotImplementedError

    def _overflow_flag(self, t: Any) -> Any:
        """Does ``t`` hold an Inf or a NaN? (may be a device value: ``_any_overflow`` reads it)"""
        raise NotImplementedError

    def _any_overflow(self, flags: list) -> bool:
        raise NotImplementedError

    def _quiet(self) -> Any:
        """A context for the tool's own tensor work; entering it returns whether autograd records."""
        raise NotImplementedError

    def _capture_stack(self) -> Any:
        """The user's call stack of the call being recorded (stack.json)."""
        raise NotImplementedError

    def _grad_recording(self) -> bool:
        """Does autograd record the tensors made now (``save``'s gradients)?"""
        return False

    def _prepare_backward(self, call: Call, inputs: list) -> None:
        """At a call's start (autograd on): get ready to record the gradient it sends to its inputs."""

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

    def _before_hooking(self, modules: list) -> None:
        """Called with the modules of each model given to start(), before any is hooked."""

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
