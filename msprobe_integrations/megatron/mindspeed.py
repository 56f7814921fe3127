"""MindSpeed: enable msprobe through MindSpeed's patch manager.

MindSpeed applies its features by registering patches with ``MindSpeedPatchesManager`` (its
``--npu-datadump`` feature registers a dump start/stop around the training step the same way). A
registered function whose name ends in ``wrapper`` is applied as a decorator on top of whatever
implementation of ``megatron.training.training.train_step`` MindSpeed (or MindSpeed-LLM) installs, so
the msprobe wrappers survive MindSpeed's own replacements. ``register()`` does this now;
``msprobe_feature()`` gives a ``MindSpeedFeature`` that does it from MindSpeed's feature list when the
``--msprobe-*`` flags are given.

mindspeed itself is not installable here (it is not on PyPI and needs torch_npu); this module imports it
only when called.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

from msprobe_integrations.megatron.args import add_args
from msprobe_integrations.megatron.hooks import ARGUMENTS_MODULE, TRAINING_MODULE, MegatronHooks

PATCHES = (
    (f"{TRAINING_MODULE}.train_step", "train_step_wrapper"),
    (f"{TRAINING_MODULE}.setup_model_and_optimizer", "setup_model_and_optimizer_wrapper"),
    (f"{ARGUMENTS_MODULE}.parse_args", "parse_args_wrapper"),
)


def available() -> bool:
    """Whether ``mindspeed`` can be imported."""
    try:
        return importlib.util.find_spec("mindspeed") is not None
    except (ImportError, ValueError):
        return False


def patch_manager() -> Any:
    from mindspeed.patch_utils import MindSpeedPatchesManager

    return MindSpeedPatchesManager


def register(hooks: MegatronHooks, manager: Any = None, apply: bool = True) -> Any:
    """Register the hooks' wrappers with MindSpeed's patch manager (and apply them now unless
    ``apply=False``, as inside a feature's ``register_patches`` where MindSpeed applies them)."""
    manager = manager if manager is not None else patch_manager()
    for target, attr in PATCHES:
        manager.register_patch(target, getattr(hooks, attr))
    if apply:
        manager.apply_patches()
    return manager


def msprobe_feature(hooks: Optional[MegatronHooks] = None) -> Any:
    """A ``MindSpeedFeature`` named ``msprobe``: adds the ``--msprobe-*`` flags and, when one is given,
    registers the wrappers. Append it to MindSpeed's feature list."""
    from mindspeed.features_manager.feature import MindSpeedFeature

    class MsprobeFeature(MindSpeedFeature):
        def __init__(self) -> None:
            super().__init__("msprobe")
            self.hooks = hooks

        def register_args(self, parser: Any) -> None:
            add_args(parser)

        def register_patches(self, patch_manager: Any, args: Any) -> None:
            if getattr(args, "msprobe_config", None) or getattr(args, "msprobe_monitor_config", None):
                if self.hooks is None:
                    self.hooks = MegatronHooks(args_getter=lambda: args)
                register(self.hooks, patch_manager, apply=False)

    return MsprobeFeature()
