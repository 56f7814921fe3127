"""``seed_all`` for MindSpore and mindtorch: msprobe.mindspore.seed_all(seed=1234, mode=False, rm_dropout=False)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np

from msprobe_core.common.patch import PatchHandle, patch
from msprobe_core.errors import ConfigError
from msprobe_core.mindspore.runtime import MINDTORCH, framework

_NO_DROPOUT: dict[tuple[int, str], PatchHandle] = {}  # (id(owner), name) -> the patch that disables it


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False) -> None:
    """Fix random seeds (Python's hash and ``random``, NumPy, MindSpore's global seed, and torch's under
    mindtorch); ``mode=True`` turns on MindSpore's deterministic computing (``mindspore.set_deterministic``,
    and ``HCCL_DETERMINISTIC`` for reductions on Ascend); ``rm_dropout=True`` makes ``ops.Dropout``,
    ``ops.Dropout2D``, ``ops.Dropout3D``, ``nn.Dropout``, ``mint.nn.Dropout`` (created afterwards) and every
    call of ``mint.nn.functional.dropout`` / ``ops.dropout`` (and ``torch.nn.functional.dropout`` under
    mindtorch) keep every element."""
    import mindspore as ms

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError("seed", seed, "an int in [0, 2**32)")
    for flag_name, flag in (("mode", mode), ("rm_dropout", rm_dropout)):
        if not isinstance(flag, bool):
            raise ConfigError(flag_name, flag, "True or False")
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    ms.set_seed(seed)
    if framework() == MINDTORCH:
        import torch  # mindtorch's

        torch.manual_seed(seed)
    if mode:
        os.environ["HCCL_DETERMINISTIC"] = "true"
        ms.set_deterministic(True)
    if rm_dropout:
        _remove_dropout()


def _remove_dropout() -> None:
    from mindspore import mint, nn, ops

    def keep_all_init(argument: str, value: float, drop: tuple[str, ...] = ()):
        """An ``__init__`` whose first argument (``argument``: the keep or drop probability) is ``value``."""
        def make(original):
            def __init__(self, *args: Any, **kwargs: Any):
                for name in (argument, *drop):
                    kwargs.pop(name, None)
                if args:
                    original(self, value, *args[1:], **kwargs)
                else:
                    original(self, **{argument: value}, **kwargs)
            return __init__
        return make

    def no_drop(original):
        def dropout(input, p=0.5, *args: Any, **kwargs: Any):
            return original(input, 0.0, *args, **kwargs)
        return dropout

    targets = [(ops.Dropout, "__init__", keep_all_init("keep_prob", 1.0)),
               (ops.Dropout2D, "__init__", keep_all_init("keep_prob", 1.0)),
               (ops.Dropout3D, "__init__", keep_all_init("keep_prob", 1.0)),
               (nn.Dropout, "__init__", keep_all_init("keep_prob", 1.0, drop=("p",))),
               (mint.nn.Dropout, "__init__", keep_all_init("p", 0.0)),
               (mint.nn.functional, "dropout", no_drop),
               (ops, "dropout", no_drop)]
    if framework() == MINDTORCH:
        import torch  # mindtorch's

        targets += [(torch.nn.functional, "dropout", no_drop), (torch.nn.Dropout, "__init__", keep_all_init("p", 0.0))]
    for owner, name, make in targets:
        if (id(owner), name) not in _NO_DROPOUT:
            _NO_DROPOUT[(id(owner), name)] = patch(owner, name, make)
