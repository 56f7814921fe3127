"""The ``torch.save`` zip layout, written without torch (used by the tensor-file writer process).

An archive holds ``<root>/data.pkl`` (the pickle, made by the caller), the raw little-endian storage in
``<root>/data/0`` starting on a 64-byte boundary, and torch's small marker records. ``zipfile``'s CRC and
file writes release the GIL, so even a writer thread barely competes with training.
"""

from __future__ import annotations

import os
import struct
import uuid
import zipfile
from pathlib import Path
from typing import Union

ALIGN = 64
_DATE = (1980, 1, 1, 0, 0, 0)
Buffer = Union[bytes, bytearray, memoryview]


try:  # ISA-L's CRC-32: same values as zlib's, several times faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - optional dependency
    from zlib import crc32 as _crc32

_LOCAL = struct.Struct("<IHHHHHIIIHH")      # local file header (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header (46 bytes)
_END = struct.Struct("<IHHHHIIH")          # end of central directory (22 bytes)
_DOS_DATE = (0 << 9) | (1 << 5) | 1        # 1980-01-01
_MARKERS = ((".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little"))


def _entries(root: str, pickle_bytes: bytes, payload: Buffer) -> list[tuple[bytes, Buffer]]:
    return ([(f"{root}/data.pkl".encode(), pickle_bytes)]
            + [(f"{root}/{name}".encode(), value) for name, value in _MARKERS]
            + [(f"{root}/data/0".encode(), payload), (f"{root}/version".encode(), b"3\n"),
               (f"{root}/.data/serialization_id".encode(), uuid.uuid4().hex.encode().ljust(40, b"0"))])


def write_pt(path: Union[str, Path], pickle_bytes: bytes, payload: Buffer) -> None:
    """Write a torch.save-compatible archive to ``path`` (directly: callers rename for atomicity).

    The zip (stored entries, the storage 64-byte aligned) is assembled here rather than by ``zipfile``:
    a dump writes thousands of files a step and this is 3x cheaper; archives over 4 GiB use ``zipfile``.
    """
    root = Path(path).stem.replace(".", "_") or "archive"
    if len(payload) >= 0xFFFFFFFF:
        _write_pt_zip64(path, root, pickle_bytes, payload)
        return
    chunks: list = []
    central: list[bytes] = []
    offset = 0
    for name, data in _entries(root, pickle_bytes, payload):
        size, crc = len(data), _crc32(data) & 0xFFFFFFFF
        extra = b""
        if name.endswith(b"/data/0"):
            pad = (-(offset + _LOCAL.size + len(name) + 4)) % ALIGN
            extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
        header = _LOCAL.pack(0x04034B50, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra)) + name + extra
        central.append(_CENTRAL.pack(0x02014B50, 20, 20, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra),
                                     0, 0, 0, 0, offset) + name + extra)
        chunks += (header, data)
        offset += len(header) + size
    directory = b"".join(central)
    chunks.append(directory + _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = sum(len(c) for c in chunks)
        written = os.writev(fd, chunks)
        if written != total:  # a short write: finish the rest the slow way
            rest = b"".join(bytes(c) for c in chunks)[written:]
            while rest:
                rest = rest[os.write(fd, rest):]
    finally:
        os.close(fd)


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    offset = zf.fp.tell() + 30 + len(name.encode())
    pad = (-(offset + 4)) % ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    return info


def _write_pt_zip64(path: Union[str, Path], root: str, pickle_bytes: bytes, payload: Buffer) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in _entries(root, pickle_bytes, payload):
            name = name.decode()
            info = _aligned_info(zf, name) if name.endswith("/data/0") else zipfile.ZipInfo(name, date_time=_DATE)
            with zf.open(info, "w", force_zip64=len(data) > 0x7FFFFFFF) as f:
                f.write(data)


def write_pt_atomic(path: Union[str, Path], pickle_bytes: bytes, payload: Buffer) -> None:
    """``write_pt`` to a temporary name, then rename: a crash never leaves a half-written ``.pt``."""
    tmp = f"{path}.tmp"
    write_pt(tmp, pickle_bytes, payload)
    os.replace(tmp, path)


def link_or_copy(src: Union[str, Path], dst: Union[str, Path]) -> None:
    """``dst`` becomes a second name of ``src`` (a hard link, or a copy where links are impossible)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:
        import shutil
        shutil.copyfile(src, dst)
