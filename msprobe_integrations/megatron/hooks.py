"""Wrappers for Megatron-LM's training functions, and ``install()`` that puts them in place.

Megatron-LM users add flags instead of editing the training loop. ``install()`` wraps, in
``megatron.training.training`` (or any module with the same functions):

- ``parse_args`` (in ``megatron.training.arguments``): the caller's ``extra_args_provider`` is composed
  with ``add_args``, so ``--msprobe-config`` / ``--msprobe-monitor-config`` parse as Megatron arguments.
  Every route to Megatron's arguments calls it: ``initialize_megatron`` under the older ``pretrain(...,
  extra_args_provider=...)``, and ``parse_and_validate_args(extra_args_provider=...)``, which scripts call
  before megatron-core 0.19's ``pretrain(cfg_container, ...)``;
- ``setup_model_and_optimizer``: once it returns (model built, optimizer built, checkpoint loaded), the
  probe attaches to the model chunks and the optimizer and writes the hyperparameters;
- ``train_step``: the iteration's dump starts before the forward-backward schedule and is stopped and
  written at the end; the monitor runs at the optimizer step inside it.

The same wrappers are what MindSpeed's patch manager registers (their names end in ``wrapper``, which is
how ``MindSpeedPatchesManager.register_patch`` tells a decorator from a replacement).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Any, Callable, Optional

from msprobe_core.common.patch import PatchHandle, mark, marked, patch
from msprobe_core.errors import MsprobeError
from msprobe_integrations.megatron.args import with_msprobe_args
from msprobe_integrations.megatron.probe import ConfigLike, MegatronProbe

logger = logging.getLogger("msprobe_core.megatron")

TRAINING_MODULE = "megatron.training.training"
ARGUMENTS_MODULE = "megatron.training.arguments"


class MegatronIntegrationError(MsprobeError, RuntimeError):
    """Megatron-LM's training module (or a function the integration wraps) is not there."""


def _args_getter(module: Any) -> Callable[[], Any]:
    """``get_args`` of the training module, else Megatron-LM's global one; None while args are unset."""
    candidates = [getattr(module, "get_args", None)]
    for name in ("megatron.training.global_vars", "megatron.training"):
        try:
            candidates.append(getattr(importlib.import_module(name), "get_args", None))
        except Exception:
            pass
    getters = [g for g in candidates if callable(g)]

    def get() -> Any:
        for g in getters:
            try:
                args = g()
            except Exception:  # Megatron asserts while its args are not initialised
                continue
            if args is not None:
                return args
        return None

    return get


