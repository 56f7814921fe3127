"""One record of a rank folder: its tensors, its stack, its parent chain, and the names nearest a missing one.

Shared by ``parse`` (prints it), ``nan_analyze`` (names where a NaN started), ``report`` (the detail
panel) and ``compare`` (the divergence). Nothing here imports torch.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Optional

from msprobe_core.dumpdir.rank_dump import RankDump
from msprobe_core.dumpdir.record_leaves import direction

MAX_DEPTH = 10_000


def parent_chain(name: str, construct: Mapping[str, Optional[str]]) -> list[str]:
    """The enclosing modules of ``name`` from construct.json, innermost first."""
    chain: list[str] = []
    parent = construct.get(name)
    while parent is not None and len(chain) < MAX_DEPTH and parent not in chain:
        chain.append(parent)
        parent = construct.get(parent)
    return chain


def is_descendant(name: str, ancestor: str, construct: Mapping[str, Optional[str]]) -> bool:
    """True when ``ancestor`` encloses ``name`` in construct.json's hierarchy."""
    return ancestor in parent_chain(name, construct)


def record_stack(dump: RankDump, name: str) -> tuple[list[str], str]:
    """``(frames, note)``: a record's stack from stack.json (innermost frame last).

    Backward records and parameter gradients have no stack of their own in msprobe's format; the stack of
    their forward call is returned with a note saying so.
    """
    stacks = dump.stack
    if name in stacks:
        return stacks[name], ""
    if direction(name) in ("backward", "parameters_grad"):
        forward = name.replace(".backward", ".forward").replace(".parameters_grad", ".forward")
        if forward in stacks:
            return stacks[forward], f"stack of {forward}"
    return [], ""


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
