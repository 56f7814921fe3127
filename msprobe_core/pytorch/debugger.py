"""``PrecisionDebugger`` and the module-level helpers of msprobe's PyTorch dump API.

The core's debugger (``msprobe_core.dump.debugger``: one per process, config loading and validation,
class-level calls from another file) with the PyTorch dump service (``dump_service``) behind it.
"""

from __future__ import annotations

from typing import Any, Optional

from msprobe_core.dump import debugger
from msprobe_core.dump.config import DumpConfig


class PrecisionDebugger(debugger.PrecisionDebugger):
    """msprobe's PyTorch dump entry point: ``PrecisionDebugger(config_path=None, task=None, dump_path=None,
    level=None, step=None)``.

    Constructor arguments override the config file; with neither, L1 statistics of every rank and step go
    to ``./msprobe_dump``. One debugger per process: constructing it again returns the same instance, so
    ``PrecisionDebugger.start()`` / ``stop()`` / ``step()`` also work as class-level calls from another file
    (cross-file dump). Constructed again with another config, it applies that config when it is idle (steps
    start again at 0) and raises ``DumpStateError`` in the middle of a step (arguments without a
    ``config_path`` change the current config); with no arguments, or the same settings, nothing changes.
    A config file with a ``dump_enable`` key is followed while the job runs (``msprobe_core.dump.dynamic``).

    ``config_path`` may also be a dict with the config.json content. ``wrap_list`` (an addition) names a
    support_wrap_ops.yaml to use instead of the shipped one.
    """

    _instance: Optional["PrecisionDebugger"] = None  # PyTorch's own: MindSpore's may live in the same process

    @staticmethod
    def _make_service(cfg: DumpConfig, wrap_list: Optional[str]) -> Any:
        from msprobe_core.pytorch.dump_service import DumpService

        return DumpService(cfg, wrap_list)


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
