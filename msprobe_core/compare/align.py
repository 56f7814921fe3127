"""Aligning the records of two runs.

Records pair by name when both runs hold the same set of names. Otherwise one run made a call the other
did not (an extra ``Tensor.add``, say), which shifts every later call count of that API, so names stop
meaning the same thing. Then each record becomes a key of its name without the call count plus its
parent module's name without call count (construct.json), and the two key sequences are aligned with
Myers' diff (fast when the runs differ by a few calls; ``difflib`` past ``MAX_EDITS`` edits). Records the
diff cannot pair are reported as only on one side.
"""

from __future__ import annotations

import difflib
from typing import Mapping, Optional, Sequence

from msprobe_core.compare.records import normalize_name

MAX_EDITS = 2000
Pair = tuple[Optional[str], Optional[str]]


def record_key(name: str, construct: Mapping[str, Optional[str]]) -> str:
    """The alignment key of a record: its normalized name and its parent's normalized name."""
    parent = construct.get(name)
    return f"{normalize_name(name)}<{normalize_name(parent) if parent else ''}"


def align_records(target: Sequence[str], golden: Sequence[str],
                  target_construct: Mapping[str, Optional[str]] | None = None,
                  golden_construct: Mapping[str, Optional[str]] | None = None) -> list[Pair]:
    """Pairs ``(target name, golden name)`` in target execution order; ``None`` marks a missing side.

    Records only in golden appear where the alignment places them between target records.
    """
    if len(target) == len(golden) and set(target) == set(golden):
        return [(name, name) for name in target]
    tc = target_construct or {}
    gc = golden_construct or {}
    if not (tc and gc):  # parents on one side only would make every key differ
        tc = gc = {}
    ids: dict[str, int] = {}
    a = [ids.setdefault(record_key(n, tc), len(ids)) for n in target]
    b = [ids.setdefault(record_key(n, gc), len(ids)) for n in golden]
    ops = _myers(a, b, MAX_EDITS)
    if ops is None:
        ops = _difflib_ops(a, b)
    out: list[Pair] = []
    i = j = 0
    for op in ops:
        if op == "=":
            out.append((target[i], golden[j]))
            i += 1
            j += 1
        elif op == "-":
            out.append((target[i], None))
            i += 1
        else:
            out.append((None, golden[j]))
            j += 1
    return out


def _difflib_ops(a: Sequence[int], b: Sequence[int]) -> list[str]:
    ops: list[str] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            ops.extend("=" * (i2 - i1))
        else:
            ops.extend("-" * (i2 - i1))
            ops.extend("+" * (j2 - j1))
    return ops


def _myers(a: Sequence[int], b: Sequence[int], max_edits: int) -> Optional[list[str]]:
    """Shortest edit script as a list of '=', '-' (only in a), '+' (only in b); None past max_edits."""
    n, m = len(a), len(b)
    offset = max_edits + 1
    v = [0] * (2 * offset + 1)
    trace: list[list[int]] = []
    for d in range(min(max_edits, n + m) + 1):
        trace.append(v[offset - d - 1:offset + d + 2])
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]
            else:
                x = v[offset + k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            v[offset + k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m)
    return None


def _backtrack(trace: list[list[int]], n: int, m: int) -> list[str]:
    ops: list[str] = []
    x, y = n, m
    for d in range(len(trace) - 1, -1, -1):
        saved = trace[d]  # v before step d, covering diagonals -d-1 .. d+1

        def get(k: int) -> int:
            return saved[k + d + 1]

        k = x - y
        if d == 0:
            ops.extend("=" * x)
            break
        if k == -d or (k != d and get(k - 1) < get(k + 1)):
            prev_k = k + 1
        else:
            prev_k = k - 1
        prev_x = get(prev_k)
        prev_y = prev_x - prev_k
        while x > prev_x and y > prev_y:
            ops.append("=")
            x -= 1
            y -= 1
        ops.append("+" if prev_k == k + 1 else "-")
        x, y = prev_x, prev_y
    ops.reverse()
    return ops
