"""Dumped tensors to ``.pt`` files (``torch.save``'s format) without slowing the training thread.

``TensorFiles`` copies each tensor once into a shared-memory arena and hands the job to a writer process
(``msprobe_core.files.writer_process``) that never touches the trainer's GIL: writer *threads* running
``torch.save`` hold the GIL while they copy and checksum, and every small torch op of the training
thread then waits for it. Where no arena can be made (no /dev/shm or temp space, no subprocess), a
thread pool does the same job with the GIL-friendly ``pt_archive`` writer. Files load with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import collections
import ctypes
import io
import logging
import mmap
import os
import pickle
import select
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Union

import torch

from msprobe_core.files.writer_process import HEADER_BYTES, IDLE, WPOS, U64, job_frame, ring_write, run_job
from msprobe_core.files.pt_archive import (ALIGN, DIRECT_BLOCK, direct_io_helps, header_bytes_needed, link_or_copy,
                                          removed_on_failure, trailer_bytes_needed, write_pt_atomic)
from msprobe_core.pytorch.tensor_stats import copy_host_stats, host_stats, raw_values
from msprobe_core.common.tool_guard import mark_tool_thread

logger = logging.getLogger("msprobe_core")

_STORAGE_CLASS = {
    torch.float32: torch.FloatStorage, torch.float64: torch.DoubleStorage, torch.float16: torch.HalfStorage,
    torch.bfloat16: torch.BFloat16Storage, torch.int64: torch.LongStorage, torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage, torch.int8: torch.CharStorage, torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage, torch.complex64: torch.ComplexFloatStorage,
    torch.complex128: torch.ComplexDoubleStorage,
}
PathLike = Union[str, Path]
ARENA_ENV = "MSPROBE_WRITER_ARENA_MB"
DEFAULT_ARENA_MB = 256
_RING_BYTES = 1 << 22  # shared job ring (jobs are a few hundred bytes)
# An idle writer is woken once this much work is waiting (jobs + 64 KiB units of tensor bytes, so ~4 MiB or
# 64 jobs), and always when the trainer waits for it: waking it for every job costs a context switch each
# on a busy machine. Published jobs are in shared memory: they are written even if the trainer dies.
_WAKE_AFTER = 64
_POLL_EVERY = 16  # acknowledgements are read every this many jobs, and whenever space or the ring runs out
_MEMMOVE_BELOW = 1 << 19  # contiguous CPU tensors below this size are copied by memcpy; larger ones by torch (threads)
# Tensors of at least this many bytes bound for a local disk are copied into an archive-shaped slot of the
# arena and written from there with O_DIRECT; smaller ones, and all on tmpfs or network file systems, get a
# plain write (the page cache is cheaper there than a device round trip).
IN_PLACE_MIN = 1 << 16
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------ the pickle
class _StorageRef:
    def __init__(self, storage_class, numel: int):
        self.pid = ("storage", storage_class, "0", "cpu", numel)


class _TensorRecipe:
    """Pickles to the call ``torch.save`` records for a contiguous CPU tensor at storage offset 0."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]):
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= max(size, 1)
        numel = 1
        for size in shape:
            numel *= size
        self.args = (_StorageRef(_STORAGE_CLASS[dtype], numel), 0, tuple(shape), tuple(reversed(strides)), False,
                     collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageRef) else None


