"""``dump_steps``: the dump tests' training loop, a model's forward (and backward) between ``start()`` and
``stop()``/``step()`` of a fresh ``PrecisionDebugger``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from msprobe_core.pytorch import PrecisionDebugger


def dump_steps(dump_path: Path, model: torch.nn.Module, conf: Mapping[str, Any], x: torch.Tensor, steps: int = 1,
               backward: bool = True) -> Path:
    """Run ``model(x)`` (and ``.sum().backward()`` with ``backward``) for ``steps`` dump steps with the config
    ``conf`` into ``dump_path``; the rank folder of step 0 (this process's, outside a process group)."""
    dbg = PrecisionDebugger(dict({"dump_path": str(dump_path)}, **conf))
    for _ in range(steps):
        dbg.start(model)
        y = model(x)
        if backward:
            y.sum().backward()
        dbg.stop()
        dbg.step()
    return dump_path / "step0" / f"proc{os.getpid()}"
