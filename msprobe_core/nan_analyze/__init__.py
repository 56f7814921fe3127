"""Where did NaN/Inf start? ``python -m msprobe_core nan_analyze -i DUMP_PATH [-o OUT] [--report]``.

From Python::

    from msprobe_core.nan_analyze import analyze
    result = analyze("dump_path")
    step, origin = result.first          # None when no rank holds NaN/Inf
    print(origin.describe(), origin.stack)

Modules: ``values`` (is a dumped tensor NaN/Inf: statistics, or its tensor file), ``comm`` (what each
``torch.distributed`` call sends and receives, and how calls pair across ranks), ``analyzer`` (the
replay of a step's ranks and the result), ``cli``. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["analyze", "NanAnalysis", "StepResult", "Origin", "Hop"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from msprobe_core.nan_analyze import analyzer
        return getattr(analyzer, name)
    raise AttributeError(name)
