"""Aligning the records of two runs.

Records pair by name when both runs hold the same set of names. Otherwise one run made a call the other
did not (an extra ``Tensor.add``, say), which shifts every later call count of that API, so names stop
meaning the same thing. Then each record becomes a key of its name without the call count plus its
parent module's name without call count (construct.json), and the two key sequences are aligned with
Myers' diff (fast when the runs differ by a few calls; ``difflib`` past ``MAX_EDITS`` edits). Records the
diff cannot pair are reported as only on one side.

Names alone cannot say which of several identical neighbouring calls is the extra one (``relu, relu,
relu`` against ``relu, relu``). Given a ``distance`` between two records (from their statistics), each
gap is slid along such a run to where the records it pairs are most alike.
"""

from __future__ import annotations

import difflib
from typing import Callable, Mapping, Optional, Sequence

from msprobe_core.dumpdir.record_leaves import normalize_name

MAX_EDITS = 2000
Pair = tuple[Optional[str], Optional[str]]
Distance = Callable[[str, str], float]


def record_key(name: str, construct: Mapping[str, Optional[str]]) -> str:
    """The alignment key of a record: its normalized name and its parent's normalized name."""
    parent = construct.get(name)
    return f"{normalize_name(name)}<{normalize_name(parent) if parent else ''}"


def align_records(target: Sequence[str], golden: Sequence[str],
                  target_construct: Mapping[str, Optional[str]] | None = None,
                  golden_construct: Mapping[str, Optional[str]] | None = None,
                  distance: Optional[Distance] = None) -> list[Pair]:
    """Pairs ``(target name, golden name)`` in target execution order; ``None`` marks a missing side.

    Records only in golden appear where the alignment places them between target records.
    ``distance(target name, golden name)`` (0 = alike) places gaps inside runs of identical keys.
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
    if distance is not None:
        key_t = dict(zip(target, a))
        key_g = dict(zip(golden, b))
        _slide_gaps(out, key_t, key_g, distance)
        swapped = [(g, t) for t, g in out]
        _slide_gaps(swapped, key_g, key_t, lambda x, y: distance(y, x))
        out[:] = [(t, g) for g, t in swapped]
    return out


def _slide_gaps(merged: list[Pair], key_a: Mapping[str, int], key_b: Mapping[str, int],
                distance: Distance) -> None:
    """Move each run of first-side-only entries (in place) along the pairs around it whose keys allow
    it, to the position where the pairs formed are closest by ``distance``."""
    m = 0
    while m < len(merged):
        if merged[m][1] is not None or merged[m][0] is None:
            m += 1
            continue
        k = 0
        while m + k < len(merged) and merged[m + k][1] is None and merged[m + k][0] is not None:
            k += 1
        gap = [merged[m + x][0] for x in range(k)]

        def first_before(l: int) -> str:  # the first-side record k places after a_{-l}
            return gap[k - l] if l <= k else merged[m - (l - k)][0]

        def first_after(r: int) -> str:  # the r-th first-side record from the gap's start (0-based)
            return gap[r] if r < k else merged[m + r][0]

        left = 0
        while (m - left - 1 >= 0 and None not in merged[m - left - 1]
               and key_a[first_before(left + 1)] == key_b[merged[m - left - 1][1]]):
            left += 1
        right = 0
        while (m + k + right < len(merged) and None not in merged[m + k + right]
               and key_a[first_after(right)] == key_b[merged[m + k + right][1]]):
            right += 1
        if left or right:
            _place(merged, m - left, k, left, right, distance)
        m += k + right


def _place(merged: list[Pair], start: int, k: int, left: int, right: int, distance: Distance) -> None:
    window = merged[start:start + left + k + right]
    firsts = [a for a, _ in window]
    seconds = [b for _, b in window if b is not None]
    n = left + right
    before = [distance(firsts[i], seconds[i]) for i in range(n)]  # pairs left of the gap
    after = [distance(firsts[i + k], seconds[i]) for i in range(n)]  # pairs right of the gap
    best_p, best_cost = left, sum(before[:left]) + sum(after[left:])
    cost = sum(after)
    for p in range(n + 1):  # the gap covers firsts[p:p + k]
        if cost < best_cost - 1e-12:
            best_p, best_cost = p, cost
        if p < n:
            cost += before[p] - after[p]
    new = [(firsts[i], seconds[i]) for i in range(best_p)]
    new += [(firsts[best_p + x], None) for x in range(k)]
    new += [(firsts[i + k], seconds[i]) for i in range(best_p, n)]
    merged[start:start + len(window)] = new


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
