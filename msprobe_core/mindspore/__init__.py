"""msprobe-compatible MindSpore API: ``PrecisionDebugger``, ``module_dump`` / ``module_dump_end`` and
``seed_all`` (``msprobe.mindspore``), for native MindSpore (PyNative) and for PyTorch code run on MindSpore
through MSAdapter's ``mindtorch`` (import torch before this package, as msprobe asks).

Importing this package patches nothing: APIs are wrapped only between ``start()`` and ``stop()``.
"""

from msprobe_core.errors import require

require("mindspore", "mindspore", "The MindSpore dump (msprobe_core.mindspore)")

from msprobe_core.mindspore.debugger import PrecisionDebugger, module_dump, module_dump_end  # noqa: E402
from msprobe_core.mindspore.seed import seed_all  # noqa: E402

__all__ = ["PrecisionDebugger", "module_dump", "module_dump_end", "seed_all"]
