"""Comparing two dumps end to end: pair rank folders, align records, judge rows, find the divergence.

``compare_dumps`` is the library entry point behind ``python -m msprobe_core compare``. It never prints;
``report`` turns its result into files and terminal text.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from msprobe_core.compare.align import align_records
from msprobe_core.compare.framework_map import FrameworkMapping, framework_views, load_mapping
from msprobe_core.compare.pairing import pair_dumps
from msprobe_core.compare.rows import Row, build_rows, compare_mode, record_distance
from msprobe_core.compare.thresholds import ERROR, PASS, UNMATCHED, WARNING, Thresholds, worst
from msprobe_core.dumpdir.layout import DumpUnit
from msprobe_core.dumpdir.rank_dump import RankDump, load_rank_dump
from msprobe_core.dumpdir.record_info import is_descendant, record_stack


@dataclass
class Divergence:
    """The first failing record of a pair, with what explains it."""

    target_record: str
    golden_record: Optional[str]
    verdict: str
    rows: list[Row]
    parent: Optional[str]
    stack: list[str]
    stack_note: str = ""

    @property
    def inputs_differ(self) -> bool:
        """True when the record's inputs already fail: they were made outside the dumped calls."""
        return any(r.verdict == self.verdict and r.path.startswith("input") for r in self.rows)


@dataclass
class PairResult:
    """The comparison of one target rank folder against one golden rank folder."""

    target_unit: DumpUnit
    golden_unit: DumpUnit
    target: RankDump
    golden: RankDump
    mode: str
    notes: list[str]
    merged: list[tuple[Optional[str], Optional[str]]]
    rows: list[Row]
    divergence: Optional[Divergence] = None
    first_warning: Optional[Divergence] = None
    outputs: list[Path] = field(default_factory=list)
    row_counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    unreadable: list[str] = field(default_factory=list)  # records (target name, else golden) it could not read

    @property
    def label(self) -> str:
        """``step0/rank0`` (the target side's names)."""
        return self.target_unit.label

    def record_verdicts(self) -> dict[int, str]:
        """Verdict of each aligned record pair by its position; unmatched records are ``unmatched``."""
        out: dict[int, str] = {}
        for row in self.rows:
            out[row.order] = row.verdict if row.verdict == UNMATCHED else worst(out.get(row.order, PASS), row.verdict)
        return out

    def counts(self) -> Counter:
        """Rows by verdict (kept after ``release``)."""
        return self.row_counts if not self.rows else Counter(row.verdict for row in self.rows)

    def release(self) -> None:
        """Drop the rows and the dumps' records (the summary, divergence and counts stay)."""
        self.row_counts = self.counts()
        self.rows = []
        self.target.data = {}
        self.golden.data = {}

    @property
    def only_target(self) -> list[str]:
        """Records only the target run holds, in its execution order."""
        return [t for t, g in self.merged if g is None and t is not None]

    @property
    def only_golden(self) -> list[str]:
        """Records only the golden run holds, in its execution order."""
        return [g for t, g in self.merged if t is None and g is not None]


@dataclass
class CompareResult:
    """Every pair compared, in step then rank order."""

    target: Path
    golden: Path
    thresholds: Thresholds
    pairs: list[PairResult]
    seconds: float = 0.0

    @property
    def divergence(self) -> Optional[tuple[PairResult, Divergence]]:
        """The first divergence of the first pair (in step, rank order) that has one."""
        for pair in self.pairs:
            if pair.divergence is not None:
                return pair, pair.divergence
        return None

    @property
    def has_errors(self) -> bool:
        """True when any row failed."""
        return any(pair.divergence is not None for pair in self.pairs)


def compare_dumps(target: str | Path, golden: str | Path, thresholds: Thresholds = Thresholds(),
                  workers: Optional[int] = None, progress: bool = False,
                  on_pair: Optional[Callable[[PairResult, int], None]] = None,
                  keep_rows: bool = True, api_mapping: Optional[str | Path] = None) -> CompareResult:
    """Compare the dump at ``target`` against the trusted one at ``golden``.

    Each may be a rank folder, a step folder or a whole dump path; their steps and ranks must match,
    and every rank folder is checked before any is compared. Pairs are compared one at a time;
    ``on_pair(pair, number of pairs)`` sees each as soon as it is done (to write its files), after which
    ``keep_rows=False`` releases its rows to bound memory on many-rank dumps. Raises
    ``DumpInputError`` for inputs that are not (finished, compatible) dumps, or missing tensor files.
    A MindSpore (or MSAdapter) dump compares with a PyTorch dump through the MindSpore-to-PyTorch
    mapping (``framework_map``), extended by the YAML file ``api_mapping``.
    """
    start = time.perf_counter()
    units = pair_dumps(Path(target), Path(golden))
    mapping = load_mapping(api_mapping) if api_mapping else None
    pairs: list[PairResult] = []
    for t_unit, g_unit in units:
        pair = compare_pair(t_unit, g_unit, thresholds, workers, progress, mapping)
        if on_pair is not None:
            on_pair(pair, len(units))
        if not keep_rows:
            pair.release()
        pairs.append(pair)
    return CompareResult(Path(target), Path(golden), thresholds, pairs, time.perf_counter() - start)


