"""The ``torch.save`` zip layout, written without torch (used by the tensor-file writer process).

An archive holds ``<root>/data.pkl`` (the pickle, made by the caller), the raw little-endian storage in
``<root>/data/0`` starting on a 64-byte boundary, and torch's small marker records. ``zipfile``'s CRC and
file writes release the GIL, so even a writer thread barely competes with training.

``write_pt`` assembles an archive from a pickle and a buffer; ``write_pt_in_place`` writes one whose
storage already sits in a larger buffer (the writer process's arena), putting the headers around it and
writing the whole file from that memory, with O_DIRECT on local disk file systems.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import uuid
import zipfile
from pathlib import Path
from typing import Optional, Union

from msprobe_core.common.crc32 import crc32 as _crc32

ALIGN = 64
_DATE = (1980, 1, 1, 0, 0, 0)
Buffer = Union[bytes, bytearray, memoryview]



_LOCAL = struct.Struct("<IHHHHHIIIHH")      # local file header (30 bytes)
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header (46 bytes)
_END = struct.Struct("<IHHHHIIH")          # end of central directory (22 bytes)
_DOS_DATE = (0 << 9) | (1 << 5) | 1        # 1980-01-01
_MARKERS = ((".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little"))


def _entries(root: str, pickle_bytes: bytes) -> tuple[list[tuple[bytes, bytes]], bytes, list[tuple[bytes, bytes]]]:
    """The archive's records around the storage: (records before it, the storage's name, records after it)."""
    before = [(f"{root}/data.pkl".encode(), pickle_bytes)] + [(f"{root}/{name}".encode(), value) for name, value in _MARKERS]
    after = [(f"{root}/version".encode(), b"3\n"),
             (f"{root}/.data/serialization_id".encode(), uuid.uuid4().hex.encode().ljust(40, b"0"))]
    return before, f"{root}/data/0".encode(), after


def archive_root(path: Union[str, Path]) -> str:
    """The folder name torch.save gives an archive's records: the file name without suffix, dots as '_'."""
    name = os.path.basename(os.fspath(path))
    dot = name.rfind(".")
    stem = name[:dot] if 0 < dot < len(name) - 1 else name  # ``Path.stem``, without building a Path
    return stem.replace(".", "_") or "archive"


_crcs: dict[bytes, int] = {}


def _small_crc(data: bytes) -> int:
    """CRC-32 of a small record; pickles and markers repeat, so their values are kept."""
    crc = _crcs.get(data)
    if crc is None:
        crc = _crc32(data) & 0xFFFFFFFF
        if len(_crcs) < 10_000:
            _crcs[data] = crc
    return crc


def header_bytes_needed(name_len: int, pickle_len: int) -> int:
    """An upper bound of the bytes before the storage in an archive whose file name has ``name_len``
    characters (a 64-byte multiple: a valid ``data_offset`` for ``archive_parts``)."""
    return (224 + 5 * name_len + pickle_len + 4 + ALIGN - 1) // ALIGN * ALIGN


def trailer_bytes_needed(name_len: int) -> int:
    """An upper bound of the bytes after the storage (records, central directory, end record)."""
    return 768 + 9 * name_len + ALIGN


def archive_parts(root: str, pickle_bytes: bytes, size: int, crc: int,
                  data_offset: Optional[int] = None) -> tuple[bytes, bytes]:
    """The bytes of a torch.save archive before and after its storage (``size`` bytes, CRC-32 ``crc``).

    The storage starts at ``data_offset`` (a multiple of 64, at least what the headers need) or, by
    default, at the first 64-byte boundary after them; the gap is the zip extra field torch.save uses.
    """
    before, data_name, after = _entries(root, pickle_bytes)
    prefix: list[bytes] = []
    central: list[bytes] = []
    offset = 0

    def add(name: bytes, n: int, c: int, extra: bytes, into: list[bytes], data: Optional[bytes]) -> None:
        nonlocal offset
        header = _LOCAL.pack(0x04034B50, 20, 0, 0, 0, _DOS_DATE, c, n, n, len(name), len(extra)) + name + extra
        central.append(_CENTRAL.pack(0x02014B50, 20, 20, 0, 0, 0, _DOS_DATE, c, n, n, len(name), len(extra),
                                     0, 0, 0, 0, offset) + name + extra)
        into.append(header)
        if data is not None:
            into.append(data)
        offset += len(header) + n

    for name, data in before:
        add(name, len(data), _small_crc(data), b"", prefix, data)
    start = offset + _LOCAL.size + len(data_name) + 4
    pad = (-start) % ALIGN if data_offset is None else data_offset - start
    if pad < 0 or pad > 0xFFFF or (start + pad) % ALIGN:
        raise ValueError(f"data_offset {data_offset} cannot hold the archive's headers ({start} bytes)")
    add(data_name, size, crc, b"FB" + pad.to_bytes(2, "little") + b"Z" * pad, prefix, None)
    suffix: list[bytes] = []
    for name, data in after:
        add(name, len(data), _crc32(data) & 0xFFFFFFFF, b"", suffix, data)
    directory = b"".join(central)
    suffix.append(directory + _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0))
    return b"".join(prefix), b"".join(suffix)


def write_pt(path: Union[str, Path], pickle_bytes: bytes, payload: Buffer) -> None:
    """Write a torch.save-compatible archive to ``path`` (directly: callers rename for atomicity).

    The zip (stored entries, the storage 64-byte aligned) is assembled here rather than by ``zipfile``:
    a dump writes thousands of files a step and this is 3x cheaper; archives over 4 GiB use ``zipfile``.
    """
    root = archive_root(path)
    if len(payload) >= 0xFFFFFFFF:
        _write_pt_zip64(path, root, pickle_bytes, payload)
        return
    prefix, suffix = archive_parts(root, pickle_bytes, len(payload), _crc32(payload) & 0xFFFFFFFF)
    _write_all(path, [prefix, payload, suffix], 0)


