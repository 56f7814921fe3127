"""``PrecisionDebugger`` and the module-level helpers of msprobe's PyTorch dump API."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

from msprobe_core.dump.config import DumpConfig, load_dump_config
from msprobe_core.errors import DumpStateError


class PrecisionDebugger:
    """msprobe's dump entry point: ``PrecisionDebugger(config_path=None, task=None, dump_path=None,
    level=None, step=None)``.

    Constructor arguments override the config file; with neither, L1 statistics of every rank and step go
    to ``./msprobe_dump``. One debugger per process: constructing it again returns the same instance
    (later arguments are ignored, as msprobe does), so ``PrecisionDebugger.start()`` / ``stop()`` /
    ``step()`` also work as class-level calls from another file (cross-file dump).

    ``config_path`` may also be a dict with the config.json content. ``wrap_list`` (an addition) names a
    support_wrap_ops.yaml to use instead of the shipped one.
    """

    _instance: Optional["PrecisionDebugger"] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "PrecisionDebugger":
        if cls._instance is None:
            instance = super().__new__(cls)
            instance._initialized = False
            cls._instance = instance
        return cls._instance

    def __init__(self, config_path: Union[str, os.PathLike, Mapping[str, Any], None] = None, task: Optional[str] = None,
                 dump_path: Optional[str] = None, level: Optional[str] = None, step: Any = None,
                 wrap_list: Optional[str] = None):
        if self._initialized:
            return
        try:
            cfg = load_dump_config(config_path, task=task, dump_path=dump_path, level=level, step=step)
        except BaseException:
            type(self)._instance = None
            raise
        from msprobe_core.pytorch.dump_service import DumpService

        self.config: DumpConfig = cfg
        self.service = DumpService(cfg, wrap_list)
        self._initialized = True

    # ---------------------------------------------------------------- msprobe API (instance or class level)
    @classmethod
    def _get(cls) -> "PrecisionDebugger":
        if cls._instance is None or not cls._instance._initialized:
            raise DumpStateError("PrecisionDebugger is not created yet: call PrecisionDebugger(config_path=...) first")
        return cls._instance

    @staticmethod
    def _target(obj: Any) -> "PrecisionDebugger":
        return obj if isinstance(obj, PrecisionDebugger) else PrecisionDebugger._get()

    class _Dual:
        """A method callable on the instance or on the class (msprobe's cross-file usage)."""

        def __init__(self, fn):
            self.fn = fn
            self.__doc__ = fn.__doc__

        def __get__(self, obj, owner):
            target = obj
            fn = self.fn

            def bound(*args, **kwargs):
                return fn(PrecisionDebugger._target(target), *args, **kwargs)

            bound.__doc__ = fn.__doc__
            bound.__name__ = fn.__name__
            return bound

    @_Dual
    def start(self, model=None, token_range=None, rank_id: Optional[int] = None) -> None:
        """Start collecting. ``model``: the module (or list/tuple of modules) whose submodules L0/mix dump;
        ``token_range=[start, end]``: dump only the forward passes producing those tokens (0 = prefill);
        ``rank_id``: name the rank folder explicitly (e.g. SGLang DP workers sharing a rank)."""
        self.service.start(model=model, token_range=token_range, rank_id=rank_id)

    @_Dual
    def stop(self) -> None:
        """Stop collecting; records stay in the current step (backward hooks still record until step())."""
        self.service.stop()

    @_Dual
    def step(self) -> None:
        """End the step: write dump.json, stack.json and construct.json, then count the next step."""
        self.service.step()

    @_Dual
    def set_init_step(self, step: int) -> None:
        """Number the first step ``step`` instead of 0 (call before the training loop)."""
        self.service.set_init_step(step)

    @_Dual
    def register_custom_api(self, module: Any, api: str, api_prefix: Optional[str] = None) -> None:
        """Dump ``module.api`` as ``{api_prefix}.{api}.{n}.forward`` (prefix default: the module's name)."""
        self.service.register_custom_api(module, api, api_prefix)

    @_Dual
    def restore_custom_api(self, module: Any, api: str) -> None:
        """Undo ``register_custom_api``: put the original ``module.api`` back."""
        self.service.restore_custom_api(module, api)

    @_Dual
    def save(self, variable: Any, name: str, save_backward: bool = True) -> None:
        """Single-point save into debug.json (see the module-level ``save``)."""
        self.service.save(variable, name, save_backward)

    @_Dual
    def close(self) -> None:
        """Finish the open step and restore every patched attribute and hook now (also done at exit)."""
        self.service.close()

    @classmethod
    def reset(cls) -> None:
        """Close and forget the process's debugger so a new one can be created (tests, notebooks)."""
        if cls._instance is not None and cls._instance._initialized:
            cls._instance.service.close()
        cls._instance = None


def module_dump(module, module_name: str) -> None:
    """Between this call and ``module_dump_end()``, dump only ``module`` itself (not its children or the
    APIs inside it), named ``Module.{module_name}.{Class}.forward.{n}``. Needs start() before."""
    PrecisionDebugger._get().service.module_dump(module, module_name)


def module_dump_end() -> None:
    """End the ``module_dump`` window: dumping returns to normal."""
    PrecisionDebugger._get().service.module_dump_end()


def save(variable: Any, name: str, save_backward: bool = True) -> None:
    """Save one variable (tensor, number, string, or nested dict/list/tuple of them) into the current
    step's ``debug.json`` as ``{name}.{count}.debug``; with ``save_backward`` the gradients of its tensors
    arrive as ``{name}_grad.{count}.debug``. Repeated names are counted. Tensors are also written to
    ``dump_tensor_data/{name}.{count}.debug.{index}.pt`` when the task is ``tensor``."""
    PrecisionDebugger._get().service.save(variable, name, save_backward)
