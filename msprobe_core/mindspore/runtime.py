"""What the MindSpore dump asks of MindSpore itself: which framework runs (native MindSpore or PyTorch code
through MSAdapter's ``mindtorch``), gradient hooks on tensors, dtype names, the rank and where tensors live.

Native MindSpore and mindtorch share one tensor class (``torch.Tensor`` *is* ``mindspore.Tensor`` under
mindtorch) and one autograd (PyNative ``value_and_grad``), so one implementation serves both; only the
record names, the model type and the API namespaces differ (``framework()``).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

import mindspore as ms
from mindspore._c_expression import TensorPy
from mindspore.common.api import _pynative_executor
from mindspore.common.hook_handle import _TensorHookHandle

Tensor = ms.Tensor
Parameter = ms.Parameter
MS_VERSION = tuple(int(p) for p in ms.__version__.split(".")[:2] if p.isdigit())

MINDSPORE = "mindspore"
MINDTORCH = "mindtorch"


def framework() -> str:
    """``"mindtorch"`` when MSAdapter's mindtorch is imported (PyTorch code running on MindSpore; import
    torch before msprobe, as msprobe asks), else ``"mindspore"``."""
    return MINDTORCH if "mindtorch" in sys.modules else MINDSPORE


def register_grad_hook(t: Tensor, fn: Callable[[Tensor], None]) -> Any:
    """Call ``fn(grad)`` when autograd computes ``t``'s gradient; returns a handle with ``remove()``.

    MindSpore's own registration (``Tensor.register_hook``), called directly: mindtorch replaces the method
    with one that fails (``'Tensor' object has no attribute '_data'``). ``fn`` returns None, which leaves the
    gradient as it is.
    """
    handle = _TensorHookHandle(t)
    handle.id = TensorPy.register_hook(t, fn)
    return handle


def settle() -> None:
    """Wait for PyNative's queued kernels, dropping any error they raise. After a call whose kernel failed,
    MindSpore may hold that error and raise it again at a later synchronization, under another call's name
    (acc_check once saw a ``GeluExt`` failure reported for the next API replayed)."""
    for _ in range(4):
        try:
            _pynative_executor.sync()
            return
        except Exception:  # noqa: BLE001 - the failed call's own error, raised again
            continue


def recording_grad() -> bool:
    """Is autograd recording the current forward pass (inside ``value_and_grad`` / ``grad``)?"""
    return bool(_pynative_executor.requires_grad())


def numel(t: Tensor) -> int:
    """The number of elements (``Tensor.size`` is an int in MindSpore but a method under mindtorch)."""
    return math.prod(t.shape)


def requires_grad(t: Tensor) -> bool:
    """msprobe's ``requires_grad`` field: a trainable parameter, or a tensor autograd is tracking."""
    if isinstance(t, Parameter):
        return bool(t.requires_grad)
    return bool(getattr(t, "_requires_grad", False))


_DTYPE_NAMES: dict[Any, str] = {}
_NAMES = {"float16": "Float16", "float32": "Float32", "float64": "Float64", "bfloat16": "BFloat16",
          "int8": "Int8", "int16": "Int16", "int32": "Int32", "int64": "Int64", "uint8": "UInt8",
          "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "bool_": "Bool",
          "complex64": "Complex64", "complex128": "Complex128"}


def dtype_name(dtype: Any) -> str:
    """MindSpore's name of a dtype (``Float32``, ``BFloat16``...), also under mindtorch (which changes
    ``str(mindspore.float32)`` to ``mindspore.float32``)."""
    if not _DTYPE_NAMES:
        _DTYPE_NAMES.update({getattr(ms, attr): n for attr, n in _NAMES.items() if hasattr(ms, attr)})
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


def current_rank() -> Optional[int]:
    """This process's rank when MindSpore's communication is initialised, else None."""
    try:
        from mindspore.communication.management import GlobalComm, get_rank
    except ImportError:  # pragma: no cover - a build without communication
        return None
    return int(get_rank()) if GlobalComm.INITED else None


def tensors_on_host() -> bool:
    """Do tensors live in host memory (the CPU backend)? Then statistics are read from their memory."""
    return ms.get_context("device_target") == "CPU"


_READABLE: set = set()


def odd_tensor_reason(t: Tensor) -> Optional[str]:
    """None for a tensor the dump summarises; otherwise why it does not read it (the PyTorch dump's
    ``odd_tensors`` for MindSpore): a tensor whose data is not made yet (``init=`` / deferred parameter
    initialisation: reading it would run its initializer) or of a dtype with no NumPy counterpart
    (float8, hifloat8, qint4x2: MindSpore's CPU backend cannot even cast them)."""
    if not _READABLE:
        _READABLE.update(getattr(ms, attr) for attr in _NAMES if hasattr(ms, attr))
    if t.dtype not in _READABLE:
        return f"dtype {dtype_name(t.dtype)} (no NumPy counterpart)"
    if t.has_init:
        return "uninitialized tensor (deferred initialisation)"
    return None
