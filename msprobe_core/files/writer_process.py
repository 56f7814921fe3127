"""The tensor-file writer process: ``python -m msprobe_core.files.writer_process ARENA_PATH ARENA_BYTES RING_BYTES``.

It never imports a framework (nor NumPy) and never competes for the training process's GIL. The trainer
(``msprobe_core.dump.tensor_files``) copies each tensor's bytes into a shared memory arena (a file in
/dev/shm mapped by both processes) and appends a small job to a job ring in the same mapping; a job is
written as a ``.pt`` archive (PyTorch) or a ``.npy`` file (MindSpore's host arrays) and acknowledged with
one byte on stdout ('.' done, '!' failed: the reason goes to stderr and to ``dump_error_info.log`` beside
the file). Jobs run in order, so a hard link always follows the file it names.

Publishing a job costs the trainer no system call: it copies the frame into the ring and advances the
shared write position; only when this process has said it is idle (the ``idle`` word) does the trainer
write a wake-up byte to its stdin. A job in the ring is in shared memory, so if the trainer is killed,
this process still sees it: on end of stdin it writes every job published so far, then exits.

Mapping layout: ``[0, ARENA_BYTES)`` tensor bytes; then a 64-byte header (write position, read position,
idle word: little-endian uint64 each); then ``RING_BYTES`` of job frames at monotonically increasing
positions (taken modulo the ring size). Frame: 4-byte little-endian length + ``marshal`` of a tuple:
``("w", path, pickle_bytes, offset, nbytes)`` write the storage at ``offset``; ``("i", path, pickle_bytes,
slot, slot_bytes, data_offset, nbytes)`` write in place: the storage sits at ``slot + data_offset`` and the
archive is assembled around it in the slot and written from there in one piece (``pt_archive.
write_pt_in_place``: O_DIRECT for large tensors, so the file's bytes never pass through this process or
the page cache); ``("n", path, npy_header, offset, nbytes)`` write a ``.npy`` file: the header, then the
array's bytes at ``offset``; ``("l", src, dst)`` link.
"""

from __future__ import annotations

import collections
import marshal
import mmap
import os
import struct
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from msprobe_core.files.pt_archive import link_or_copy, removed_on_failure, write_pt_atomic, write_pt_in_place

_LEN = struct.Struct("<I")


def write_npy_atomic(path: str, header: bytes, payload) -> None:
    """A ``.npy`` file (``header`` as ``numpy.lib.format`` makes it, then the C-ordered bytes) written to a
    temporary name and renamed: a crash never leaves a torn file."""
    tmp = f"{path}.tmp"
    with removed_on_failure(tmp):
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)


def _log_failure(path: str, exc: BaseException) -> None:
    message = f"tensor file {path}: {exc!r}"
    print(f"[msprobe writer] {message}", file=sys.stderr, flush=True)
    try:
        log = os.path.join(os.path.dirname(os.path.dirname(path)), "dump_error_info.log")
        with open(log, "a", encoding="utf-8", errors="surrogateescape") as f:  # a path's undecodable bytes as they are
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    except OSError:
        pass


HEADER_BYTES = 64
U64 = struct.Struct("<Q")
WPOS, RPOS, IDLE = 0, 8, 16  # header fields


def ring_read(ring: memoryview, pos: int, n: int) -> bytes:
    """``n`` bytes at ring position ``pos`` (wrapping around the end)."""
    size = len(ring)
    at = pos % size
    if at + n <= size:
        return bytes(ring[at:at + n])
    return bytes(ring[at:]) + bytes(ring[:n - (size - at)])


def ring_write(ring: memoryview, pos: int, data: bytes) -> None:
    """Copy ``data`` to ring position ``pos`` (wrapping around the end)."""
    size = len(ring)
    at = pos % size
    first = min(len(data), size - at)
    ring[at:at + first] = data[:first]
    if first < len(data):
        ring[:len(data) - first] = data[first:]


def job_frame(job: tuple) -> bytes:
    """A job as the trainer publishes it in the ring (4-byte length + marshal; ``serve`` reads it back)."""
    body = marshal.dumps(job)
    return _LEN.pack(len(body)) + body