class MegatronHooks:
    """Decorators for ``parse_args``, ``setup_model_and_optimizer`` and ``train_step``, sharing one probe.

    The probe's configs come from the constructor when given, else from Megatron's args
    (``--msprobe-config`` / ``--msprobe-monitor-config``) when the model is set up. Without either the
    wrappers only call through.
    """

    def __init__(self, config_path: ConfigLike = None, monitor_config_path: ConfigLike = None, *,
                 monitor_output_dir: Optional[str] = None, capture_hyperparameters: Optional[bool] = None,
                 args_getter: Optional[Callable[[], Any]] = None, config_check_path: Optional[str] = None):
        self.config_path = config_path
        self.config_check_path = config_check_path
        self.monitor_config_path = monitor_config_path
        self.monitor_output_dir = monitor_output_dir
        self.capture_hyperparameters = capture_hyperparameters
        self.args_getter = args_getter or (lambda: None)
        self.probe: Optional[MegatronProbe] = None
        self._handles: list[PatchHandle] = []

    # ------------------------------------------------------------------------------ the probe
    def args(self) -> Any:
        try:
            return self.args_getter()
        except Exception:
            return None

    def get_probe(self) -> MegatronProbe:
        """The run's probe, created on first use from the explicit configs or Megatron's args."""
        if self.probe is None:
            args = self.args()
            from_args = MegatronProbe.from_args(args)
            capture = self.capture_hyperparameters if self.capture_hyperparameters is not None else from_args.capture
            self.probe = MegatronProbe(
                self.config_path if self.config_path is not None else from_args.config_path,
                self.monitor_config_path if self.monitor_config_path is not None else from_args.monitor_config_path,
                monitor_output_dir=self.monitor_output_dir or from_args.monitor_output_dir,
                capture_hyperparameters=capture,
                config_check_path=self.config_check_path or from_args.config_check_path)
        return self.probe

    # ------------------------------------------------------------------------------ decorators
    def parse_args_wrapper(self, fn: Callable) -> Callable:
        """``parse_args(extra_args_provider=None, ...)`` with ``add_args`` composed into the provider."""
        if marked(fn, "megatron"):
            return fn
        signature = _signature(fn)

        @functools.wraps(fn)
        def parse_args(*args: Any, **kwargs: Any) -> Any:
            bound = _bind(signature, args, kwargs)
            if bound is not None and "extra_args_provider" in signature.parameters:
                bound.arguments["extra_args_provider"] = with_msprobe_args(bound.arguments.get("extra_args_provider"))
                return fn(*bound.args, **bound.kwargs)
            return fn(*args, **kwargs)

        return mark(parse_args, "megatron")

    def setup_model_and_optimizer_wrapper(self, fn: Callable) -> Callable:
        """Attach the probe once ``setup_model_and_optimizer`` returned (model, optimizer, scheduler)."""
        if marked(fn, "megatron"):
            return fn

        @functools.wraps(fn)
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            probe = self.get_probe()
            if probe.enabled and isinstance(result, (tuple, list)) and len(result) >= 2:
                scheduler = result[2] if len(result) > 2 else None
                probe.setup(result[0], result[1], scheduler, self.args())
            return result

        return mark(setup_model_and_optimizer, "megatron")

    def train_step_wrapper(self, fn: Callable) -> Callable:
        """Dump iteration ``iteration + 1`` around ``train_step`` (all its micro-batches); the monitor runs
        at the optimizer step inside. Sets the probe up on first call if ``setup_model_and_optimizer``
        was not wrapped (MindSpeed, custom loops)."""
        if marked(fn, "megatron"):
            return fn
        signature = _signature(fn)

        @functools.wraps(fn)
        def train_step(*args: Any, **kwargs: Any) -> Any:
            probe = self.get_probe()
            if not probe.enabled:
                return fn(*args, **kwargs)
            bound = _bind(signature, args, kwargs)
            named = dict(bound.arguments) if bound is not None else {}
            if not probe.is_setup:
                model = named.get("model", args[2] if len(args) > 2 else None)
                optimizer = named.get("optimizer", args[3] if len(args) > 3 else None)
                if model is not None:
                    probe.setup(model, optimizer, named.get("opt_param_scheduler"), self.args())
            iteration = named.get("iteration")
            probe.begin_iteration(int(iteration) + 1 if isinstance(iteration, int) else None)
            try:
                return fn(*args, **kwargs)
            finally:
                probe.end_iteration()

        return mark(train_step, "megatron")

    # ------------------------------------------------------------------------------ patching
    def patch(self, module: Any, name: str, decorator: Callable[[Callable], Callable], required: bool = True) -> bool:
        """Replace ``module.name`` by ``decorator(module.name)``, also where other loaded modules imported
        the same function by name (``from megatron.training.training import train_step``)."""
        original = getattr(module, name, None)
        if original is None:
            if required:
                raise MegatronIntegrationError(f"{getattr(module, '__name__', module)} has no '{name}' to wrap")
            return False
        if marked(original, "megatron"):
            return False
        wrapped = decorator(original)
        holders = [module] + [m for m in list(sys.modules.values())
                              if m is not None and m is not module and _module_dict(m).get(name) is original]
        for holder in holders:
            self._handles.append(patch(holder, name, lambda _original: wrapped))
        return True

    def uninstall(self) -> None:
        """Put the original functions back (where they are still ours)."""
        while self._handles:
            self._handles.pop().remove()

    def close(self) -> None:
        """Close the probe (finish the dump step, flush the monitor) and uninstall."""
        if self.probe is not None:
            self.probe.close()
        self.uninstall()


def _module_dict(module: Any) -> dict:
    try:
        return vars(module)
    except TypeError:
        return {}


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind(signature: Optional[inspect.Signature], args: tuple, kwargs: dict) -> Optional[inspect.BoundArguments]:
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def install(module: Any = None, *, args: Any = None, config_path: ConfigLike = None,
            monitor_config_path: ConfigLike = None, monitor_output_dir: Optional[str] = None,
            capture_hyperparameters: Optional[bool] = None, patch_parse_args: bool = True,
            config_check_path: Optional[str] = None) -> MegatronHooks:
    """Wrap Megatron-LM's ``train_step`` and ``setup_model_and_optimizer`` (and ``parse_args``).

    ``module``: the training module (default ``megatron.training.training``; a module object or a
    dotted name). ``args``: Megatron's args namespace if known (default: its ``get_args()`` when the
    probe is set up). Explicit configs override the ``--msprobe-*`` flags. Returns the hooks;
    ``hooks.close()`` finishes and undoes everything.
    """
    if module is None or isinstance(module, str):
        name = module or TRAINING_MODULE
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise MegatronIntegrationError(
                f"cannot import {name} ({exc}); the launcher wraps Megatron-LM's train_step. With megatron-core "
                "alone, drive MegatronProbe from your own loop (see recipes/megatron_core_gpt.py)") from exc
    getter = (lambda: args) if args is not None else _args_getter(module)
    hooks = MegatronHooks(config_path, monitor_config_path, monitor_output_dir=monitor_output_dir,
                          capture_hyperparameters=capture_hyperparameters, args_getter=getter,
                          config_check_path=config_check_path)
    hooks.patch(module, "train_step", hooks.train_step_wrapper)
    hooks.patch(module, "setup_model_and_optimizer", hooks.setup_model_and_optimizer_wrapper, required=False)
    if patch_parse_args:
        arguments = module if hasattr(module, "parse_args") else None
        if arguments is None and getattr(module, "__name__", "") == TRAINING_MODULE:
            try:
                arguments = importlib.import_module(ARGUMENTS_MODULE)
            except ImportError:
                arguments = None
        if arguments is not None:
            hooks.patch(arguments, "parse_args", hooks.parse_args_wrapper, required=False)
    return hooks
