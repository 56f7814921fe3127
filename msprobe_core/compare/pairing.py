"""Pairing the two dumps given to ``compare``: the rank folders to compare, target against golden.

Both paths must be the same kind of folder (rank, step or dump path, ``dumpdir.layout``) holding the same
steps and ranks (``proc{pid}`` folders, whose names never repeat between runs, pair by position); two dumps
that differ are a ``DumpInputError`` naming what is only in one of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from msprobe_core.dumpdir.layout import DumpUnit, check_finished, discover
from msprobe_core.errors import DumpInputError


def _pair_ranks(step: Optional[str], target: list[DumpUnit], golden: list[DumpUnit],
                t_path: Path, g_path: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    t_names = [u.rank for u in target]
    g_names = [u.rank for u in golden]
    where = f" in {step}" if step else ""
    # proc{pid} folders never share names between runs: pair them by position when counts agree.
    if all(n.startswith("proc") for n in t_names + g_names):
        if len(t_names) != len(g_names):
            raise DumpInputError(f"different number of process folders{where}: target {t_path} has "
                                 f"{len(t_names)} ({', '.join(t_names)}), golden {g_path} has {len(g_names)} "
                                 f"({', '.join(g_names)})")
        return list(zip(target, golden))
    if set(t_names) != set(g_names):
        raise DumpInputError(_set_difference("ranks" + where, t_names, g_names, t_path, g_path))
    by_name = {u.rank: u for u in golden}
    return [(u, by_name[u.rank]) for u in target]


def _set_difference(what: str, t_names: list[str], g_names: list[str], t_path: Path, g_path: Path) -> str:
    only_t = [n for n in t_names if n not in set(g_names)]
    only_g = [n for n in g_names if n not in set(t_names)]
    parts = [f"the two dumps have different {what}: target {t_path} has {', '.join(t_names) or 'none'}; "
             f"golden {g_path} has {', '.join(g_names) or 'none'}"]
    if only_t:
        parts.append(f"only in target: {', '.join(only_t)}")
    if only_g:
        parts.append(f"only in golden: {', '.join(only_g)}")
    return "; ".join(parts) + " (compare matching rank or step folders directly)"


def pair_dumps(target: Path, golden: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    """Every (target, golden) pair of rank folders to compare, in step then rank order.

    Every rank folder is checked for a dump.json before anything is compared.
    """
    pairs = _pair_units(Path(target), Path(golden))
    for t_unit, g_unit in pairs:
        check_finished(t_unit.path)
        check_finished(g_unit.path)
    return pairs


def _pair_units(target: Path, golden: Path) -> list[tuple[DumpUnit, DumpUnit]]:
    t_level, t_units = discover(Path(target))
    g_level, g_units = discover(Path(golden))
    if t_level != g_level:
        if len(t_units) == 1 and len(g_units) == 1:
            return [(t_units[0], g_units[0])]
        raise DumpInputError(f"cannot match a {t_level} folder ({target}, {len(t_units)} rank folder(s)) "
                             f"against a {g_level} folder ({golden}, {len(g_units)} rank folder(s)); "
                             "pass two folders of the same kind")
    if t_level == "rank":
        return [(t_units[0], g_units[0])]
    if t_level == "step":
        return _pair_ranks(None, t_units, g_units, Path(target), Path(golden))
    t_steps = list(dict.fromkeys(u.step for u in t_units))
    g_steps = list(dict.fromkeys(u.step for u in g_units))
    if set(t_steps) != set(g_steps):
        raise DumpInputError(_set_difference("steps", t_steps, g_steps, Path(target), Path(golden)))
    pairs = []
    for step in t_steps:
        pairs.extend(_pair_ranks(step, [u for u in t_units if u.step == step],
                                 [u for u in g_units if u.step == step], Path(target), Path(golden)))
    return pairs
