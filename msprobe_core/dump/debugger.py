"""``PrecisionDebugger``, the framework-free part of msprobe's dump entry point: one debugger per process,
config loading and validation, class-level calls from another file (cross-file dump).

Each framework subclasses it with its dump service (``_make_service``): ``msprobe_core.pytorch.debugger``,
``msprobe_core.mindspore.debugger``; each subclass keeps its own process-wide instance."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from msprobe_core.common.exit_close import cancel_close_at_exit
from msprobe_core.dump.config import DumpConfig, load_dump_config
from msprobe_core.dump.dynamic import DynamicSwitch, same_settings
from msprobe_core.errors import DumpStateError

logger = logging.getLogger("msprobe_core")


def _describe(cfg: DumpConfig) -> str:
    """How a config is named in messages: its file, or what it sets."""
    where = {None: "no config file", "config": "a config dict"}.get(cfg.source, f"config_path={cfg.source!r}")
    return f"{where} (task {cfg.task}, level {cfg.level}, dump_path {cfg.dump_path!r})"


class PrecisionDebugger:
    """The debugger every framework's ``PrecisionDebugger`` is: one per process (constructing it again
    returns the same instance), the config from a file, a dict or the constructor's arguments (validated
    before anything is written), and ``start`` / ``stop`` / ``step`` callable on the class from another
    file. A subclass supplies its framework's dump service (``_make_service``)."""

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
        overrides = {"task": task, "dump_path": dump_path, "level": level, "step": step}
        if self._initialized:
            if config_path is not None or wrap_list is not None or any(v is not None for v in overrides.values()):
                self._reconfigure(config_path, overrides, wrap_list)
            return
        try:
            cfg = load_dump_config(config_path, **overrides)
        except BaseException:
            type(self)._instance = None
            raise
        self._install(cfg, config_path, overrides, wrap_list)
        self._initialized = True

    def _install(self, cfg: DumpConfig, config_path: Any, overrides: dict, wrap_list: Optional[str]) -> None:
        self.config: DumpConfig = cfg
        self.service = self._make_service(cfg, wrap_list)
        self._config_path = config_path
        self._wrap_list = wrap_list
        self._dynamic = DynamicSwitch.for_config(config_path, cfg, overrides)

    def _reconfigure(self, config_path: Any, overrides: dict, wrap_list: Optional[str]) -> None:
        """A second ``PrecisionDebugger(config_path=OTHER)`` in the process: the new config replaces the old
        one while the debugger is idle (its steps start again at 0); in the middle of a step it is refused.
        Arguments without a ``config_path`` (``PrecisionDebugger(dump_path=...)``) change the current config."""
        if config_path is None:
            config_path = self._config_path
        cfg = load_dump_config(config_path, **overrides)  # invalid: raised, the current debugger stays
        if same_settings(cfg, self.config) and wrap_list == self._wrap_list:
            return
        if not self.service.idle:
            raise DumpStateError(
                f"PrecisionDebugger({_describe(cfg)}) was created while the debugger of {_describe(self.config)} "
                f"is in the middle of step {self.service.current_step} (between start() and step()); call stop() "
                "and step() first, then create the new PrecisionDebugger")
        logger.info("PrecisionDebugger: %s replaces %s; steps start again at 0", _describe(cfg), _describe(self.config))
        self._replace_service(cfg, config_path, overrides, wrap_list, keep_step=False)

    def _replace_service(self, cfg: DumpConfig, config_path: Any, overrides: dict, wrap_list: Optional[str],
                         keep_step: bool) -> None:
        old = self.service
        old.close()
        cancel_close_at_exit(old._close_at_exit)
        self._install(cfg, config_path, overrides, wrap_list)
        self.service._rank_id = old._rank_id  # start(rank_id=...) names this process's folders whatever the config
        if keep_step:  # the same job goes on: step numbers continue and its own step folders are not "taken"
            self.service.set_init_step(old.current_step)
            if os.path.abspath(cfg.dump_path) == os.path.abspath(old.cfg.dump_path):
                self.service._checked_dirs.update(old._checked_dirs)

    def _follow_config_file(self) -> None:
        """``dump_enable``: at a step boundary, apply an edit of the config file (see ``dynamic``)."""
        cfg = self._dynamic.poll() if self._dynamic is not None else None
        if cfg is None:
            return
        was = self.config
        if same_settings(cfg, was, ignore_enable=True):
            self.config = cfg
        else:
            self._replace_service(cfg, cfg.source, self._dynamic.overrides, self._wrap_list, keep_step=True)
        if cfg.dump_enable is not was.dump_enable:
            logger.info("dump_enable is now %s in %s: dumping %s from step %d", cfg.dump_enable, cfg.source,
                        "resumes" if cfg.dump_enable is not False else "pauses", self.service.current_step)

    @property
    def enabled(self) -> bool:
        """False while the config file says ``dump_enable: false`` (start() then does nothing)."""
        return self.config.dump_enable is not False

    @staticmethod
    def _make_service(cfg: DumpConfig, wrap_list: Optional[str]) -> Any:
        """The framework's dump service: each framework's debugger makes its own."""
        raise NotImplementedError("use a framework's PrecisionDebugger (msprobe_core.pytorch, msprobe_core.mindspore)")

    # ---------------------------------------------------------------- msprobe API (instance or class level)
    @classmethod
    def _get(cls) -> "PrecisionDebugger":
        if cls._instance is None or not cls._instance._initialized:
            raise DumpStateError("PrecisionDebugger is not created yet: call PrecisionDebugger(config_path=...) first")
        return cls._instance

    @classmethod
    def _target(cls, obj: Any) -> "PrecisionDebugger":
        return obj if isinstance(obj, cls) else cls._get()

    class _Dual:
        """A method callable on the instance or on the class (msprobe's cross-file usage)."""

        def __init__(self, fn):
            self.fn = fn
            self.__doc__ = fn.__doc__

        def __get__(self, obj, owner):
            target = obj
            fn = self.fn

            def bound(*args, **kwargs):
                return fn(owner._target(target), *args, **kwargs)

            bound.__doc__ = fn.__doc__
            bound.__name__ = fn.__name__
            return bound

    @_Dual
    def start(self, model=None, token_range=None, rank_id: Optional[int] = None) -> None:
        """Start collecting. ``model``: the module (or list/tuple of modules) whose submodules L0/mix dump;
        ``token_range=[start, end]``: dump only the forward passes producing those tokens (0 = prefill);
        ``rank_id``: name the rank folder explicitly (e.g. SGLang DP workers sharing a rank). Does nothing
        while the config file says ``dump_enable: false``."""
        if self._dynamic is not None and self.service.idle:  # a step boundary: the next step starts
            self._follow_config_file()
        if self.config.dump_enable is False:
            return
        self.service.start(model=model, token_range=token_range, rank_id=rank_id)

    @_Dual
    def stop(self) -> None:
        """Stop collecting; records stay in the current step (backward hooks still record until step())."""
        self.service.stop()

    @_Dual
    def step(self) -> None:
        """End the step: write dump.json, stack.json and construct.json, then count the next step. With
        ``dump_enable`` in the config file, an edit of the file applies from the next step (it is looked for
        here and at the start() that opens a step)."""
        self.service.step()
        self._follow_config_file()

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
    def module_dump(self, module: Any, module_name: str) -> None:
        """Between this call and ``module_dump_end()``, dump only ``module`` itself (not its children or the
        APIs inside it), named ``{Module|Cell}.{module_name}.{Class}.forward.{n}``. Needs start() before."""
        self.service.module_dump(module, module_name)

    @_Dual
    def module_dump_end(self) -> None:
        """End the ``module_dump`` window: dumping returns to normal."""
        self.service.module_dump_end()

    @_Dual
    def close(self) -> None:
        """Finish the open step and restore every patched attribute and hook now (also done at exit)."""
        self.service.close()

    @property
    def current_step(self) -> int:
        """The number of the step being dumped (the next ``step()`` finishes it)."""
        return self.service.current_step

    @property
    def last_rank_dir(self) -> Optional[Path]:
        """The rank folder (``dump_path/step{N}/rank{R}``) whose dump.json the last ``step()`` wrote, or None."""
        return self.service.last_rank_dir

    @classmethod
    def current(cls) -> Optional["PrecisionDebugger"]:
        """The process's debugger, or None when none is created."""
        instance = cls._instance
        return instance if instance is not None and instance._initialized else None

    @classmethod
    def release(cls, debugger: "PrecisionDebugger") -> None:
        """Close ``debugger`` and, if it is the process's debugger, forget it so that a new one (with another
        config) can be created. For integrations that created the debugger themselves."""
        debugger.service.close()
        if cls._instance is debugger:
            cls._instance = None

    @classmethod
    def reset(cls) -> None:
        """Close and forget the process's debugger so a new one can be created (tests, notebooks)."""
        if cls._instance is not None and cls._instance._initialized:
            cls._instance.service.close()
        cls._instance = None

