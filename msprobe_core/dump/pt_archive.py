"""The ``torch.save`` zip layout, written without torch (used by the tensor-file writer process).

An archive holds ``<root>/data.pkl`` (the pickle, made by the caller), the raw little-endian storage in
``<root>/data/0`` starting on a 64-byte boundary, and torch's small marker records. ``zipfile``'s CRC and
file writes release the GIL, so even a writer thread barely competes with training.
"""

from __future__ import annotations

import os
import uuid
import zipfile
from pathlib import Path
from typing import Union

ALIGN = 64
_DATE = (1980, 1, 1, 0, 0, 0)
Buffer = Union[bytes, bytearray, memoryview]


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """A stored (uncompressed) entry whose data starts on a 64-byte boundary, as torch.save aligns it."""
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    offset = zf.fp.tell() + 30 + len(name.encode())
    pad = (-(offset + 4)) % ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad  # one extra field of filler bytes
    return info


def write_pt(path: Union[str, Path], pickle_bytes: bytes, payload: Buffer) -> None:
    """Write a torch.save-compatible archive to ``path`` (directly: callers rename for atomicity)."""
    root = Path(path).stem.replace(".", "_") or "archive"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo(f"{root}/data.pkl", date_time=_DATE), pickle_bytes)
        zf.writestr(zipfile.ZipInfo(f"{root}/.format_version", date_time=_DATE), "1")
        zf.writestr(zipfile.ZipInfo(f"{root}/.storage_alignment", date_time=_DATE), str(ALIGN))
        zf.writestr(zipfile.ZipInfo(f"{root}/byteorder", date_time=_DATE), "little")
        with zf.open(_aligned_info(zf, f"{root}/data/0"), "w", force_zip64=len(payload) > 0x7FFFFFFF) as f:
            f.write(payload)
        zf.writestr(zipfile.ZipInfo(f"{root}/version", date_time=_DATE), "3\n")
        zf.writestr(zipfile.ZipInfo(f"{root}/.data/serialization_id", date_time=_DATE), uuid.uuid4().hex.ljust(40, "0"))


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