_pickles: dict[tuple, bytes] = {}


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of a contiguous tensor of this dtype and shape, byte for byte as torch.save writes it
    (made once per dtype and shape: the same shapes recur every step)."""
    key = (dtype, tuple(shape))
    pkl = _pickles.get(key)
    if pkl is None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(_TensorRecipe(dtype, key[1]))
        pkl = buf.getvalue()
        if len(_pickles) < 100_000:
            _pickles[key] = pkl
    return pkl


def supported(t: torch.Tensor) -> bool:
    """Dense tensors of a dtype with a storage class; anything else is written by ``torch.save``."""
    return t.layout == torch.strided and t.dtype in _STORAGE_CLASS and not t.is_quantized


def write_file(t: torch.Tensor, path: PathLike) -> None:
    """Write ``t`` now (atomically) in torch.save's format."""
    x = t.detach()
    if not supported(x):
        tmp = f"{path}.tmp"
        with removed_on_failure(tmp):
            torch.save(x.cpu().clone(), tmp)
            os.replace(tmp, path)
        return
    x = x.cpu().contiguous()
    payload = memoryview(x.reshape(-1).view(torch.uint8).numpy()) if x.numel() else memoryview(b"")
    write_pt_atomic(path, tensor_pickle(x.dtype, tuple(x.shape)), payload)


