"""``PrecisionDebugger`` for MindSpore and MSAdapter (mindtorch): msprobe.mindspore's dump API.

The core's debugger (``msprobe_core.dump.debugger``: one per process, config loading and validation,
class-level calls from another file) with the MindSpore dump service behind it.
"""

from __future__ import annotations

from typing import Any, Optional

from msprobe_core.dump import debugger
from msprobe_core.dump.config import DumpConfig


class PrecisionDebugger(debugger.PrecisionDebugger):
    """msprobe.mindspore's dump entry point: ``PrecisionDebugger(config_path=None, task=None, dump_path=None,
    level=None, step=None)`` with ``start(model=None, token_range=None)``, ``stop()``, ``step()``.

    The config.json keys, their validation and errors are the PyTorch dump's.
    ``start(model)`` takes a ``mindspore.nn.Cell`` (or, under mindtorch, a ``torch.nn.Module``), or a
    list/tuple of them; L0 and mix need it, L1 records the primitives of its cells when given it. Records go
    to ``dump_path/step{N}/rank{R}|proc{pid}/`` (dump.json, stack.json, construct.json, and the ``.npy``
    files of task ``tensor`` under dump_tensor_data/), framework ``mindspore`` or ``mindtorch``.
    ``save(variable, name, save_backward=True)`` writes debug.json (at any level; level ``debug`` records
    nothing else, as msprobe's single-point save in PyNative mode); ``module_dump(cell, name)`` /
    ``module_dump_end()`` dump one cell alone, as in the PyTorch dump.
    """

    _instance: Optional["PrecisionDebugger"] = None  # not PyTorch's: both may live in one process

    @staticmethod
    def _make_service(cfg: DumpConfig, wrap_list: Optional[str]) -> Any:
        from msprobe_core.mindspore.dump_service import DumpService

        return DumpService(cfg, wrap_list)


module_dump = PrecisionDebugger.module_dump  # module-level, as msprobe's: the process's debugger at call time
module_dump_end = PrecisionDebugger.module_dump_end
