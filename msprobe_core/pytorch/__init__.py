"""msprobe-compatible PyTorch API: ``PrecisionDebugger``, ``seed_all``, ``save``, ``module_dump``,
``module_dump_end`` and the training monitor ``TrainerMon``.

Importing this module patches nothing: torch attributes are wrapped only between ``start()`` and ``stop()``.
"""

from msprobe_core.pytorch.debugger import PrecisionDebugger, module_dump, module_dump_end, save
from msprobe_core.pytorch.seed import seed_all

__all__ = ["PrecisionDebugger", "seed_all", "save", "module_dump", "module_dump_end", "TrainerMon"]


def __getattr__(name: str):
    if name == "TrainerMon":  # imported on first use: the monitor pulls in its writers
        from msprobe_core.pytorch.monitor import TrainerMon
        return TrainerMon
    raise AttributeError(f"module 'msprobe_core.pytorch' has no attribute '{name}'")
