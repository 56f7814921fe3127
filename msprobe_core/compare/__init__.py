"""Compare two dumps and find the first record where the runs diverge.

``python -m msprobe_core compare -t TARGET -g GOLDEN -o OUT_DIR``; from Python::

    from msprobe_core.compare import compare_dumps, write_outputs
    result = compare_dumps("npu_dump", "gpu_dump")
    write_outputs(result, Path("out"))
    print(result.divergence)

Modules: ``pairing`` (the rank folders of the two dumps to compare), ``align`` (pairing the records of
two runs), ``rows`` (per-tensor judgement from dump.json), ``tensors`` (the metrics of tensor files),
``thresholds`` (the verdict rules, documented there), ``engine`` (the whole comparison), ``columns`` and
``msprobe_columns`` (the result table's two layouts), ``report`` (CSV, xlsx, summary), ``cli``. Dumps are
read with ``msprobe_core.dumpdir``. Nothing here imports torch unless a tensor file needs torch.load.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compare_dumps", "write_outputs", "summary_text", "Thresholds", "CompareResult"]


def __getattr__(name: str) -> Any:
    if name in ("compare_dumps", "CompareResult"):
        from msprobe_core.compare import engine
        return getattr(engine, name)
    if name in ("write_outputs", "summary_text"):
        from msprobe_core.compare import report
        return getattr(report, name)
    if name == "Thresholds":
        from msprobe_core.compare.thresholds import Thresholds
        return Thresholds
    raise AttributeError(name)