def _write_all(path: Union[str, Path], chunks: list, flags: int, size: Optional[int] = None) -> None:
    """Write ``chunks`` to a new file ``path``; with ``size``, cut the file to that length afterwards."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        total = sum(len(c) for c in chunks)
        written = os.writev(fd, chunks)
        if written != total:  # a short write: finish the rest
            rest = memoryview(b"".join(bytes(c) for c in chunks))[written:]
            while rest:
                rest = rest[os.write(fd, rest):]
        if size is not None and size != total:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


_direct_ok = hasattr(os, "O_DIRECT")  # cleared the first time a file system refuses unbuffered writes
DIRECT_BLOCK = 4096  # O_DIRECT alignment of the buffer's address and of the written length
# Local block-device file systems, where O_DIRECT skips the page cache. On tmpfs, network and FUSE file
# systems it saves nothing (or costs: tmpfs copies through a slower path), so they get plain writes.
_DIRECT_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "bcachefs"})
_direct_dirs: dict[str, bool] = {}
_direct_devices: dict[int, bool] = {}


def file_system_type(path: Union[str, Path]) -> str:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo; "" where unknown)."""
    real = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "-" not in fields or len(fields) < 5:
                    continue
                mount = fields[4].encode().decode("unicode_escape")  # \040 for a space
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best:
                    best, kind = len(mount), fields[fields.index("-") + 1]
    except OSError:
        return ""
    return kind


def direct_io_helps(path: str) -> bool:
    """Whether files written to ``path``'s folder go straight to a local disk with O_DIRECT."""
    if not _direct_ok:
        return False
    folder = os.path.dirname(path)
    helps = _direct_dirs.get(folder)
    if helps is None:  # a new folder (one per step): its device is usually known already
        try:
            device = os.stat(folder).st_dev
        except OSError:
            device = None
        helps = _direct_devices.get(device) if device is not None else None
        if helps is None:
            helps = file_system_type(folder) in _DIRECT_FS
            if device is not None:
                _direct_devices[device] = helps
        _direct_dirs[folder] = helps
    return helps


def write_pt_in_place(path: Union[str, Path], pickle_bytes: bytes, buffer: memoryview, data_offset: int,
                      size: int) -> None:
    """Write an archive whose storage (``size`` bytes) already sits at ``buffer[data_offset:]``: its
    headers are put around it in ``buffer`` and the file is written from it in one piece, atomically.

    ``buffer`` must have room for ``trailer_bytes_needed`` after the storage. On a local disk file system,
    when the buffer starts on a 4096-byte boundary and has room up to the next one, the file is written
    with O_DIRECT (straight from this memory to the device: no page-cache copy, which on a busy machine
    costs more CPU than the training it competes with), then cut to its length; elsewhere, or where the
    file system refuses it, a plain write.
    """
    global _direct_ok
    payload = buffer[data_offset:data_offset + size]
    prefix, suffix = archive_parts(archive_root(path), pickle_bytes, size, _crc32(payload) & 0xFFFFFFFF, data_offset)
    end = data_offset + size + len(suffix)
    if len(prefix) != data_offset or end > len(buffer):
        raise ValueError(f"the archive of {path} does not fit its {len(buffer)}-byte buffer")
    buffer[:data_offset] = prefix
    buffer[data_offset + size:end] = suffix
    tmp = f"{path}.tmp"
    padded = (end + DIRECT_BLOCK - 1) // DIRECT_BLOCK * DIRECT_BLOCK
    with removed_on_failure(tmp):
        if _direct_ok and padded <= len(buffer) and _address(buffer) % DIRECT_BLOCK == 0 and direct_io_helps(tmp):
            try:
                _write_all(tmp, [buffer[:padded]], os.O_DIRECT, size=end)
                os.replace(tmp, path)
                return
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                _direct_ok = False  # this file system (or this alignment) does not take O_DIRECT
        _write_all(tmp, [buffer[:end]], 0)
        os.replace(tmp, path)


def _address(view: memoryview) -> int:
    """The memory address of a writable buffer."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    offset = zf.fp.tell() + 30 + len(name.encode())
    pad = (-(offset + 4)) % ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    return info


def _write_pt_zip64(path: Union[str, Path], root: str, pickle_bytes: bytes, payload: Buffer) -> None:
    before, data_name, after = _entries(root, pickle_bytes)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in before + [(data_name, payload)] + after:
            name = name.decode()
            info = _aligned_info(zf, name) if name.endswith("/data/0") else zipfile.ZipInfo(name, date_time=_DATE)
            with zf.open(info, "w", force_zip64=len(data) > 0x7FFFFFFF) as f:
                f.write(data)


def write_pt_atomic(path: Union[str, Path], pickle_bytes: bytes, payload: Buffer) -> None:
    """``write_pt`` to a temporary name, then rename: a crash never leaves a half-written ``.pt``."""
    tmp = f"{path}.tmp"
    with removed_on_failure(tmp):
        write_pt(tmp, pickle_bytes, payload)
        os.replace(tmp, path)


@contextlib.contextmanager
def removed_on_failure(tmp: Union[str, Path]):
    """``with removed_on_failure(tmp):`` a temporary file whose writing fails (a full disk) is removed:
    nothing torn is left beside the files that are complete."""
    try:
        yield
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def link_or_copy(src: Union[str, Path], dst: Union[str, Path]) -> None:
    """``dst`` becomes a second name of ``src`` (a hard link, or a copy where links are impossible)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:
        import shutil
        shutil.copyfile(src, dst)