# ------------------------------------------------------------------------------------------ backends
class _ThreadFiles:
    """Fallback: clone on the training thread, write on two toolkit threads."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msprobe-writer", initializer=mark_tool_thread)
        self._pending: dict[str, Future] = {}
        self.failures = 0

    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> None:
        snapshot = t.detach().clone(memory_format=torch.contiguous_format)
        self._pending[str(path)] = self._pool.submit(write_file, snapshot, path)

    def link(self, src: PathLike, dst: PathLike) -> None:
        first = self._pending.get(str(src))

        def job():
            if first is not None:
                first.result()
            link_or_copy(src, dst)

        self._pending[str(dst)] = self._pool.submit(job)

    def flush(self) -> int:
        failed = 0
        for fut in self._pending.values():
            try:
                fut.result()
            except Exception as e:
                failed += 1
                logger.warning("tensor file write failed: %r", e)
        self._pending.clear()
        self.failures += failed
        return failed

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


class _ProcessFiles:
    """A writer process fed through a shared-memory ring arena (jobs acknowledged in order)."""

    def __init__(self, arena_bytes: int, ring_bytes: int = _RING_BYTES):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        path = os.path.join(folder, f"msprobe-arena-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        total = arena_bytes + HEADER_BYTES + ring_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            self._mmap = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        try:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
            self.proc = subprocess.Popen([sys.executable, "-m", "msprobe_core.files.writer_process", path, str(arena_bytes),
                                          str(ring_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            ready = os.read(self.proc.stdout.fileno(), 1)
        finally:
            os.unlink(path)  # both sides hold the mapping; no name is left behind
        if ready != b"R":
            raise OSError("the tensor-file writer process did not start")
        self.size = arena_bytes
        self.arena = torch.frombuffer(self._mmap, dtype=torch.uint8, count=arena_bytes)
        self._base = self.arena.data_ptr()
        view = memoryview(self._mmap)
        self._header = view[arena_bytes:arena_bytes + HEADER_BYTES]
        self._ring = view[arena_bytes + HEADER_BYTES:]
        self._wpos = 0
        self._acked_pos = 0  # ring position up to which the writer has acknowledged jobs
        self._unwoken = 0  # work published since the writer was last woken (jobs + 64 KiB units)
        self._jobs: collections.deque = collections.deque()  # unacknowledged: (arena span or None, ring end, job)
        self._spans: collections.deque = collections.deque()  # the arena spans of the unacknowledged jobs, oldest first
        self._head = 0
        self._unpolled = 0  # jobs published since the acknowledgements were last read
        self._in = self.proc.stdin.fileno()
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self.failures = 0

    # ring allocation -------------------------------------------------------------------------
    def _alloc(self, n: int, align: int = ALIGN) -> tuple[int, int]:
        """Arena space for ``n`` bytes starting on an ``align`` boundary (waiting for the writer if the ring
        is full): (start, end)."""
        n = (n + ALIGN - 1) // ALIGN * ALIGN
        while True:
            if not self._spans:
                return self._take(0, n)
            tail = self._spans[0][0]  # the arena's tail: the oldest span still being written
            head = (self._head + align - 1) // align * align
            if self._head >= tail:
                if head + n <= self.size:
                    return self._take(head, n)
                if n <= tail:
                    return self._take(0, n)
            elif head + n <= tail:
                return self._take(head, n)
            self._acks(block=True)

    def _take(self, start: int, n: int) -> tuple[int, int]:
        self._head = start + n
        return start, start + n

    def _acks(self, block: bool) -> None:
        """Read the writer's acknowledgements (waiting for at least one when ``block``)."""
        self._unpolled = 0
        if block:
            self._wake()  # the writer may have gone idle just as the job it owes us was published
            select.select([self._out], [], [])
        try:
            data = os.read(self._out, 65536)
        except BlockingIOError:
            return
        if not data:
            raise BrokenPipeError("the tensor-file writer process ended")
        for b in data:
            span, self._acked_pos, _ = self._jobs.popleft()
            if span is not None:
                self._spans.popleft()
            if b == 33:  # "!"
                self.failures += 1

    def _wake(self) -> None:
        self._unwoken = 0
        try:
            os.write(self._in, b"w")
        except BlockingIOError:  # the pipe is full of wake-ups the writer has yet to read: it is awake
            pass

    def _send(self, job: tuple, span: Optional[tuple[int, int]]) -> None:
        """Publish a job in the shared ring: a copy and a position update, no system call unless the
        writer is idle and enough work is waiting. A published job is written even if this process is
        killed next (the writer drains the ring when its input closes)."""
        frame = job_frame(job)
        ring_size = len(self._ring)
        if len(frame) > ring_size:
            raise OSError(f"a tensor-file job of {len(frame)} bytes does not fit the {ring_size}-byte job ring")
        while self._wpos + len(frame) - self._acked_pos > ring_size:
            self._acks(block=True)
        ring_write(self._ring, self._wpos, frame)
        self._wpos += len(frame)
        U64.pack_into(self._header, WPOS, self._wpos)
        self._jobs.append((span, self._wpos, job))
        self._unwoken += 1
        if span is not None:
            self._spans.append(span)
            self._unwoken += (span[1] - span[0]) >> 16
        self._unpolled += 1
        if self._unwoken >= _WAKE_AFTER and U64.unpack_from(self._header, IDLE)[0]:
            try:
                self._wake()
            except BrokenPipeError:  # the writer died: the next poll fails over, and this job is not lost
                pass

    # interface ---------------------------------------------------------------------------------
    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> Optional[tuple[float, ...]]:
        n = t.numel() * t.element_size()
        if n == 0 or n > self.size // 2 or not supported(t):
            write_file(t, path)  # empty, huge or exotic: write it here, now
            return None
        if self._unpolled >= _POLL_EVERY:
            self._acks(block=False)
        path = os.fspath(path)
        pkl = tensor_pickle(t.dtype, tuple(t.shape))
        if n >= IN_PLACE_MIN and direct_io_helps(path):  # an archive-shaped slot, written with O_DIRECT
            name_len = len(path) - path.rfind(os.sep) - 1
            data_offset = header_bytes_needed(name_len, len(pkl))
            slot_bytes = (data_offset + n + trailer_bytes_needed(name_len) + DIRECT_BLOCK - 1) // DIRECT_BLOCK * DIRECT_BLOCK
            span = self._alloc(slot_bytes, DIRECT_BLOCK)
            off = span[0] + data_offset
            job: tuple = ("i", path, pkl, span[0], slot_bytes, data_offset, n)
        else:
            span = self._alloc(n)
            off = span[0]
            job = ("w", path, pkl, off, n)
        stats = copy_host_stats(self._base + off, t) if want_stats else None
        if stats is None:
            if n < _MEMMOVE_BELOW and raw_values(t):
                ctypes.memmove(self._base + off, t.data_ptr(), n)  # a torch copy costs more than a small memcpy
            else:
                copy = self.arena[off:off + n].view(t.dtype).view(t.shape)
                copy.copy_(t.detach())
                if want_stats:  # from the contiguous copy (a strided tensor would need one of its own)
                    stats = host_stats(copy)
        self._send(job, span)
        return stats

    def link(self, src: PathLike, dst: PathLike) -> None:
        self._send(("l", os.fspath(src), os.fspath(dst)), None)

    def flush(self) -> int:
        before = self.failures
        while self._jobs:
            self._acks(block=True)
        return self.failures - before

    def write_unacknowledged(self) -> int:
        """After the writer process died: write every job it did not acknowledge from this process (its
        bytes are still in the arena), in order; returns how many failed."""
        view = memoryview(self._mmap)
        failed = 0
        try:
            for _, _, job in self._jobs:
                if job[0] == "l" and os.path.lexists(job[2]):
                    continue  # linked before the writer died
                failed += run_job(job, view) != b"."
        finally:
            view.release()
        self._jobs.clear()
        self._spans.clear()
        return failed

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._end_writer()
            self._unmap()

    def close_after_failure(self) -> int:
        """The writer failed us. If it lives, it writes everything it was given and exits (its input is
        closed); if it died (or hangs: it is killed), the jobs it did not acknowledge are written here.
        Returns how many files failed."""
        failed = 0 if self._end_writer() else self.write_unacknowledged()
        self._unmap()
        return failed

    def _end_writer(self) -> bool:
        """Close the writer's input and wait for it; True when it exited normally (everything written)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode == 0

    def _unmap(self) -> None:
        del self.arena
        self._ring.release()
        self._header.release()
        self._mmap.close()


class TensorFiles:
    """Where the dump's tensors go: ``save(t, path)``, ``link(src, dst)``, ``flush()`` (all written),
    ``close()``. Starts its writer process on first use; falls back to threads if it cannot."""

    def __init__(self):
        self._backend = None
        self._unreported = 0  # files that failed while failing over, not yet returned by flush()

    def _get(self):
        if self._backend is None:
            try:
                mb = int(os.environ.get(ARENA_ENV, DEFAULT_ARENA_MB))
                self._backend = _ProcessFiles(mb << 20) if mb > 0 else _ThreadFiles()
            except (OSError, ValueError) as e:
                logger.warning("tensor files: no writer process (%s); writing from threads", e)
                self._backend = _ThreadFiles()
        return self._backend

    @property
    def writer(self) -> Optional[subprocess.Popen]:
        """The writer process while files go through one; None while they are written from threads (or
        before the first file)."""
        return self._backend.proc if isinstance(self._backend, _ProcessFiles) else None

    def save(self, t: torch.Tensor, path: PathLike, want_stats: bool = False) -> Optional[tuple[float, ...]]:
        """Write ``t`` to ``path`` (in the background). With ``want_stats``, may also return its
        ``tensor_stats.host_stats`` computed while copying it (``None``: compute them yourself)."""
        return self._run("save", t, path, want_stats)

    def link(self, src: PathLike, dst: PathLike) -> None:
        self._run("link", src, dst)

    def _run(self, method: str, *args):
        try:
            return getattr(self._get(), method)(*args)
        except (BrokenPipeError, OSError) as e:
            self._fail_over(e)
            return getattr(self._backend, method)(*args)

    def _fail_over(self, exc: BaseException) -> None:
        logger.warning("tensor files: writer process failed (%r); writing from threads", exc)
        old, self._backend = self._backend, _ThreadFiles()
        if isinstance(old, _ProcessFiles):  # nothing it was given is lost
            self._unreported += old.close_after_failure()

    def flush(self) -> int:
        """Wait until every file handed over is written; returns how many failed."""
        if self._backend is None:
            return 0
        try:
            failed = self._backend.flush()
        except (BrokenPipeError, OSError) as e:
            self._fail_over(e)
            failed = self._backend.flush()
        failed, self._unreported = failed + self._unreported, 0
        return failed

    def close(self) -> None:
        if self._backend is not None:
            try:
                self.flush()  # a writer that died now still has its files written (flush fails over)
                self._backend.close()
            except Exception as e:  # pragma: no cover - best effort at exit
                logger.warning("tensor files: closing the writer failed: %r", e)
            self._backend = None
