"""Dumped tensors' files without slowing the training thread, for any framework.

``ProcessWriter`` copies each tensor's bytes once into a shared-memory arena and hands the job to the
writer process (``msprobe_core.files.writer_process``), which never touches the trainer's GIL; where no
arena can be made (no /dev/shm or temp space, no subprocess), ``ThreadWriter`` does the same job from two
toolkit threads. ``TensorFiles`` picks one on first use and fails over to threads, losing nothing, if the
process fails. NumPy arrays (host data: the MindSpore dump's tensors) are written as ``.npy`` files here;
a framework adds its own format by subclassing (``msprobe_core.pytorch.pt_writer``: ``.pt`` files).
"""

from __future__ import annotations

import collections
import io
import logging
import mmap
import os
import select
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from msprobe_core.common.tool_guard import mark_tool_thread
from msprobe_core.files.pt_archive import ALIGN, link_or_copy
from msprobe_core.files.writer_process import (HEADER_BYTES, IDLE, U64, WPOS, job_frame, ring_write, run_job,
                                               write_npy_atomic)

logger = logging.getLogger("msprobe_core")

PathLike = Union[str, Path]
ARENA_ENV = "MSPROBE_WRITER_ARENA_MB"
DEFAULT_ARENA_MB = 256
RING_BYTES = 1 << 22  # shared job ring (jobs are a few hundred bytes)
# An idle writer is woken once this much work is waiting (jobs + 64 KiB units of tensor bytes, so ~4 MiB or
# 64 jobs), and always when the trainer waits for it: waking it for every job costs a context switch each
# on a busy machine. Published jobs are in shared memory: they are written even if the trainer dies.
_WAKE_AFTER = 64
_POLL_EVERY = 16  # acknowledgements are read every this many jobs, and whenever space or the ring runs out
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_npy_headers: dict[tuple, bytes] = {}


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header of a C-ordered array of this dtype and shape, byte for byte as ``np.save`` writes
    it (made once per dtype and shape: the same shapes recur every step)."""
    key = (dtype, shape)
    header = _npy_headers.get(key)
    if header is None:
        buf = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buf, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
        header = buf.getvalue()
        if len(_npy_headers) < 100_000:
            _npy_headers[key] = header
    return header


def npy_ready(a: np.ndarray) -> np.ndarray:
    """``a`` as the dump writes it: bfloat16 (ml_dtypes', which NumPy cannot read back) as float32."""
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def write_npy(a: np.ndarray, path: PathLike) -> None:
    """Write ``a`` to ``path`` now (atomically) as ``np.save`` would (bfloat16 as float32)."""
    a = np.ascontiguousarray(npy_ready(a)) if a.ndim else npy_ready(a).copy()
    write_npy_atomic(os.fspath(path), npy_header(a.dtype, a.shape), _bytes_of(a))


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


# ------------------------------------------------------------------------------------------ backends
class ThreadWriter:
    """Fallback: copy on the training thread, write on two toolkit threads."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="msprobe-writer", initializer=mark_tool_thread)
        self._pending: dict[str, Future] = {}
        self.failures = 0

    def submit(self, path: PathLike, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)``, which writes ``path``, on a writer thread."""
        self._pending[str(path)] = self._pool.submit(fn, *args)

    def save_array(self, a: np.ndarray, path: PathLike) -> None:
        self.submit(path, write_npy, np.array(npy_ready(a), copy=True), path)

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


class ProcessWriter:
    """A writer process fed through a shared-memory ring arena (jobs acknowledged in order)."""

    def __init__(self, arena_bytes: int, ring_bytes: int = RING_BYTES):
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
        self.bytes = np.frombuffer(self._mmap, dtype=np.uint8, count=arena_bytes)  # the arena, writable
        self._base = self.bytes.ctypes.data
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

    def _poll(self) -> None:
        """Read the acknowledgements every few jobs (before a new job takes arena space)."""
        if self._unpolled >= _POLL_EVERY:
            self._acks(block=False)

    # interface ---------------------------------------------------------------------------------
    def save_array(self, a: np.ndarray, path: PathLike) -> None:
        """Copy ``a`` into the arena and have the writer write it as a ``.npy`` file."""
        a = npy_ready(a)
        n = a.nbytes
        if n == 0 or n > self.size // 2:
            write_npy(a, path)  # empty or huge: write it here, now
            return
        self._poll()
        span = self._alloc(n)
        np.copyto(self.bytes[span[0]:span[0] + n].view(a.dtype).reshape(a.shape), a)  # strided views too
        self._send(("n", os.fspath(path), npy_header(a.dtype, a.shape), span[0], n), span)

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
        """Drop every view of the arena, then the mapping (a subclass drops its own views first)."""
        del self.bytes
        self._ring.release()
        self._header.release()
        self._mmap.close()


class TensorFiles:
    """Where the dump's tensors go: ``save_array(a, path)`` (a subclass adds its framework's format),
    ``link(src, dst)``, ``flush()`` (all written), ``close()``. Starts its writer process on first use;
    falls back to threads if it cannot."""

    process_backend: type = ProcessWriter
    thread_backend: type = ThreadWriter

    def __init__(self):
        self._backend = None
        self._unreported = 0  # files that failed while failing over, not yet returned by flush()

    def _get(self):
        if self._backend is None:
            try:
                mb = int(os.environ.get(ARENA_ENV, DEFAULT_ARENA_MB))
                self._backend = self.process_backend(mb << 20) if mb > 0 else self.thread_backend()
            except (OSError, ValueError) as e:
                logger.warning("tensor files: no writer process (%s); writing from threads", e)
                self._backend = self.thread_backend()
        return self._backend

    @property
    def writer(self) -> Optional[subprocess.Popen]:
        """The writer process while files go through one; None while they are written from threads (or
        before the first file)."""
        return self._backend.proc if isinstance(self._backend, ProcessWriter) else None

    def save_array(self, a: np.ndarray, path: PathLike) -> None:
        """Write the host array ``a`` to ``path`` as a ``.npy`` file (in the background; bfloat16 as
        float32). ``a`` may be a view of memory that changes once this returns: it is copied now."""
        self._run("save_array", a, path)

    def link(self, src: PathLike, dst: PathLike) -> None:
        """``dst`` becomes a second name of the file ``src`` (once it is written)."""
        self._run("link", src, dst)

    def _run(self, method: str, *args):
        try:
            return getattr(self._get(), method)(*args)
        except (BrokenPipeError, OSError) as e:
            self._fail_over(e)
            return getattr(self._backend, method)(*args)

    def _fail_over(self, exc: BaseException) -> None:
        logger.warning("tensor files: writer process failed (%r); writing from threads", exc)
        old, self._backend = self._backend, self.thread_backend()
        if isinstance(old, ProcessWriter):  # nothing it was given is lost
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
