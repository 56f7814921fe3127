"""Random inputs that match a recorded tensor (framework-neutral, numpy).

Random mode (no tensor file for a tensor): values are drawn uniformly in [Min, Max] of the recorded
dtype and shape, and Max and Min themselves are placed at the first two positions, so the generated
tensor has the recorded extremes. An infinite Max/Min puts that infinity at a quarter of the positions
(the finite values then span ``[-(|Max| + 1), Max]`` or ``[Min, |Min| + 1]``); a NaN statistic puts
one NaN. Integers are drawn in [Min, Max] (a constant when Max == Min), booleans are all False when
Max is False, all True when Min is True, mixed otherwise. Missing statistics give [-1, 1] (floats)
or [0, 10] (integers).

Every call gets its own generator seeded by ``SEED`` and the call's name, so a rerun, a resumed run
and any split of the calls over workers draw the same inputs for the same call.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Optional

import numpy as np

from msprobe_core.acc_check.api_calls import TensorSpec, dtype_kind

SEED = 1234
"""The seed every call's generator starts from (with a CRC-32 of the call's name)."""

_INT_DTYPES = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
               "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}


def call_rng(call_name: str) -> np.random.Generator:
    """The generator of one call: the same for the same name in every run and process."""
    return np.random.default_rng([SEED, zlib.crc32(call_name.encode("utf-8"))])


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def random_array(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """An array with ``spec``'s shape: exact integer/bool dtype; float64 for float64, float32 for the other
    floating dtypes (the backend rounds it to the recorded dtype)."""
    n = spec.numel
    kind = dtype_kind(spec.dtype)
    if n == 0:
        flat = np.zeros(0, dtype=np.bool_ if kind == "bool" else _INT_DTYPES.get(spec.dtype, np.float64))
    elif kind == "bool":
        flat = _bools(spec, rng, n)
    elif kind == "int":
        flat = _ints(spec, rng, n)
    else:
        flat = _floats(spec, rng, n)
    return flat.reshape(spec.shape)


def _bools(spec: TensorSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    if spec.max is False:
        return np.zeros(n, dtype=np.bool_)
    if spec.min is True:
        return np.ones(n, dtype=np.bool_)
    flat = rng.random(n) < 0.5
    if n >= 2:
        flat[0], flat[1] = True, False
    return flat


def _ints(spec: TensorSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    dtype = _INT_DTYPES.get(spec.dtype, np.int64)
    hi, lo = _number(spec.max), _number(spec.min)
    lo_i = int(lo) if lo is not None and math.isfinite(lo) else 0
    hi_i = int(hi) if hi is not None and math.isfinite(hi) else lo_i + 10
    hi_i = max(hi_i, lo_i)
    flat = rng.integers(lo_i, hi_i, size=n, endpoint=True, dtype=np.int64)
    if n >= 2:
        flat[0], flat[1] = hi_i, lo_i
    return flat.astype(dtype, copy=False)


def _floats(spec: TensorSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    hi, lo = _number(spec.max), _number(spec.min)
    nan = any(v is not None and math.isnan(v) for v in (hi, lo))
    pos_inf = hi == math.inf
    neg_inf = lo == -math.inf
    hi_f = hi if hi is not None and math.isfinite(hi) else None
    lo_f = lo if lo is not None and math.isfinite(lo) else None
    if hi_f is None and lo_f is None:
        hi_f, lo_f = 1.0, -1.0
    elif hi_f is None:
        hi_f = abs(lo_f) + 1.0  # type: ignore[arg-type]
    elif lo_f is None:
        lo_f = -(abs(hi_f) + 1.0)
    lo_f, hi_f = min(lo_f, hi_f), max(lo_f, hi_f)  # type: ignore[type-var]
    dtype = np.float64 if spec.dtype in ("float64", "complex128") else np.float32  # float32 draws are 2x faster
    if hi_f > lo_f:
        flat = rng.random(n, dtype=dtype)
        flat *= dtype(hi_f - lo_f)
        flat += dtype(lo_f)
        np.clip(flat, lo_f, hi_f, out=flat)
    else:
        flat = np.full(n, hi_f, dtype=dtype)
    if n >= 2:
        flat[0], flat[1] = hi_f, lo_f
    for flag, value in ((pos_inf, math.inf), (neg_inf, -math.inf)):
        if flag:
            flat[rng.random(n) < 0.25] = value
            flat[rng.integers(0, n)] = value
    if nan:
        flat[rng.integers(0, n)] = math.nan
    return flat
