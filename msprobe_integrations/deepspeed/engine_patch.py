"""The entry points: ``patch_engine`` / ``unpatch`` / ``initialize`` put a ``ProbeSession`` on one engine.

The dump window opens at the first ``engine(...)`` of an accumulation window and closes after
``engine.step()`` at the boundary; the monitor runs at ``_take_model_step`` (only called at the boundary),
labelled with ``engine.global_steps``; an update the fp16 loss scaler skipped (``engine.skipped_steps`` grew)
is reported as a skipped step. Each patch is an instance-level ``msprobe_core.common.patch.wrap``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from msprobe_core.common.patch import PatchHandle, wrap
from msprobe_core.errors import ConfigError
from msprobe_core.session import ConfigLike, ProbeSession, StateReader
from msprobe_integrations.deepspeed.engine import (DeepSpeedIntegrationError, is_engine, skipped_since, skipped_steps,
                                                  zero_stage)
from msprobe_integrations.deepspeed.hyperparameters import engine_hyperparameters
from msprobe_integrations.deepspeed.zero_readers import make_state_reader

logger = logging.getLogger("msprobe_core.deepspeed")

PATCH_ATTR = "_msprobe_patch"
"""The engine attribute holding its ``EnginePatch`` while patched."""


class EnginePatch:
    """What ``patch_engine`` installed on one engine: the session, the state reader and the wrappers of
    ``forward``, ``step`` and ``_take_model_step``. ``remove()`` undoes it."""

    def __init__(self, engine: Any, session: ProbeSession, reader: Optional[StateReader]):
        self.engine = engine
        self.session = session
        self.reader = reader
        self.in_window = False
        self.hyperparameter_files: list = []
        self._handles: list[PatchHandle] = []

    def install(self) -> None:
        engine, session = self.engine, self.session
        if session.debugger is not None:  # dump errors (a taken dump path, ...) reach the user: no guard
            self._handles.append(wrap(engine, "forward", before=self._open_window, guard=False))
            self._handles.append(wrap(engine, "step", before=lambda *a, **k: engine.is_gradient_accumulation_boundary(),
                                      after=self._close_window, guard=False))
        if session.monitor is not None and self.reader is not None:
            self._handles.append(wrap(engine, "_take_model_step", before=self._before_update,
                                      after=self._after_update, where="monitoring the optimizer step",
                                      logger=logger))

    def _open_window(self, *args: Any, **kwargs: Any) -> None:
        if not self.in_window:
            self.session.begin_step(int(self.engine.global_steps))
            self.in_window = True

    def _close_window(self, boundary: bool, _result: Any = None) -> None:
        if boundary and self.in_window:
            self.in_window = False
            self.session.end_step()

    def _before_update(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        label = int(self.engine.global_steps)
        self.session.before_optimizer_step()
        return label, skipped_steps(self.engine)

    def _after_update(self, token: Optional[tuple[int, int]], _result: Any = None) -> None:
        label, skipped_before = token if token is not None else (None, None)
        skipped = None if skipped_before is None else skipped_since(self.engine, skipped_before)
        self.session.after_optimizer_step(label, skipped=skipped)

    def remove(self, close: bool = True) -> None:
        """Put the engine's own methods back; with ``close`` the open dump step is written and the monitor's
        files are flushed and closed, and the session lets go of the engine's module, optimizer and groups."""
        while self._handles:
            self._handles.pop().remove()
        if close:
            self.session.close()
            self.reader = None  # it holds the engine
        self.in_window = False


def patch_engine(engine: Any, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None, capture_hyperparameters: bool = True,
                 config_check_path: Optional[str] = None) -> Any:
    """Dump (``config_path``: the dump's config.json, path or dict) and monitor (``monitor_config_path``)
    a ``DeepSpeedEngine`` returned by ``deepspeed.initialize``; returns the same engine.
    ``config_check_path``: also write msprobe's config_check pack (a zip) there.

    Idempotent: patching an already patched engine returns it unchanged (a warning says the new configs
    were ignored). ``unpatch(engine)`` removes everything and flushes the outputs.
    """
    if not is_engine(engine):
        raise DeepSpeedIntegrationError(f"patch_engine expects the DeepSpeedEngine returned by deepspeed.initialize, "
                                        f"got {type(engine).__name__}")
    existing = getattr(engine, PATCH_ATTR, None)
    if existing is not None:
        if config_path is not None or monitor_config_path is not None or config_check_path is not None:
            logger.warning("msprobe: the engine is already patched; the configs given now are ignored "
                           "(call unpatch(engine) first to change them)")
        return engine
    if config_path is None and monitor_config_path is None and config_check_path is None:
        raise ConfigError("config_path/monitor_config_path/config_check_path", None,
                          "at least one of them: the dump's config.json, the monitor's config (path or dict) "
                          "and/or the config_check pack")
    if engine.optimizer is None and monitor_config_path is not None:
        raise ConfigError("monitor_config_path", monitor_config_path,
                          "only for an engine with an optimizer (deepspeed.initialize(..., optimizer=...) or a ds_config optimizer)")
    session = ProbeSession(config_path, monitor_config_path, monitor_output_dir=monitor_output_dir,
                           config_check_path=config_check_path)
    reader = make_state_reader(engine) if session.monitor is not None else None
    session.attach(engine.module, engine.optimizer, grad_acc_steps=max(1, int(engine.gradient_accumulation_steps())),
                   state_reader=reader, dp_group=reader.group if reader is not None else None,
                   start_iteration=int(engine.global_steps))
    patch = EnginePatch(engine, session, reader)
    patch.install()
    object.__setattr__(engine, PATCH_ATTR, patch)
    if capture_hyperparameters:
        try:
            patch.hyperparameter_files = session.write_hyperparameters(engine_hyperparameters(engine))
        except Exception:
            logger.exception("msprobe: capturing the DeepSpeed hyperparameters failed")
    logger.info("msprobe: DeepSpeed engine patched (ZeRO stage %d, reader %s)", zero_stage(engine),
                type(reader).__name__ if reader is not None else "none")
    return engine


def get_patch(engine: Any) -> Optional[EnginePatch]:
    """The engine's ``EnginePatch`` (its ``session``, ``reader``) or None when it is not patched."""
    return getattr(engine, PATCH_ATTR, None)


def unpatch(engine: Any, close: bool = True) -> Any:
    """Undo ``patch_engine``: the engine's own methods come back; with ``close`` the open dump step is
    written and the monitor's files are flushed and closed. Does nothing on an unpatched engine."""
    patch = getattr(engine, PATCH_ATTR, None)
    if patch is None:
        return engine
    patch.remove(close=close)
    engine.__dict__.pop(PATCH_ATTR, None)
    return engine


def initialize(*args: Any, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None,
               monitor_output_dir: Optional[str] = None, capture_hyperparameters: bool = True,
               config_check_path: Optional[str] = None, **kwargs: Any) -> Any:
    """Drop-in for ``deepspeed.initialize``: the same arguments and return value, with the engine patched
    (``patch_engine``) when a dump or monitor config or a config_check pack path is given."""
    import deepspeed

    result = deepspeed.initialize(*args, **kwargs)
    if config_path is not None or monitor_config_path is not None or config_check_path is not None:
        patch_engine(result[0], config_path, monitor_config_path, monitor_output_dir=monitor_output_dir,
                     capture_hyperparameters=capture_hyperparameters, config_check_path=config_check_path)
    return result
