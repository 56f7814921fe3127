"""Metrics from saved tensors, computed lazily and, for large dumps, in worker processes.

For two tensors of the same shape (after float16/bfloat16 -> float32, ints -> float64):

* Cosine: cosine similarity (1.0 when both are all zeros; undefined when only one is);
* RMSE: root mean square of the difference;
* MaxAbsErr: max ``|t - g|``;
* norm_rel (for the verdict): ``| ||t|| - ||g|| | / ||g||``;
* MaxRelativeErr: max ``|t - g| / |g|`` (a zero golden element gives inf unless both are 0);
* One Thousandth / One Ten-Thousandth Err Ratio: the share of elements whose relative error is at most
  1e-3 / 1e-4.

NaN and Inf must sit at the same positions with the same values; the metrics then cover the finite
elements. Bitwise-equal tensors skip the arithmetic.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from msprobe_core.dumpdir.tensor_reader import ArrayTensor, load_array
from msprobe_core.errors import DumpInputError

PARALLEL_MIN_BYTES = 64 << 20
"""Below this many bytes of tensor files, compare in this process (workers would cost more to start)."""


@dataclass(frozen=True)
class TensorResult:
    """The metrics of one tensor pair; ``problem`` is set for shape or NaN/Inf mismatches."""

    cosine: Optional[float] = None
    rmse: Optional[float] = None
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    ratio_1e3: Optional[float] = None
    ratio_1e4: Optional[float] = None
    norm_rel: Optional[float] = None
    problem: str = ""
    note: str = ""
    ratio_5e3: Optional[float] = None  # msprobe's Five Thousandths Err Ratio


IDENTICAL = TensorResult(1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, ratio_5e3=1.0)


class _Scratch:
    """Grow-only work buffers: fresh large arrays cost page faults on every tensor."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], np.ndarray] = {}

    def get(self, slot: int, n: int, dtype: np.dtype) -> np.ndarray:
        key = (slot, np.dtype(dtype).str)
        buf = self._buffers.get(key)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1 << 16), dtype=dtype)
            self._buffers[key] = buf
        return buf[:n]


_SCRATCH = _Scratch()


def _bitwise_equal(a: ArrayTensor, b: ArrayTensor) -> bool:
    if a.raw.dtype != b.raw.dtype or a.dtype != b.dtype:
        return False
    x, y = a.bits(), b.bits()
    head = min(x.size, 1024)
    if not np.array_equal(x[:head], y[:head]):
        return False
    return bool(np.array_equal(x, y))


