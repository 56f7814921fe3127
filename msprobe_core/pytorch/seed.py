"""``seed_all``: fix every source of randomness msprobe's table lists that exists on CPU/CUDA."""

from __future__ import annotations

import os
import random

import torch

from msprobe_core.errors import ConfigError

_DROPOUT_FUNCS = ("dropout", "dropout2d", "dropout3d")
_DROPOUT_MODULES = ("Dropout", "Dropout2d", "Dropout3d")


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False, is_enhanced: bool = False) -> None:
    """Fix random seeds (Python, NumPy, torch CPU and CUDA), optionally deterministic algorithms (``mode``),
    dropout with p=0 (``rm_dropout``, for dropout modules created afterwards and every functional call),
    and with ``is_enhanced`` the same random values for every repeated call of a random API.

    ``HCCL_DETERMINISTIC`` is set as msprobe does (it only matters on Ascend); torch_npu is seeded when
    importable.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError("seed", seed, "an int in [0, 2**32)")
    for flag_name, flag in (("mode", mode), ("rm_dropout", rm_dropout), ("is_enhanced", is_enhanced)):
        if not isinstance(flag, bool):
            raise ConfigError(flag_name, flag, "True or False")
    os.environ["PYTHONHASHSEED"] = str(seed)
    os.environ["HCCL_DETERMINISTIC"] = "True"
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
    try:  # pragma: no cover - Ascend only
        import torch_npu  # type: ignore
        torch_npu.npu.manual_seed(seed)
        torch_npu.npu.manual_seed_all(seed)
    except ImportError:
        pass
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.enabled = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if rm_dropout:
        _remove_dropout()
    if is_enhanced:
        _enhance(seed)


def _remove_dropout() -> None:
    import torch.nn.functional as F

    for name in _DROPOUT_FUNCS:
        original = getattr(F, name)
        if getattr(original, "__msprobe_no_dropout__", False):
            continue

        def no_dropout(input, p=0.5, training=True, inplace=False, _orig=original):
            return _orig(input, 0.0, training, inplace)

        no_dropout.__msprobe_no_dropout__ = True  # type: ignore[attr-defined]
        setattr(F, name, no_dropout)
    for name in _DROPOUT_MODULES:
        cls = getattr(torch.nn, name)
        if getattr(cls.__init__, "__msprobe_no_dropout__", False):
            continue
        original_init = cls.__init__

        def init(self, p=0.5, inplace=False, _orig=original_init):
            _orig(self, 0.0, inplace)

        init.__msprobe_no_dropout__ = True  # type: ignore[attr-defined]
        cls.__init__ = init


_ENHANCED_APIS = ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
                  "normal", "bernoulli", "multinomial")


def _enhance(seed: int) -> None:
    """Re-seed torch, NumPy and Python before every call of a random torch API, so repeated calls (in one
    process or several) give the same values."""
    for name in _ENHANCED_APIS:
        original = getattr(torch, name)
        if getattr(original, "__msprobe_enhanced__", False):
            continue

        def reseeded(*args, _orig=original, **kwargs):
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                import numpy as np
                np.random.seed(seed)
            except ImportError:  # pragma: no cover
                pass
            return _orig(*args, **kwargs)

        reseeded.__msprobe_enhanced__ = True  # type: ignore[attr-defined]
        reseeded.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(torch, name, reseeded)
