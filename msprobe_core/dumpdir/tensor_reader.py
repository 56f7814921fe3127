"""Reading dumped tensor files as numpy arrays, without importing torch when possible.

The dumper writes each tensor with ``torch.save``: a zip archive holding ``data.pkl`` (a pickle that
calls ``torch._utils._rebuild_tensor_v2`` on a storage) and the raw storage bytes, stored uncompressed.
``load_array`` maps those bytes into numpy (zero-copy through ``mmap``) with a pickle reader that accepts
nothing but plain tensors; any other content (parameters, legacy or big-endian files...) goes through
``torch.load(weights_only=True)``. ``.npy`` files load with numpy. Importing torch costs about a second,
which is most of the time a small compare takes.
"""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from msprobe_core.errors import DumpInputError

# torch storage class -> (dtype name, numpy dtype of the raw elements)
_STORAGES = {
    "DoubleStorage": ("float64", np.float64), "FloatStorage": ("float32", np.float32),
    "HalfStorage": ("float16", np.float16), "BFloat16Storage": ("bfloat16", np.uint16),
    "LongStorage": ("int64", np.int64), "IntStorage": ("int32", np.int32),
    "ShortStorage": ("int16", np.int16), "CharStorage": ("int8", np.int8),
    "ByteStorage": ("uint8", np.uint8), "BoolStorage": ("bool", np.bool_),
    "ComplexFloatStorage": ("complex64", np.complex64), "ComplexDoubleStorage": ("complex128", np.complex128),
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")


@dataclass
class ArrayTensor:
    """A loaded tensor: its elements in logical (C) order as a 1-D array of the raw element type.

    ``dtype`` is torch's name without the ``torch.`` prefix; bfloat16 elements are held as uint16.
    """

    raw: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    def values(self) -> np.ndarray:
        """The elements as float32/float64 (ints as float64, complex as interleaved real/imag)."""
        raw = self.raw
        if self.dtype == "bfloat16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if raw.dtype in (np.float32, np.float64):
            return raw
        if raw.dtype == np.float16 or raw.dtype == np.bool_:
            return raw.astype(np.float32)
        if raw.dtype == np.complex64:
            return raw.view(np.float32)
        if raw.dtype == np.complex128:
            return raw.view(np.float64)
        return raw.astype(np.float64)

    def bits(self) -> np.ndarray:
        """The elements reinterpreted as integers of the same width, for bitwise comparison."""
        raw = self.raw
        if raw.dtype.kind in "fc":
            return raw.view({2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[raw.dtype.itemsize])
        return raw


class _Unsupported(Exception):
    pass


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass
class _TensorSpec:
    storage: np.ndarray
    dtype: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: tuple[np.ndarray, str], offset: int, size: Any, stride: Any,
                       *_: Any) -> _TensorSpec:
    return _TensorSpec(storage[0], storage[1], int(offset), tuple(int(s) for s in size),
                       tuple(int(s) for s in stride))


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage_loader):
        super().__init__(io.BytesIO(data))
        self._load_storage = storage_loader

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGES:
            return _StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise _Unsupported("storage")
        dtype_name, np_dtype = _STORAGES[pid[1].name]
        return self._load_storage(str(pid[2]), np_dtype), dtype_name


_EOCD = struct.Struct("<4s4xHHIIH")
_CENTRAL = struct.Struct("<4s6xH8xIIHHH8xI")


def _zip_entries(mm: mmap.mmap, f) -> dict[str, tuple[int, int, int]]:
    """``{name: (compression, size, local header offset)}`` read straight from the central directory
    (the ``zipfile`` module does the same work five times slower); zip64 archives go through zipfile."""
    end = mm.rfind(b"PK\x05\x06", max(0, len(mm) - 65558))
    if end >= 0:
        _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(mm, end)
        if count != 0xFFFF and cd_offset != 0xFFFFFFFF and cd_offset + cd_size <= end:
            entries = {}
            pos = cd_offset
            for _ in range(count):
                sig, method, csize, usize, n, e, c, offset = _CENTRAL.unpack_from(mm, pos)
                if sig != b"PK\x01\x02" or 0xFFFFFFFF in (usize, offset):
                    break
                entries[mm[pos + 46:pos + 46 + n].decode("utf-8")] = (method, usize, offset)
                pos += 46 + n + e + c
            else:
                return entries
    return {i.filename: (i.compress_type, i.file_size, i.header_offset) for i in zipfile.ZipFile(f).infolist()}


