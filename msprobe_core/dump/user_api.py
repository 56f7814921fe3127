"""What a user asks the dump for by name, beyond start/stop/step: ``save()`` (msprobe's single-point
save into debug.json, with the gradients of the saved tensors), ``module_dump`` (one module alone) and
custom APIs (``register_custom_api``). ``UserApi`` is mixed into ``dump.service.DumpServiceBase``."""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

from msprobe_core.common.patch import patch
from msprobe_core.dump.api_wrap import make_wrapper
from msprobe_core.errors import ConfigError

if TYPE_CHECKING:
    from msprobe_core.dump.step_state import StepState

_thread_id = threading.get_ident


class UserApi:
    """``save``, ``module_dump`` / ``module_dump_end`` and ``register_custom_api`` / ``restore_custom_api``
    of a dump service: they use the framework's methods (``dump.backend.DumpBackend``), the records'
    (``hook_module``, ``_on_api_call``), the service's (``_open_step``, ``_open_debug``, ``_sync``, ``_own``,
    ``_error``, ``_update_recording``, ``_other_thread``, ``_in_configured_step``, ``should_record``) and the
    service state declared here (set by ``DumpServiceBase.__init__``)."""

    finished: bool                        # the last configured step is dumped
    debug_recorder: Any                   # the open step's debug.json (``files.step_recorder.StepRecorder``)
    _tls: Any
    _thread: int
    _collecting: bool                     # between start() and stop()
    _exclusive: Any                       # the module of the module_dump() window
    _saves: bool
    step_state: StepState
    _module_dump_handles: list[Any]
    _custom: dict[tuple[int, str], tuple[Any, Any]]  # (id(module), api) -> (module, its patch handle)

    # ================================================================== module_dump / save
    def module_dump(self, module: Any, name: str) -> None:
        """Until ``module_dump_end()``, dump only ``module`` itself (named ``{module_prefix}.{name}.{Class}``)."""
        if not self._is_model(module):
            raise ConfigError("module", type(module).__name__, self.model_kind)
        if not isinstance(name, str) or not name:
            raise ConfigError("module_name", name, "a non-empty string")
        if not self._collecting:
            return
        self._open_step()
        self._module_dump_handles = self.hook_module(module, f"{self.module_prefix}.{name}.{type(module).__name__}",
                                                     exclusive=True)
        self._exclusive = module
        self._update_recording()

    def module_dump_end(self) -> None:
        """Back to the normal dump after ``module_dump``."""
        for h in self._module_dump_handles:
            h.remove()
        self._module_dump_handles = []
        self._exclusive = None
        self._update_recording()

    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """Save ``variable`` into the step's debug.json as ``{name}.{count}.debug`` (and the gradients of its
        tensors as ``{name}_grad.{count}.debug``)."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty string")
        if self.finished:
            return
        if _thread_id() != self._thread:
            self._other_thread()
            return
        if not self._in_configured_step():
            return
        rec = self._open_debug()
        tls = self._tls
        tls.depth += 1
        try:
            n = self.step_state.counters.get(f"save#{name}", 0)
            self.step_state.counters[f"save#{name}"] = n + 1
            key = f"{name}.{n}.debug"
            with self._quiet():
                summary = self.summarizer.summarize(variable, key, self._saves)
            rec.put(key, summary, rec.reserve(key))
            if save_backward and self._grad_recording():
                self._hook_saved_grads(variable, f"{name}_grad.{n}.debug", [])
            self._sync()
        except Exception as e:  # like every recorded call: the tool never breaks the user's program
            self._error(f"save({name!r})", e)
        finally:
            tls.depth -= 1

    def _hook_saved_grads(self, obj: Any, key: str, path: list) -> None:
        if isinstance(obj, self.summarizer.tensor_types):
            if self._wants_grad(obj):
                self._hook_saved_tensor(obj, partial(self._on_saved_grad, key, list(path)))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._hook_saved_grads(v, key, path + [i])
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._hook_saved_grads(v, key, path + [str(k)])

    def _on_saved_grad(self, key: str, path: list, grad: Any) -> None:
        rec = self.debug_recorder
        if rec is None or grad is None:
            return None
        with self._own(key), self._quiet():
            summary = self.summarizer.summarize(grad, ".".join([key, *map(str, path)]), self._saves)
            if not path:
                rec.put(key, summary, rec.reserve(key))
            else:
                rec.put_field(key, path, summary, dict)
            self._sync()
        return None

    # ================================================================== custom APIs
    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        """Dump ``module.api`` as ``{api_prefix}.{api}.{n}.forward`` from now on."""
        if not isinstance(api, str) or not hasattr(module, api):
            raise ConfigError("api", api, f"the name of a callable attribute of {getattr(module, '__name__', module)!r}")
        if not callable(getattr(module, api)):
            raise ConfigError("api", api, "a callable attribute")
        if (id(module), api) in self._custom:
            return
        prefix = api_prefix if api_prefix is not None else str(getattr(module, "__name__", type(module).__name__))
        handle = patch(module, api, lambda original: make_wrapper(original, prefix, api, self._on_api_call,
                                                                  self.should_record))
        self._custom[(id(module), api)] = (module, handle)

    def restore_custom_api(self, module: Any, api: str) -> None:
        """Undo ``register_custom_api``."""
        entry = self._custom.pop((id(module), api), None)
        if entry is not None:
            entry[1].remove()
