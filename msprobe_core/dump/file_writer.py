"""The tensor-file writer process: ``python -m msprobe_core.dump.file_writer ARENA_PATH ARENA_BYTES``.

It never imports torch and never competes for the training process's GIL. The trainer copies each
tensor's bytes into a shared memory arena (a file in /dev/shm mapped by both processes) and sends a small
job over this process's stdin; the job is written as a ``.pt`` archive and acknowledged with one byte on
stdout ('.' done, '!' failed: the reason goes to stderr and to ``dump_error_info.log`` beside the file).
Jobs run in order, so a hard link always follows the file it names. If the trainer dies, the jobs
already sent are still written; the process ends when its stdin closes.

Frames: 4-byte little-endian length + ``marshal`` of a tuple:
``("w", path, pickle_bytes, offset, nbytes)`` write; ``("l", src, dst)`` link.
"""

from __future__ import annotations

import marshal
import mmap
import os
import struct
import sys
import time

from msprobe_core.dump.pt_archive import link_or_copy, write_pt_atomic

_LEN = struct.Struct("<I")


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return b""
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _log_failure(path: str, exc: BaseException) -> None:
    message = f"tensor file {path}: {exc!r}"
    print(f"[msprobe writer] {message}", file=sys.stderr, flush=True)
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(path)), "dump_error_info.log"), "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
    except OSError:
        pass


def serve(arena_path: str, arena_bytes: int, fd_in: int = 0, fd_out: int = 1) -> None:
    with open(arena_path, "r+b") as f:
        arena = mmap.mmap(f.fileno(), arena_bytes)
    os.write(fd_out, b"R")  # ready: the trainer may remove the arena's name now
    view = memoryview(arena)
    while True:
        head = _read_exact(fd_in, _LEN.size)
        if not head:
            break
        body = _read_exact(fd_in, _LEN.unpack(head)[0])
        if not body:
            break
        job = marshal.loads(body)
        ok = b"."
        try:
            if job[0] == "w":
                _, path, pkl, offset, nbytes = job
                write_pt_atomic(path, pkl, view[offset:offset + nbytes])
            elif job[0] == "l":
                link_or_copy(job[1], job[2])
        except Exception as exc:  # one bad file must not stop the others
            _log_failure(job[1] if len(job) > 1 else "?", exc)
            ok = b"!"
        os.write(fd_out, ok)
    view.release()
    arena.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
