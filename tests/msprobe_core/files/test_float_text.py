"""The record text's floats in C (Ryu's shortest digits, laid out as repr lays them out) are Python's repr, byte
for byte: random bit patterns, subnormals, powers of two and their neighbours (the uneven rounding intervals),
float32 and bfloat16 values (what statistics of such tensors are), short decimals, integers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from msprobe_core.stats.kernel import KERNEL

pytestmark = pytest.mark.skipif(getattr(KERNEL, "repr_check", None) is None,
                                reason="the kernel is not built (or MSPROBE_FAST_STATS=0)")
N = 200_000


def _cases(rng):
    exponents = np.arange(0, 2047, dtype=np.uint64) << np.uint64(52)
    yield "random bits", rng.integers(0, 2 ** 64, size=N, dtype=np.uint64).view(np.float64)
    yield "subnormal", rng.integers(1, 2 ** 52, size=N, dtype=np.uint64).view(np.float64)
    yield "powers of two and neighbours", np.concatenate([(exponents + d).view(np.float64) for d in (0, 1, 2, 2 ** 52 - 1)])
    yield "float32 bits", rng.integers(0, 2 ** 31 - 2 ** 23, size=N, dtype=np.uint32).view(np.float32).astype(np.float64)
    yield "bfloat16 bits", (rng.integers(0, 2 ** 15 - 2 ** 7, size=N, dtype=np.uint32) << np.uint32(16)).view(
        np.float32).astype(np.float64)
    yield "short decimals", np.concatenate([np.round(rng.standard_normal(N // 17), k) * 10.0 ** rng.integers(-30, 30, N // 17)
                                            for k in range(17)])
    yield "integers", np.concatenate([rng.integers(0, 2 ** 62, size=N).astype(np.float64), np.arange(0, N, dtype=np.float64)])
    yield "means and norms", np.abs(rng.standard_normal(N)) * 10.0 ** rng.uniform(-10, 10, N)
    yield "edges", np.array([0.0, 1e16, 1e15, 9999999999999998.0, 1e-4, 1e-5, 0.0001, 0.00011, 5e-324, 1e22, 1e23,
                             2.2250738585072014e-308, 1.7976931348623157e308, 0.1 + 0.2, 1 / 3, 123.0, 1e100])


@pytest.mark.parametrize("seed", [0, 1])
def test_float_text_is_pythons_repr(seed):
    for name, values in _cases(np.random.default_rng(seed)):
        x = np.ascontiguousarray(np.concatenate([values, -values]), dtype=np.float64)
        bad = KERNEL.repr_check(x.tobytes())
        assert bad < 0, (name, repr(float(x[bad])))


def test_a_records_floats_are_written_as_json_writes_them():
    from msprobe_core.pytorch.summarize import Summarizer
    rt = Summarizer(statistics=True, md5=False).record_text
    for v in (0.0, -0.0, 1e-8, 1.5, 1e300, 5e-324, math.nan, math.inf, -math.inf, 0.1 + 0.2, 1e16, 123456789.0):
        assert rt.text(v) == '{"type": "float", "value": %s}' % json.dumps(v)
