"""msprobe-compatible PyTorch API: ``PrecisionDebugger``, ``seed_all``, ``save``, ``module_dump``,
``module_dump_end``, ``random_save`` and the training monitor ``TrainerMon``.

This package holds only what touches PyTorch's API: the dump's hooks and service (``api_patch``,
``dump_service``, ``debugger``), tensor statistics (``tensor_stats``, ``tensor_crc``, ``summarize``), tensor
files (``pt_writer``), ranks and process groups (``ranks``) and ``seed_all``. ``TrainerMon`` is the
monitor's (``msprobe_core.monitor``, which builds on this package) and ``random_save`` is config_check's
(its random API recorder, ``msprobe_core.config_check.random_save``), both imported on first use. Importing this
package patches nothing: torch attributes are wrapped only between ``start()`` and ``stop()``.
"""

from msprobe_core.pytorch.debugger import PrecisionDebugger, module_dump, module_dump_end, save
from msprobe_core.pytorch.seed import seed_all

__all__ = ["PrecisionDebugger", "seed_all", "save", "module_dump", "module_dump_end", "random_save", "TrainerMon"]


def __getattr__(name: str):
    if name == "TrainerMon":  # imported on first use: the monitor (a feature above this package) and its writers
        from msprobe_core.monitor.trainer_mon import TrainerMon
        return TrainerMon
    if name == "random_save":  # config_check's random API recorder, as msprobe.pytorch exports it
        from msprobe_core.config_check.random_save import random_save
        return random_save
    raise AttributeError(f"module 'msprobe_core.pytorch' has no attribute '{name}'")
