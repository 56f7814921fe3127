"""``seed_all``: fix every source of randomness msprobe's table lists that exists on CPU/CUDA."""

from __future__ import annotations

import os
import random

import torch

from msprobe_core.common.patch import PatchHandle, mark, marked, patch
from msprobe_core.errors import ConfigError

_DROPOUT_FUNCS = ("dropout", "dropout2d", "dropout3d")
_DROPOUT_MODULES = ("Dropout", "Dropout2d", "Dropout3d")

PATCHES: list[PatchHandle] = []
"""What ``rm_dropout`` / ``is_enhanced`` patched (they last for the process, as in msprobe)."""


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False, is_enhanced: bool = False) -> None:
    """Fix random seeds (Python, NumPy, torch CPU and CUDA), optionally deterministic algorithms (``mode``),
    dropout with p=0 (``rm_dropout``, for dropout modules created afterwards and every functional call),
    and with ``is_enhanced`` the same random values for every repeated call of a random API (torch's random
    functions, Tensor methods such as ``normal_`` / ``uniform_`` and so every ``nn.init``, ``numpy.random.*``,
    Python's ``random.*``).

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

    def no_dropout(original):
        def dropout(input, p=0.5, training=True, inplace=False):
            return original(input, 0.0, training, inplace)

        return mark(dropout, "no_dropout", original)

    def no_dropout_init(original):
        def init(self, p=0.5, inplace=False):
            original(self, 0.0, inplace)

        return mark(init, "no_dropout", original)

    for name in _DROPOUT_FUNCS:
        if not marked(getattr(F, name), "no_dropout"):
            PATCHES.append(patch(F, name, no_dropout))
    for name in _DROPOUT_MODULES:
        cls = getattr(torch.nn, name)
        if not marked(cls.__init__, "no_dropout"):
            PATCHES.append(patch(cls, "__init__", no_dropout_init))


_ENHANCED_APIS: dict[str, tuple[str, ...]] = {
    "torch": ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
              "bernoulli", "multinomial", "poisson"),
    # in-place Tensor methods: nn.init (uniform_, normal_, kaiming_*, xavier_*, trunc_normal_...) draws with these
    "torch.Tensor": ("random_", "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
                     "cauchy_"),
    "numpy.random": ("rand", "randn", "randint", "random", "random_sample", "ranf", "sample", "choice", "shuffle",
                     "permutation", "normal", "uniform", "standard_normal", "binomial", "poisson", "exponential",
                     "beta", "gamma", "bytes"),
    "random": ("random", "randint", "randrange", "randbytes", "getrandbits", "uniform", "triangular", "gauss",
               "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "choice", "choices",
               "shuffle", "sample"),
}


def _enhanced_owners() -> list[tuple[object, tuple[str, ...]]]:
    owners: list[tuple[object, tuple[str, ...]]] = [(torch, _ENHANCED_APIS["torch"]),
                                                     (torch.Tensor, _ENHANCED_APIS["torch.Tensor"]),
                                                     (random, _ENHANCED_APIS["random"])]
    try:
        import numpy as np
        owners.append((np.random, _ENHANCED_APIS["numpy.random"]))
    except ImportError:  # pragma: no cover
        pass
    return owners


def _enhance(seed: int) -> None:
    """Re-seed torch, NumPy and Python before every call of a random API of any of them (torch functions,
    Tensor methods such as ``normal_`` / ``uniform_`` and thus ``nn.init``, ``numpy.random.*``, ``random.*``),
    so repeated calls (in one process or several) give the same values."""
    def reseeding(original):
        def reseeded(*args, **kwargs):
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                import numpy as np
                np.random.seed(seed)
            except ImportError:  # pragma: no cover
                pass
            return original(*args, **kwargs)

        return mark(reseeded, "reseed", original)

    for owner, names in _enhanced_owners():
        for name in names:
            current = getattr(owner, name, None)
            if current is not None and not marked(current, "reseed"):
                PATCHES.append(patch(owner, name, reseeding))