def _fast_load(path: str) -> Optional[ArrayTensor]:
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        infos = _zip_entries(mm, f)
    pkl_name = next((n for n in infos if n.endswith("data.pkl")), None)
    if pkl_name is None:
        return None
    prefix = pkl_name[: -len("data.pkl")]

    def entry(name: str) -> tuple[int, int]:
        info = infos.get(name)
        if info is None or info[0] != zipfile.ZIP_STORED:
            raise _Unsupported(name)
        sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(mm, info[2])
        if sig != b"PK\x03\x04":
            raise _Unsupported(name)
        return info[2] + 30 + name_len + extra_len, info[1]

    if prefix + "byteorder" in infos:
        start, size = entry(prefix + "byteorder")
        if mm[start:start + size] != b"little":
            return None

    def load_storage(key: str, np_dtype: Any) -> np.ndarray:
        start, size = entry(f"{prefix}data/{key}")
        itemsize = np.dtype(np_dtype).itemsize
        return np.frombuffer(mm, dtype=np_dtype, count=size // itemsize, offset=start)

    start, size = entry(pkl_name)
    obj = _TensorUnpickler(mm[start:start + size], load_storage).load()
    if not isinstance(obj, _TensorSpec):
        return None
    return _from_spec(obj)


def _from_spec(spec: _TensorSpec) -> ArrayTensor:
    numel = int(np.prod(spec.size, dtype=np.int64)) if spec.size else 1
    base = spec.storage
    contiguous_stride = []
    acc = 1
    for dim in reversed(spec.size):
        contiguous_stride.append(acc)
        acc *= dim
    if numel == 0:
        flat = base[:0]
    elif tuple(reversed(contiguous_stride)) == spec.stride or numel == 1:
        flat = base[spec.offset: spec.offset + numel]
    else:
        view = np.lib.stride_tricks.as_strided(base[spec.offset:], shape=spec.size,
                                               strides=[s * base.itemsize for s in spec.stride])
        flat = np.ascontiguousarray(view).reshape(-1)
    return ArrayTensor(flat, spec.dtype, spec.size)


def _torch_load(path: str) -> ArrayTensor:
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, torch.Tensor):
        raise DumpInputError(f"{path}: holds a {type(obj).__name__}, not a tensor")
    t = obj.detach().contiguous()
    dtype = str(t.dtype).replace("torch.", "")
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().view(np.uint16)
    elif dtype in {name for name, _ in _STORAGES.values()}:
        raw = t.numpy()
    else:  # float8 and other types numpy lacks
        raw, dtype = t.to(torch.float32).numpy(), "float32"
    return ArrayTensor(raw.reshape(-1), dtype, tuple(t.shape))


def load_array(path: str) -> ArrayTensor:
    """Load one dumped tensor file (``.pt`` or ``.npy``); ``DumpInputError`` naming it if it cannot be."""
    try:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            return ArrayTensor(arr.reshape(-1), str(arr.dtype), tuple(arr.shape))
        try:
            loaded = _fast_load(path)
        except (_Unsupported, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, KeyError, TypeError,
                IndexError, struct.error, EOFError):
            loaded = None
        return loaded if loaded is not None else _torch_load(path)
    except FileNotFoundError:
        raise DumpInputError(f"{path}: missing tensor file (dump.json names it as a data_name)") from None
    except DumpInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise DumpInputError(f"{path}: not a readable tensor file ({type(e).__name__}: {e})") from None