def compare_pair(t_unit: DumpUnit, g_unit: DumpUnit, thresholds: Thresholds = Thresholds(),
                 workers: Optional[int] = None, progress: bool = False,
                 mapping: Optional[FrameworkMapping] = None) -> PairResult:
    """Compare one target rank folder against one golden rank folder."""
    start = time.perf_counter()
    t_own, g_own = load_rank_dump(t_unit.path), load_rank_dump(g_unit.path)
    mode, notes = compare_mode(t_own, g_own)
    views = framework_views(t_own, g_own, mapping)  # two frameworks: records under aligned names
    t_dump, g_dump = (views.target, views.golden) if views else (t_own, g_own)
    merged = align_records(list(t_dump.data), list(g_dump.data), t_dump.construct, g_dump.construct,
                           distance=_distance(t_dump, g_dump))
    rows = build_rows(merged, t_dump, g_dump, mode, thresholds)
    pair = PairResult(t_unit, g_unit, t_dump, g_dump, mode, notes, merged, rows)
    pair.unreadable = [r.target_record or r.golden_record or "" for r in rows if r.unreadable]
    _run_tensor_jobs([row for row in rows if row.job is not None], thresholds, workers, progress)
    pair.divergence = find_divergence(pair, ERROR)
    pair.first_warning = find_divergence(pair, WARNING) if pair.divergence is None else None
    if views:
        views.restore(pair, t_own, g_own)
    pair.row_counts = pair.counts()
    pair.seconds = time.perf_counter() - start
    return pair


def _distance(target: RankDump, golden: RankDump):
    def distance(t_name: str, g_name: str) -> float:
        return record_distance(target.data[t_name], golden.data[g_name])
    return distance


def _run_tensor_jobs(rows: Sequence[Row], thresholds: Thresholds, workers: Optional[int], progress: bool) -> None:
    if not rows:
        return
    from msprobe_core.compare.tensors import run_jobs

    results = run_jobs([(r.job.target_file, r.job.golden_file) for r in rows], workers=workers,
                       progress=progress)
    for row, res in zip(rows, results):
        row.metrics.update({"Cosine": res.cosine, "RMSE": res.rmse, "MaxAbsErr": res.max_abs,
                            "MaxRelativeErr": res.max_rel, "One Thousandth Err Ratio": res.ratio_1e3,
                            "One Ten-Thousandth Err Ratio": res.ratio_1e4,
                            "Five Thousandths Err Ratio": res.ratio_5e3})  # for msprobe's columns
        if res.problem:
            row.judge(ERROR, [res.problem])
        if res.note:
            row.messages.append(res.note)
        if res.max_abs is not None:
            row.judge(*thresholds.tensor_verdict(res.cosine, res.max_abs, res.norm_rel))


def find_divergence(pair: PairResult, level: str = ERROR) -> Optional[Divergence]:
    """The first record in execution order whose verdict is ``level``, drilled down to its innermost part.

    A module starts before the calls inside it, so when a module fails and some of its descendants
    (construct.json) fail too, the first failing descendant is where the runs part; this repeats down
    the hierarchy.
    """
    verdicts = pair.record_verdicts()
    failing = [order for order in sorted(verdicts) if verdicts[order] == level]
    if not failing:
        return None
    construct = pair.target.construct
    chosen = failing[0]
    for order in failing[1:]:
        if is_descendant(pair.merged[order][0], pair.merged[chosen][0], construct):
            chosen = order
    t_name, g_name = pair.merged[chosen]
    stack, note = record_stack(pair.target, t_name)
    rows = [r for r in pair.rows if r.order == chosen and r.verdict == level]
    return Divergence(t_name, g_name, level, rows, construct.get(t_name), stack, note)
