"""Turn call arguments into dump.json structures.

A tensor becomes a summary dict (type, dtype, shape, Max, Min, Mean, Norm, requires_grad, plus
data_name / md5 when asked). Statistics are computed once per tensor *version* (an API's output is the
next API's input: one computation, and one file written, hard-linked under the second name), stay on the
tensor's device, and reach the host in one stacked copy per ``resolve()`` call; an accelerator's small float
tensors wait as snapshots (``snapshot_rows``: one launch each, their statistics a few launches for the lot).
Saved tensors are copied once on the training thread and written by ``TensorFiles`` (a writer process).
"""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Optional

import torch

from msprobe_core.dump import summarize as core
from msprobe_core.dump.summarize import NO_STATS_TEXT, SummarizerBase, fill, plain_value, stats_text
from msprobe_core.files.json_text import encode_string
from msprobe_core.pytorch import tensor_stats
from msprobe_core.pytorch.native_shards import is_dtensor
from msprobe_core.pytorch.odd_tensors import PLAIN_TYPES, QUANTIZED_DTYPES, known_shape, unsupported_reason
from msprobe_core.pytorch.pt_writer import TensorFiles
from msprobe_core.pytorch.snapshot_rows import SnapshotRows, takes
from msprobe_core.pytorch.tensor_crc import tensor_crc32
from msprobe_core.pytorch.tensor_stats import HOST_CODES, host_stats, row_summary, summary_kind, summary_stats
from msprobe_core.stats.kernel import KERNEL

_contiguous = torch.Tensor.contiguous
_strided = torch.strided
_bool = torch.bool
_to = torch.Tensor.to

_DTYPE_NAMES: dict[torch.dtype, str] = {}
CACHE_SIZE = 96
"""Tensor versions the summarizer remembers, the most recent first (an API's output is the next API's input:
its statistics are reused a record later). Bounded, so that its entries die young: entries kept step long
would be promoted to the garbage collector's oldest generation by the ten thousand and make its full
collections (which scan the whole heap) frequent. A version seen again after it fell out is summarized
again, to the same values."""
_SHAPES: dict[tuple, tuple] = {}  # one tuple per shape seen (4,096 at most)
_TEXT_DTYPES = frozenset(HOST_CODES) | {torch.float16}  # the kernel reads them (float16 through a float32 copy)
_PREFIXES: dict[tuple, str] = {}  # (dtype, shape) -> a summary's JSON text up to its statistics (4,096 at most)


def _prefix(dtype: torch.dtype, size: torch.Size) -> str:
    """``{"type": "torch.Tensor", "dtype": ..., "shape": [...], `` as JSON text, made once per dtype and shape."""
    key = (dtype, size)
    text = _PREFIXES.get(key)
    if text is None:
        if len(_PREFIXES) >= 4096:
            _PREFIXES.clear()
        text = _PREFIXES[key] = (f'{{"type": "torch.Tensor", "dtype": {encode_string(str(dtype))}, '
                                 f'"shape": [{", ".join(str(int(d)) for d in size)}], ')
    return text


def _shape(size: torch.Size) -> tuple:
    """``size`` as the one plain tuple of that shape (JSON writes it as a list). Shared, it is left untracked by
    the garbage collector after its first pass, and so are the summaries holding it (dicts of strings,
    numbers and untracked tuples): the records a step holds until its backward add nothing to collect."""
    shape = _SHAPES.get(size)
    if shape is None:
        if len(_SHAPES) >= 4096:
            _SHAPES.clear()
        shape = tuple(size)
        _SHAPES[shape] = shape
    return shape


_ProcessGroup = getattr(torch.distributed, "ProcessGroup", None) if torch.distributed.is_available() else None
_GROUPS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # group -> its description


class _PyEntry:
    """What is known about one tensor version: its statistics, CRC and first saved file (the kernel's
    ``Entry`` where it is built: the C record text reads and writes the same entries)."""

    __slots__ = ("ref", "version", "ptr", "stats", "crc", "file", "text")  # file: the path of its first saved file

    def __init__(self, ref, version, ptr):
        self.ref = ref
        self.version = version
        self.ptr = ptr
        self.stats = None
        self.crc = None
        self.file = None
        self.text = None  # its summary's JSON text up to ``"requires_grad": `` (``tensor_text``)


_Entry = getattr(KERNEL, "Entry", None) or _PyEntry