def run_job(job: tuple, view: memoryview) -> bytes:
    """Do one job (``view``: the whole mapping); b"." done, b"!" failed (the reason is logged)."""
    try:
        if job[0] == "w":
            _, path, pkl, offset, nbytes = job
            write_pt_atomic(path, pkl, view[offset:offset + nbytes])
        elif job[0] == "i":
            _, path, pkl, slot, slot_bytes, data_offset, nbytes = job
            write_pt_in_place(path, pkl, view[slot:slot + slot_bytes], data_offset, nbytes)
        elif job[0] == "n":
            _, path, header, offset, nbytes = job
            write_npy_atomic(path, header, view[offset:offset + nbytes])
        elif job[0] == "l":
            link_or_copy(job[1], job[2])
        return b"."
    except Exception as exc:  # one bad file must not stop the others
        _log_failure(job[1] if len(job) > 1 else "?", exc)
        return b"!"


# Files that go to a local disk with O_DIRECT are written by a few threads: one file's device I/O overlaps
# the next one's checksum and headers, and the device gets several requests at once. Everything else
# (page-cache writes, links) is done by the main thread at once: handing it to a thread costs more than
# doing it. Acknowledgements keep the order in which the trainer published the jobs.
_THREADS = 3
_IN_FLIGHT = 12


class _Jobs:
    """Jobs being done, acknowledged to the trainer in the order it published them."""

    def __init__(self, view: memoryview, fd_out: int):
        self.view = view
        self.fd_out = fd_out
        self.pool: Optional[ThreadPoolExecutor] = None
        self.pending: collections.deque = collections.deque()  # ack byte of a finished job, or (Future, path)
        self.by_path: dict[str, Future] = {}  # files being written by a thread

    def submit(self, job: tuple) -> None:
        if job[0] == "i":  # the trainer lays files out in place only for local disks (O_DIRECT)
            if self.pool is None:
                self.pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="msprobe-file")
            fut = self.pool.submit(run_job, job, self.view)
            self.by_path[job[1]] = fut
            self.pending.append((fut, job[1]))
            self.acknowledge(block=len(self.by_path) >= _IN_FLIGHT)
            return
        source = self.by_path.get(job[1]) if job[0] == "l" else None
        if source is not None and not source.done():  # link once the file exists, without waiting here
            linked: Future = Future()
            source.add_done_callback(lambda _, job=job, linked=linked: linked.set_result(run_job(job, self.view)))
            self.pending.append((linked, None))
            return
        self.pending.append(run_job(job, self.view))
        self.acknowledge(block=False)

    def acknowledge(self, block: bool) -> None:
        """Acknowledge the finished jobs at the front (waiting for the first one when ``block``)."""
        acks = []
        while self.pending:
            head = self.pending[0]
            if type(head) is tuple:
                fut, path = head
                if not fut.done() and not (block and not acks):
                    break
                if self.by_path.get(path) is fut:
                    del self.by_path[path]
                head = fut.result()
            acks.append(head)
            self.pending.popleft()
        if acks:
            try:
                os.write(self.fd_out, b"".join(acks))
            except BrokenPipeError:  # the trainer is gone: keep writing what it published
                pass

    def close(self) -> None:
        while self.pending:
            self.acknowledge(block=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def serve(arena_path: str, arena_bytes: int, ring_bytes: int, fd_in: int = 0, fd_out: int = 1) -> None:
    with open(arena_path, "r+b") as f:
        arena = mmap.mmap(f.fileno(), arena_bytes + HEADER_BYTES + ring_bytes)
    os.write(fd_out, b"R")  # ready: the trainer may remove the arena's name now
    view = memoryview(arena)
    header = view[arena_bytes:arena_bytes + HEADER_BYTES]
    ring = view[arena_bytes + HEADER_BYTES:]
    rpos = U64.unpack_from(header, RPOS)[0]
    jobs = _Jobs(view, fd_out)
    open_in = True
    while True:
        wpos = U64.unpack_from(header, WPOS)[0]
        if rpos < wpos:
            (size,) = _LEN.unpack(ring_read(ring, rpos, _LEN.size))
            jobs.submit(marshal.loads(ring_read(ring, rpos + _LEN.size, size)))
            rpos += _LEN.size + size
            U64.pack_into(header, RPOS, rpos)
            continue
        if jobs.pending:
            jobs.acknowledge(block=True)  # nothing new to start: finish the oldest
            continue
        if not open_in:
            break  # the trainer is gone and every published job is written
        U64.pack_into(header, IDLE, 1)
        if U64.unpack_from(header, WPOS)[0] > rpos:  # published while we were going idle
            U64.pack_into(header, IDLE, 0)
            continue
        open_in = bool(os.read(fd_in, 4096))  # wake-up bytes, or end of input
        U64.pack_into(header, IDLE, 0)
    jobs.close()
    for v in (ring, header, view):
        v.release()
    arena.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
