"""What a user asks the dump for by name, beyond start/stop/step: ``save()`` (msprobe's single-point
save into debug.json, with the gradients of the saved tensors), ``module_dump`` (one module alone) and
custom APIs (``register_custom_api``). ``UserApi`` is a part of a dump service (``DumpServiceBase.user_api``)."""

from __future__ import annotations

import threading
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

from msprobe_core.common.patch import patch
from msprobe_core.common.tool_guard import TOOL
from msprobe_core.dump.api_wrap import make_wrapper
from msprobe_core.errors import ConfigError

if TYPE_CHECKING:
    from msprobe_core.dump.backend import DumpBackend
    from msprobe_core.dump.call_records import CallRecords
    from msprobe_core.dump.host import DumpHost

_thread_id = threading.get_ident


class UserApi:
    """``save``, ``module_dump`` / ``module_dump_end`` and ``register_custom_api`` / ``restore_custom_api``
    of a dump service. It owns the ``module_dump`` window's hooks and the custom APIs' patches; it is given
    the service (``dump.host.DumpHost``: the step's recorders, the recording gates), the framework back-end
    (``dump.backend.DumpBackend``: models, tensors, gradients) and the service's ``records`` (a module's
    hooks, the count of ``save`` names, the record of a custom API's call)."""

    def __init__(self, service: DumpHost, backend: DumpBackend, records: CallRecords) -> None:
        self.service = service
        self.backend = backend
        self.records = records
        self._module_dump_handles: list[Any] = []
        self._custom: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(module), api) -> (module, its patch)

    # ================================================================== module_dump / save
    def module_dump(self, module: Any, name: str) -> None:
        """Until ``module_dump_end()``, dump only ``module`` itself (named ``{module_prefix}.{name}.{Class}``)."""
        svc, backend = self.service, self.backend
        if not backend._is_model(module):
            raise ConfigError("module", type(module).__name__, backend.model_kind)
        if not isinstance(name, str) or not name:
            raise ConfigError("module_name", name, "a non-empty string")
        if not svc.collecting:
            return
        svc._open_step()
        self._module_dump_handles = self.records.hook_module(
            module, f"{backend.module_prefix}.{name}.{type(module).__name__}", exclusive=True)
        svc.set_exclusive(module)

    def module_dump_end(self) -> None:
        """Back to the normal dump after ``module_dump``."""
        for h in self._module_dump_handles:
            h.remove()
        self._module_dump_handles = []
        self.service.set_exclusive(None)

    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """Save ``variable`` into the step's debug.json as ``{name}.{count}.debug`` (and the gradients of its
        tensors as ``{name}_grad.{count}.debug``)."""
        if not isinstance(name, str) or not name:
            raise ConfigError("name", name, "a non-empty string")
        svc, backend = self.service, self.backend
        if svc.finished:
            return
        if _thread_id() != svc.dumping_thread:
            svc._other_thread()
            return
        if not svc._in_configured_step():
            return
        rec = svc._open_debug()
        TOOL.depth += 1
        try:
            counters = self.records.step_state.counters
            n = counters.get(f"save#{name}", 0)
            counters[f"save#{name}"] = n + 1
            key = f"{name}.{n}.debug"
            with backend._quiet():
                summary = svc.summarizer.summarize(variable, key, svc.saves_tensors)
            rec.put(key, summary, rec.reserve(key))
            if save_backward and backend._grad_recording():
                self._hook_saved_grads(variable, f"{name}_grad.{n}.debug", [])
            svc._sync()
        except Exception as e:  # like every recorded call: the tool never breaks the user's program
            svc._error(f"save({name!r})", e)
        finally:
            TOOL.depth -= 1

    def _hook_saved_grads(self, obj: Any, key: str, path: list) -> None:
        backend = self.backend
        if isinstance(obj, self.service.summarizer.tensor_types):
            if backend._wants_grad(obj):
                backend._hook_saved_tensor(obj, partial(self._on_saved_grad, key, list(path)))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._hook_saved_grads(v, key, path + [i])
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._hook_saved_grads(v, key, path + [str(k)])

    def _on_saved_grad(self, key: str, path: list, grad: Any) -> None:
        svc = self.service
        rec = svc.debug_recorder
        if rec is None or grad is None:
            return None
        with svc._own(key), self.backend._quiet():
            summary = svc.summarizer.summarize(grad, ".".join([key, *map(str, path)]), svc.saves_tensors)
            if not path:
                rec.put(key, summary, rec.reserve(key))
            else:
                rec.put_field(key, path, summary, dict)
            svc._sync()
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
        records = self.records
        handle = patch(module, api, lambda original: make_wrapper(original, prefix, api, records.on_api_call,
                                                                  records.should_record))
        self._custom[(id(module), api)] = (module, handle)

    def restore_custom_api(self, module: Any, api: str) -> None:
        """Undo ``register_custom_api``."""
        entry = self._custom.pop((id(module), api), None)
        if entry is not None:
            entry[1].remove()

    def restore_all(self) -> None:
        """Undo every ``register_custom_api`` (the service's ``close()``)."""
        for key in list(self._custom):
            self._custom.pop(key)[1].remove()