class _Waiting(list):
    """The statistics of a snapshot waiting in ``SnapshotRows``: ``[None]`` until ``resolve`` reads them, then
    ``[(max, min, sum, norm)]`` (kept as a version's statistics: its later records read them)."""

    __slots__ = ()


class Summarizer(SummarizerBase):
    """Summaries for one step (the core's ``SummarizerBase`` for torch tensors); ``reset()`` at step end
    drops the per-version cache. Call ``summarize`` under ``torch.no_grad()``."""

    tensor_types = (torch.Tensor,)
    device_norm_squared = False  # the device kernels give the norm itself

    def __init__(self, statistics: bool, md5: bool, files: Optional[TensorFiles] = None):
        super().__init__(statistics, md5, files)
        self._cache: dict[int, _Entry] = {}  # id(tensor) -> its latest version's entry (``CACHE_SIZE`` at most)
        self._saved: dict[int, _Entry] = {}  # the entries with a saved file, step long (hard links, not copies)
        self.combined: dict[int, tuple] = {}
        """id(tensor) -> ((Max, Min, Mean, Norm, shards), shape) of the full tensor a DTensor or an FSDP1 piece
        belongs to (``sharded_grads``), while the piece is recorded."""
        self._snapshots = SnapshotRows(row_summary, keep_float64=True)
        self.record_text = self._record_text()
        maker = getattr(KERNEL, "GradText", None)
        self.grad_text = maker(self.record_text) if maker is not None and self.record_text is not None else None
        """The kernel's ``GradText``: a gradient's text without a cache entry (``text(t, remember)``, None for
        what it does not read: ``tensor_text`` then says); None without the kernel or with checksums."""

    def _record_text(self) -> Any:
        """The kernel's ``RecordText`` over this summarizer's caches (``tensor_text`` in C for the tensors it
        reads, this class's ``text`` for anything else); None without the kernel or with checksums."""
        maker = getattr(KERNEL, "RecordText", None)
        if maker is None or self.md5 or not tensor_stats.fast_cpu_stats():
            return None
        return maker(self._cache, self._saved, self.combined, _PREFIXES, _prefix, self.text, encode_string,
                     dict(HOST_CODES), torch.Tensor, torch.nn.Parameter, torch._C.TensorBase, _bool, _strided,
                     torch.get_num_threads, self.statistics, CACHE_SIZE)

    def reset(self) -> None:
        self._cache.clear()
        self._saved.clear()
        if self.grad_text is not None:
            self.grad_text.clear()

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s memory was written without a version bump (c10d's in-place collectives): drop what is
        cached for every tensor in the same storage (views included), so later summaries read the new values."""
        self._cache.pop(id(t), None)
        self._saved.pop(id(t), None)
        try:
            storage = t.untyped_storage()
            lo = storage.data_ptr()
            hi = lo + storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # no plain storage: only ``t`` itself is known
            return
        if hi > lo:
            for cache in (self._cache, self._saved):
                for key in [k for k, e in cache.items() if lo <= e.ptr < hi]:
                    del cache[key]

    # ------------------------------------------------------------------ structures
    def describe(self, obj: Any) -> dict:
        return describe_value(obj)

    def tensor(self, t: torch.Tensor, file_base: Optional[str], save: bool) -> dict:
        dtype = t.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES[dtype] = str(dtype)
        if self.combined and id(t) in self.combined:
            return self._combined(t, name, *self.combined[id(t)])
        # a tensor the dump cannot read (odd_tensors): nothing reads its memory, the record says why
        if type(t) in PLAIN_TYPES and t.layout is _strided and dtype not in QUANTIZED_DTYPES and (t.is_cpu or t.is_cuda):
            try:
                shape = _shape(t.shape)
            except RuntimeError:  # a nested tensor has no shape
                return self._unsupported(t, name, unsupported_reason(t) or "tensor without a shape")
        else:
            if is_dtensor(t):
                return self._dtensor(t, file_base, save)
            reason = unsupported_reason(t)
            if reason is not None:
                return self._unsupported(t, name, reason)
            shape = list(t.shape)
        summary: dict[str, Any] = {"type": "torch.Tensor", "dtype": name, "shape": shape}
        entry = self._entry(t)
        kind = summary_kind(t)
        data = t  # what the statistics and the checksum read: one contiguous copy serves both
        if self.md5 and t.is_cpu and (entry is None or entry.crc is None) and not t.is_contiguous():
            data = _contiguous(t.detach())
        stats = entry.stats if entry is not None else None
        wants_stats = self.statistics and kind != "empty"
        data_name = None
        if save and file_base and self.tensor_dir is not None and self.files is not None:
            # a tensor copied for its file gets its statistics from that copy (one read of its memory)
            try:
                data_name, stats_of_copy = self._save(t, entry, file_base, wants_stats and stats is None and kind != "complex")
            except Exception as e:  # a tensor that cannot be copied (no kernels for it): no file, the record stays
                data_name = stats_of_copy = None
                summary["summary"] = f"unsupported: not saved ({type(e).__name__})"
            if stats_of_copy is not None:
                stats = stats_of_copy
                if entry is not None:
                    entry.stats = stats
        if wants_stats:
            if stats is None:
                if _waits(t, kind):
                    stats = _Waiting((None,))
                    self._snapshots.add(t, stats)
                else:
                    stats = _stats_of(t, data, kind, summary)
                if entry is not None:
                    entry.stats = stats
            if stats is None:
                summary.update(Max=None, Min=None, Mean=None, Norm=None)
            elif type(stats[0]) is float:  # host floats from the one-pass kernel: fill the summary now
                fill(summary, stats, kind, t.numel())
            else:
                summary.update(Max=None, Min=None, Mean=None, Norm=None)
                self._pending.append((summary, stats, kind, t.numel()))
        else:
            summary.update(Max=None, Min=None, Mean=None, Norm=None)
        summary["requires_grad"] = bool(t.requires_grad)
        if self.md5:
            if entry is not None and entry.crc is not None:
                summary["md5"] = entry.crc
            else:
                try:
                    self._checksum(t, data, entry, summary)
                except Exception as e:  # bytes torch cannot copy (a subclass without kernels)
                    summary["md5"] = None
                    summary["summary"] = f"unsupported: no checksum ({type(e).__name__})"
        if data_name is not None:
            summary["data_name"] = data_name
        return summary

    def tensor_text(self, t: torch.Tensor) -> Optional[str]:
        """The JSON text of ``tensor(t, None, False)`` for a dense CPU tensor the kernel reads, made once per
        tensor version (the next call's input is this call's output: a lookup); None for anything else
        (md5, another device, a subclass, a DTensor piece...), which takes ``tensor``."""
        fast = self.record_text
        if fast is not None:  # the kernel's text where it makes one (the same text, entries shared)
            text = fast.tensor(t)
            if text is not None:
                return text
        if self.combined and id(t) in self.combined:
            return None
        entry = self._cache.get(id(t))
        try:  # the usual case first: this version's text is made (only for tensors the checks below let in)
            if entry is not None and entry.text is not None and entry.version == t._version \
                    and entry.ptr == t.data_ptr() and entry.ref() is t:
                return entry.text + ("true}" if t.requires_grad else "false}")
        except RuntimeError:  # no version counter (an inference tensor), no storage (a wrapper subclass)
            return None
        if self.md5 or type(t) not in PLAIN_TYPES or t.layout is not _strided or not t.is_cpu \
                or t.dtype not in _TEXT_DTYPES:
            return None
        entry = self._entry(t)
        if entry is None:
            return None
        body = entry.text
        if body is None:
            body = self._text_body(t, entry)
            if body is None:
                return None
        return body + ("true}" if t.requires_grad else "false}")

    def _text_body(self, t: torch.Tensor, entry: "_Entry") -> Optional[str]:
        try:
            numel = t.numel()
            if not numel or not self.statistics:
                values = NO_STATS_TEXT
            else:
                stats = entry.stats
                if stats is None:
                    stats = host_stats(t)
                    if stats is None:  # a lazy negation, a zero tensor: torch's reductions (``tensor``)
                        return None
                    entry.stats = stats
                elif type(stats[0]) is not float:  # statistics on their way from the device
                    return None
                values = stats_text(stats, "bool" if t.dtype is _bool else "float", numel)
            body = entry.text = f'{_prefix(t.dtype, t.shape)}{values}, "requires_grad": '
        except Exception:  # anything odd (a nested tensor has no shape): ``tensor`` says what it is
            return None
        return body

    def _dtensor(self, t: torch.Tensor, file_base: Optional[str], save: bool) -> dict:
        """A DTensor (not combined from the shards, see ``_combined``): its local tensor's statistics, marked
        ``"local_shard"`` when the local tensor is only a piece (a replicated DTensor's is the full one)."""
        summary = self.tensor(t._local_tensor, file_base, save)
        summary["shape"] = list(t.shape)
        summary["requires_grad"] = bool(t.requires_grad)
        if not all(p.is_replicate() for p in t.placements):
            summary["local_shard"] = True
        return summary

    def _combined(self, t: torch.Tensor, dtype_name: str, full: tuple, shape: list) -> dict:
        """The record of a full tensor whose statistics were combined from every rank's piece."""
        summary: dict[str, Any] = {"type": "torch.Tensor", "dtype": dtype_name, "shape": list(shape),
                                   "Max": full[0], "Min": full[1], "Mean": full[2], "Norm": full[3],
                                   "requires_grad": bool(t.requires_grad), "combined_from_shards": full[4]}
        if self.md5:
            summary["md5"] = None
        return summary

    def _checksum(self, t: torch.Tensor, data: torch.Tensor, entry: Optional[_Entry], summary: dict) -> None:
        if t.is_cpu:
            crc = tensor_crc32(data)
            summary["md5"] = crc
            if entry is not None:
                entry.crc = crc
        else:  # copy now (no sync), checksum at resolve()
            summary["md5"] = None
            self._pending_crc.append((summary, _to(_contiguous(t.detach()), "cpu", non_blocking=True)))

    def _unsupported(self, t: torch.Tensor, dtype_name: str, reason: str) -> dict:
        """The record of a tensor the dump does not read (``odd_tensors``): what is known without reading it."""
        summary: dict[str, Any] = {"type": "torch.Tensor", "dtype": dtype_name, "shape": known_shape(t),
                                   "Max": None, "Min": None, "Mean": None, "Norm": None,
                                   "requires_grad": bool(t.requires_grad), "summary": f"unsupported: {reason}"}
        if self.md5:
            summary["md5"] = None
        return summary

    def share(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """``target`` holds exactly ``source``'s values (a view, reshape, transpose, ...): reuse its
        statistics and checksum-free summary instead of computing them again."""
        src = self._cache.get(id(source))
        if src is None or src.ref() is not source or src.stats is None:
            return
        entry = self._entry(target)
        if entry is not None and entry.stats is None:
            entry.stats = src.stats

    def _entry(self, t: torch.Tensor) -> Optional[_Entry]:
        try:
            version = t._version
            ptr = t.data_ptr()  # ``param.data = ...`` swaps the memory without a version bump
        except RuntimeError:  # inference tensors have no version counter, wrapper subclasses no storage
            return None
        key = id(t)
        entry = self._cache.get(key) or self._saved.get(key)
        if entry is not None and entry.ref() is t and entry.version == version and entry.ptr == ptr:
            return entry
        entry = _Entry(weakref.ref(t), version, ptr)
        cache = self._cache
        cache[key] = entry
        if len(cache) > CACHE_SIZE:
            self._evict()
        return entry

    def _evict(self) -> None:
        """Drop the oldest entry (one of a saved file stays in ``_saved``)."""
        cache = self._cache
        del cache[next(iter(cache))]

    def _save(self, t: torch.Tensor, entry: Optional[_Entry], file_base: str, want_stats: bool) -> tuple[str, Optional[tuple]]:
        """Hand the tensor to the file writer (a version already saved gets a hard link instead): its file
        name (``file_base.pt``, made safe: it never leaves the tensor folder), and its host statistics when
        ``want_stats`` and the writer computed them while copying."""
        assert self.files is not None
        name, path = self.file_path(file_base, ".pt")
        if entry is not None and entry.file is not None:
            self.files.link(entry.file, path)
            return name, None
        stats = self.files.save(t, path, want_stats)
        if entry is not None:
            entry.file = path
            self._saved[id(t)] = entry
        return name, stats

    # ------------------------------------------------------------------ host copy
    def _rows_to_host(self, pending: list) -> list:
        """One stacked transfer for all pending statistics (the snapshots': one per precision)."""
        self._read_snapshots()
        rest = [(summary, stats) for summary, stats, _, _ in pending if type(stats) is not _Waiting]
        try:
            values = _to_host([stats for _, stats in rest])
        except Exception:  # a tensor whose statistics cannot reach the host must not cost the others theirs
            values = [_one_to_host(summary, stats) for summary, stats in rest]
        others = iter(values)
        return [_snapshot_row(summary, stats) if type(stats) is _Waiting else next(others)
                for summary, stats, _, _ in pending]

    def _read_snapshots(self) -> None:
        """The waiting snapshots' statistics into their ``_Waiting`` cells: summarised, one copy per precision."""
        done = self._snapshots.done
        try:
            self._snapshots.summarise()
            by_dtype: dict[torch.dtype, tuple[list, list]] = {}
            for cells, block in done:
                group = by_dtype.setdefault(block.dtype, ([], []))
                group[0].extend(cells)
                group[1].append(block)
            for cells, blocks in by_dtype.values():
                for cell, row in zip(cells, torch.cat(blocks).tolist()):
                    cell[0] = row
        except Exception:  # their cells stay empty: those summaries say their statistics could not be read
            pass
        finally:
            done.clear()

    def _checksums(self, pending: list) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for summary, host in pending:
            summary["md5"] = tensor_crc32(host)


def _stats_of(t: torch.Tensor, data: torch.Tensor, kind: str, summary: dict) -> Optional[tuple]:
    """``t``'s statistics (host floats from the kernel, or device tensors); None, with the reason in
    ``summary["summary"]``, for a dtype torch cannot reduce (sub-byte integers, bit types)."""
    try:
        stats = host_stats(data) if kind != "complex" else None
        return stats if stats is not None else summary_stats(t, kind)
    except Exception as e:
        of = summary["dtype"] if type(t) in PLAIN_TYPES else f"a {type(t).__name__} of {summary['dtype']}"
        summary["summary"] = f"unsupported: no statistics for {of} ({type(e).__name__})"
        return None


def _to_host(groups: list[tuple]) -> list[list[float]]:
    """Host values of many tuples of 0-dim statistics: one stack and one copy per (device, dtype)."""
    by_kind: dict[tuple, list[int]] = {}
    for i, g in enumerate(groups):
        by_kind.setdefault((g[0].device, g[0].dtype), []).append(i)
    out: list[list[float]] = [[]] * len(groups)
    for idxs in by_kind.values():
        flat = [v for i in idxs for v in groups[i]]
        values = tensor_stats._stack(flat).tolist()
        pos = 0
        for i in idxs:
            n = len(groups[i])
            out[i] = values[pos:pos + n]
            pos += n
    return out


def _waits(t: torch.Tensor, kind: str) -> bool:
    """Do ``t``'s statistics wait as a snapshot (``snapshot_rows``): an accelerator's small float tensor?"""
    return kind == "float" and not t.is_cpu and takes(t)


def _snapshot_row(summary: dict, cell: _Waiting) -> Optional[list[float]]:
    """A snapshot's statistics once read; None, with the reason in the summary, where they could not be."""
    if cell[0] is None:
        summary["summary"] = "unsupported: statistics could not be read"
    return cell[0]


def _one_to_host(summary: dict, stats: tuple) -> Optional[list[float]]:
    """One summary's statistics on the host; None, with the reason in the summary, where they cannot be read."""
    try:
        return _to_host([stats])[0]
    except Exception as e:
        summary["summary"] = f"unsupported: statistics could not be read ({type(e).__name__})"
        return None


def describe_value(obj: Any) -> dict:
    """A non-tensor argument as msprobe writes it: {"type": ..., "value": ...} (``dump.summarize``'s, with
    torch's dtypes and devices)."""
    return core.describe_value(obj, _torch_value, _plain)


def _torch_value(obj: Any) -> Optional[dict]:
    if isinstance(obj, torch.dtype):
        return {"type": "torch.dtype", "value": str(obj)}
    if isinstance(obj, torch.device):
        return {"type": "torch.device", "value": str(obj)}
    if _ProcessGroup is not None and isinstance(obj, _ProcessGroup):
        return dict(_group_value(obj))
    return None


def _group_value(group: Any) -> dict:
    """A process group as msprobe writes it: ``{"type": "torch.ProcessGroup", "group_ranks": [...],
    "group_id": crc32 of the ranks}``, found once per group object (a lookup, no collective call)."""
    value = _GROUPS.get(group)
    if value is None:
        value = {"type": "torch.ProcessGroup"}
        try:
            ranks = [int(r) for r in torch.distributed.get_process_group_ranks(group)]
            value.update(group_ranks=ranks, group_id=f"{zlib.crc32(str(ranks).encode()):08x}")
        except Exception:  # a group torch no longer knows (destroyed): its type only
            value["value"] = None
        _GROUPS[group] = value
    return value


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return plain_value(v)


def tensors_in(obj: Any) -> list:
    """The torch tensors in ``obj`` (nested in lists, tuples and dicts), in order. A function, not a
    ``functools.partial``: torch 2.6's ``torch.compile`` tracer cannot call a partial held as a method."""
    return core.tensors_in(obj, torch.Tensor)