def _finite_part(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    fa, fb = np.isfinite(a), np.isfinite(b)
    problem = ""
    if not np.array_equal(fa, fb):
        problem = "NaN/Inf at different positions"
    elif not np.array_equal(a[~fa], b[~fb], equal_nan=True):
        problem = "NaN/Inf values differ"
    both = fa & fb
    return a[both].astype(np.float64), b[both].astype(np.float64), problem


def compare_arrays(t: ArrayTensor, g: ArrayTensor) -> TensorResult:
    """The metrics of two loaded tensors (see the module docstring)."""
    if tuple(t.shape) != tuple(g.shape):
        return TensorResult(problem=f"shape {list(t.shape)} vs {list(g.shape)} in the tensor files")
    if t.raw.size == 0:
        return TensorResult(note="empty tensors")
    if _bitwise_equal(t, g):
        return IDENTICAL
    a, b = t.values(), g.values()
    if a.dtype != b.dtype:
        a, b = a.astype(np.float64), b.astype(np.float64)
    problem = ""
    with np.errstate(all="ignore"):
        na2, nb2 = float(np.dot(a, a)), float(np.dot(b, b))
        if not (math.isfinite(na2) and math.isfinite(nb2)):
            a, b, problem = _finite_part(a, b)
            if a.size == 0:
                return TensorResult(problem=problem, note="no finite elements")
            na2, nb2 = float(np.dot(a, a)), float(np.dot(b, b))
        return _metrics(a, b, na2, nb2, problem)


def _metrics(a: np.ndarray, b: np.ndarray, na2: float, nb2: float, problem: str) -> TensorResult:
    n = a.size
    d = np.subtract(a, b, out=_SCRATCH.get(0, n, a.dtype))
    np.abs(d, out=d)
    max_abs = float(d.max())
    nd2 = float(np.dot(d, d))
    na, nb = math.sqrt(na2), math.sqrt(nb2)
    if na == 0 and nb == 0:
        cosine: Optional[float] = 1.0
    elif na == 0 or nb == 0:
        cosine = None
    else:  # 1 - cos from the difference norm: accurate for nearly equal tensors
        cosine = min(1.0, max(-1.0, 1.0 - (nd2 - (na - nb) ** 2) / (2.0 * na * nb)))
    babs = np.abs(b, out=_SCRATCH.get(1, n, a.dtype))
    babs += np.finfo(a.dtype).tiny
    rel = np.divide(d, babs, out=d)
    max_rel = float(rel.max())
    mask = _SCRATCH.get(2, n, np.bool_)
    within_3 = int(np.count_nonzero(np.less_equal(rel, 1e-3, out=mask))) / n
    within_4 = int(np.count_nonzero(np.less_equal(rel, 1e-4, out=mask))) / n
    within_5e3 = int(np.count_nonzero(np.less_equal(rel, 5e-3, out=mask))) / n
    norm_rel = abs(na - nb) / nb if nb else (0.0 if na == 0 else math.inf)
    return TensorResult(cosine, math.sqrt(nd2 / n), max_abs, max_rel, within_3, within_4, norm_rel, problem,
                        ratio_5e3=within_5e3)


def compare_files(target_file: str, golden_file: str) -> TensorResult:
    """Load two tensor files and compare them."""
    return compare_arrays(load_array(target_file), load_array(golden_file))


def _run_batch(jobs: Sequence[tuple[int, str, str]]) -> list[tuple[int, TensorResult]]:
    return [(index, compare_files(t, g)) for index, t, g in jobs]


def _init_worker() -> None:
    if "torch" in sys.modules:  # inherited through fork: keep each worker on one thread
        sys.modules["torch"].set_num_threads(1)


def default_workers() -> int:
    """Worker processes for large dumps: the CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def file_stats(pairs: Iterable[tuple[str, str]]) -> list[tuple[int, tuple]]:
    """Per (target, golden) file pair: total bytes and an identity key (the two files' inodes);
    ``DumpInputError`` naming the first missing file."""
    out = []
    for t, g in pairs:
        total = 0
        key = []
        for path in (t, g):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise DumpInputError(f"{path}: missing tensor file (dump.json names it as a data_name)") from None
            total += st.st_size
            key.append((st.st_dev, st.st_ino) if st.st_ino else path)
        out.append((total, tuple(key)))
    return out


def _batches(indexed: list[tuple[int, str, str]], sizes: list[int], parts: int) -> list[list[tuple[int, str, str]]]:
    target = max(1, sum(sizes) // parts)
    out: list[list[tuple[int, str, str]]] = [[]]
    acc = 0
    for job, size in zip(indexed, sizes):
        if acc >= target and out[-1]:
            out.append([])
            acc = 0
        out[-1].append(job)
        acc += size
    return out


def run_jobs(pairs: Sequence[tuple[str, str]], workers: Optional[int] = None, progress: bool = False,
             parallel_min_bytes: int = PARALLEL_MIN_BYTES) -> list[TensorResult]:
    """Compare every (target file, golden file) pair; results in the same order.

    Every file is checked to exist first. Large sets run in ``workers`` processes (default: the usable
    CPUs, at most 8); ``progress`` shows a tqdm bar on stderr when tqdm is installed.
    """
    stats = file_stats(pairs)
    workers = default_workers() if workers is None else max(1, workers)
    # The dumper hard-links a tensor saved twice (an output that is the next call's input): compare
    # each distinct pair of files once.
    first_of: dict[tuple, int] = {}
    unique: list[tuple[int, str, str]] = []
    sizes: list[int] = []
    for i, ((t, g), (size, key)) in enumerate(zip(pairs, stats)):
        if key not in first_of:
            first_of[key] = i
            unique.append((i, t, g))
            sizes.append(size)
    results: list[Optional[TensorResult]] = [None] * len(pairs)
    bar = _progress_bar(len(unique), progress)
    try:
        if workers == 1 or sum(sizes) < parallel_min_bytes or len(unique) < 2 * workers:
            for index, t, g in unique:
                results[index] = compare_files(t, g)
                bar.update(1)
        else:
            context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
            batches = _batches(unique, sizes, workers * 8)
            with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker) as pool:
                futures = [pool.submit(_run_batch, batch) for batch in batches]
                for future in as_completed(futures):
                    done = future.result()
                    for index, result in done:
                        results[index] = result
                    bar.update(len(done))
    finally:
        bar.close()
    for i, (_, key) in enumerate(stats):
        if results[i] is None:
            results[i] = results[first_of[key]]
    return results  # type: ignore[return-value]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled or total == 0:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="tensor", desc="comparing tensors", file=sys.stderr, leave=False,
                dynamic_ncols=True)
