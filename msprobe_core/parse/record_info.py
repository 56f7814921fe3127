"""One record of a rank folder: its tensors, its stack, its parent chain, and the names nearest a missing one.

Shared by ``parse`` (prints it), ``nan_analyze`` (names where a NaN started) and ``report`` (the detail
panel). Nothing here imports torch.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Optional

from msprobe_core.compare.engine import record_stack

__all__ = ["parent_chain", "record_stack", "nearest_names", "tensor_file_summary"]

MAX_DEPTH = 10_000


def parent_chain(name: str, construct: Mapping[str, Optional[str]]) -> list[str]:
    """The enclosing modules of ``name`` from construct.json, innermost first."""
    chain: list[str] = []
    parent = construct.get(name)
    while parent is not None and len(chain) < MAX_DEPTH and parent not in chain:
        chain.append(parent)
        parent = construct.get(parent)
    return chain


def nearest_names(name: str, names: list[str], n: int = 5) -> list[str]:
    """The record names closest to ``name`` (difflib), best first; names containing it come first."""
    lowered = name.lower()
    containing = [x for x in names if lowered in x.lower()][:n]
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.4)
    out = list(dict.fromkeys(containing + close))
    return out[:n]


def tensor_file_summary(path: str) -> dict[str, Any]:
    """Statistics of a dumped tensor file: numel, Max, Min, Mean, Norm (NaN when it holds NaN), nan, inf."""
    import numpy as np

    from msprobe_core.dumpdir.tensor_reader import load_array

    tensor = load_array(path)
    values = tensor.values()
    out: dict[str, Any] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "numel": int(values.size)}
    if values.dtype.kind != "f" or values.size == 0:
        return {**out, "nan": 0, "inf": 0}
    x = values.astype(np.float64)
    return {**out, "Max": float(x.max()), "Min": float(x.min()), "Mean": float(x.mean()),
            "Norm": float(np.sqrt(np.dot(x, x))), "nan": int(np.isnan(x).sum()), "inf": int(np.isinf(x).sum())}
