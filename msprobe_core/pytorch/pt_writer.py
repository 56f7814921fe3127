"""Write one tensor as a ``torch.save``-compatible ``.pt`` file without holding the GIL for its bytes.

``torch.save`` copies and checksums the storage in C++ with the GIL held, so a writer thread running it
stalls the training thread (every small torch op then waits to get the GIL back). This writer produces
the same archive layout (``data.pkl`` calling ``torch._utils._rebuild_tensor_v2``, the raw little-endian
storage in ``data/0``, 64-byte aligned, ``version`` 3) through ``zipfile``, whose CRC and file writes
release the GIL. The files load with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import uuid
import zipfile
from pathlib import Path

import torch

_STORAGE_CLASS = {
    torch.float32: torch.FloatStorage, torch.float64: torch.DoubleStorage, torch.float16: torch.HalfStorage,
    torch.bfloat16: torch.BFloat16Storage, torch.int64: torch.LongStorage, torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage, torch.int8: torch.CharStorage, torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage, torch.complex64: torch.ComplexFloatStorage,
    torch.complex128: torch.ComplexDoubleStorage,
}
_ALIGN = 64


class _StorageRef:
    """Pickled as the persistent id torch.save writes for a tensor's storage."""

    def __init__(self, storage_class, numel: int):
        self.pid = ("storage", storage_class, "0", "cpu", numel)


class _TensorRecipe:
    """Pickles to the call ``torch.save`` records for a contiguous CPU tensor at offset 0."""

    def __init__(self, t: torch.Tensor, storage_class):
        self.args = (_StorageRef(storage_class, t.numel()), 0, tuple(t.shape), tuple(t.stride()), False,
                     collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if isinstance(obj, _StorageRef) else None


def can_write(t: torch.Tensor) -> bool:
    """Tensors this writer handles (dense, of a dtype with a legacy storage class); others use torch.save."""
    return t.layout == torch.strided and t.dtype in _STORAGE_CLASS and not t.is_quantized


def _aligned_info(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    """A stored (uncompressed) entry whose data starts on a 64-byte boundary, as torch.save aligns it."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    offset = zf.fp.tell() + 30 + len(name.encode())
    pad = (-(offset + 4)) % _ALIGN
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad  # an extra field of 'pad' filler bytes
    return info


def save_tensor(t: torch.Tensor, path: Path) -> None:
    """Write ``t`` (moved to the CPU and made contiguous if needed) to ``path`` in torch.save's format."""
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if not x.is_contiguous() or x.storage_offset() != 0 or x.untyped_storage().nbytes() != x.numel() * x.element_size():
        x = x.contiguous().clone()
    storage_class = _STORAGE_CLASS[x.dtype]
    payload = memoryview(x.reshape(-1).view(torch.uint8).numpy()) if x.numel() else memoryview(b"")
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_TensorRecipe(x, storage_class))
    root = path.stem.replace(".", "_") or "archive"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo(f"{root}/data.pkl", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())
        zf.writestr(f"{root}/.format_version", "1")
        zf.writestr(f"{root}/.storage_alignment", str(_ALIGN))
        zf.writestr(f"{root}/byteorder", "little")
        with zf.open(_aligned_info(zf, f"{root}/data/0"), "w", force_zip64=len(payload) > 0x7FFFFFFF) as f:
            f.write(payload)
        zf.writestr(f"{root}/version", "3\n")
        zf.writestr(f"{root}/.data/serialization_id", uuid.uuid4().hex[:20].ljust(40, "0"))


def write_file(t: torch.Tensor, path: Path) -> None:
    """Atomic write (temporary name, then rename) with this writer, or torch.save for exotic tensors."""
    tmp = path.with_name(path.name + ".tmp")
    if can_write(t):
        save_tensor(t, tmp)
    else:
        torch.save(t.detach().cpu(), tmp)
    os.replace(tmp, path)
