"""The one-pass CPU statistics kernel against torch's own reductions, and its fall-backs."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from msprobe_core.pytorch import tensor_stats
from msprobe_core.pytorch.tensor_stats import batched_stats, host_stats, summary_kind, summary_stats

needs_kernel = pytest.mark.skipif(not tensor_stats.fast_cpu_stats(), reason="the C kernel was not built")


def _torch_reference(t: torch.Tensor) -> tuple[float, float, float, float]:
    with torch.no_grad():
        mx, mn, total, norm = (float(v) for v in summary_stats(t, summary_kind(t)))
    return mx, mn, total, norm


def _close(a: float, b: float, rel: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 4095, 4097, 70_001, 300_001])
def test_float_kernel_matches_torch(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    t = (torch.randn(numel, generator=g) * 3 + 0.5).to(dtype)
    mx, mn, total, sumsq, zeros, nans = host_stats(t)
    ref = _torch_reference(t)
    assert (mx, mn) == ref[:2]  # max and min are exact
    exact = t.double()  # sums against float64 (torch's float32 reductions are themselves ~1e-5 off)
    assert _close(total, exact.sum().item(), 1e-5) and _close(sumsq, (exact * exact).sum().item(), 1e-6)
    assert _close(total, ref[2], 1e-4) and _close(math.sqrt(sumsq), ref[3], 1e-4)
    assert zeros == 0 and nans == 0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integer_kernel_is_exact(dtype):
    t = torch.arange(-50, 77).to(dtype) if dtype != torch.uint8 else torch.arange(0, 255).to(dtype)
    mx, mn, total, sumsq, _, _ = host_stats(t)
    v = t.double()
    assert (mx, mn, total, sumsq) == (v.max().item(), v.min().item(), v.sum().item(), (v * v).sum().item())


@needs_kernel
def test_bool_gives_any_and_all():
    assert host_stats(torch.tensor([True, False, True]))[:2] == (1.0, 0.0)
    assert host_stats(torch.tensor([True, True]))[:2] == (1.0, 1.0)
    assert host_stats(torch.tensor([False]))[:2] == (0.0, 0.0)


@needs_kernel
@pytest.mark.parametrize("numel", [10_000, 400_000])  # the second is split over threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_nan_and_inf_follow_torch(dtype, numel):
    t = torch.randn(numel).to(dtype)
    t[17] = float("inf")
    mx, mn, total, sumsq, _, nans = host_stats(t)
    assert mx == math.inf and nans == 0 and sumsq == math.inf
    t[4000] = float("-inf")
    assert math.isnan(host_stats(t)[2]) and host_stats(t)[5] == 0  # inf - inf is not a NaN in the data
    t[numel - 1] = float("nan")
    t[5] = float("nan")
    mx, mn, total, sumsq, _, nans = host_stats(t)
    assert math.isnan(mx) and math.isnan(mn) and nans == 2
    ref = _torch_reference(t)
    assert math.isnan(ref[0]) and math.isnan(ref[1])


@needs_kernel
def test_zero_count_with_eps():
    t = torch.tensor([0.0, 1e-9, -1e-9, 0.5, -2.0, float("nan")])
    assert host_stats(t, 1e-8)[4:] == (3.0, 1.0)
    assert host_stats(t)[4] == 0.0  # not asked


@needs_kernel
def test_views_and_odd_layouts():
    base = torch.randn(64, 33)
    t = base.t()  # not contiguous: read through a contiguous copy
    assert host_stats(t)[:2] == _torch_reference(t)[:2]
    sliced = base[5:9, 3:]
    assert host_stats(sliced)[:2] == _torch_reference(sliced)[:2]
    assert host_stats(base[3])[:2] == _torch_reference(base[3])[:2]  # storage offset
    assert host_stats(torch.randn(4, 4).to_sparse()) is None
    assert host_stats(torch.randn(3, dtype=torch.complex64)) is None
    assert host_stats(torch.randn(3, device="meta")) is None

    class Sub(torch.Tensor):
        pass

    assert host_stats(torch.randn(3).as_subclass(Sub)) is None
    p = torch.nn.Parameter(torch.randn(5))
    assert host_stats(p)[:2] == _torch_reference(p.detach())[:2]


@needs_kernel
def test_batched_stats_on_cpu_matches_torch_columns():
    xs = [torch.randn(300), torch.zeros(10), torch.tensor([1.0, float("nan"), 0.0]), torch.randn(50).bfloat16(), torch.empty(0)]
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    fast = batched_stats(xs, ops, 1e-8)
    tensor_stats._fast_stats, saved = None, tensor_stats._fast_stats
    try:
        slow = batched_stats(xs, ops, 1e-8)
    finally:
        tensor_stats._fast_stats = saved
    assert fast.shape == slow.shape == (5, 6) and fast.dtype == slow.dtype == torch.float32
    assert torch.allclose(fast, slow, rtol=1e-5, equal_nan=True), (fast, slow)


@needs_kernel
def test_turned_off_by_environment():
    code = "import msprobe_core.pytorch.tensor_stats as s, torch; print(s.host_stats(torch.ones(3)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, MSPROBE_FAST_STATS="0")).stdout
    assert out.strip() == "None"


@needs_kernel
def test_host_bytes_and_crc_match_the_tensor_bytes():
    import zlib

    from msprobe_core.pytorch.tensor_crc import tensor_crc32
    from msprobe_core.pytorch.tensor_stats import host_bytes

    t = torch.randn(33, 7)
    assert bytes(host_bytes(t)) == t.numpy().tobytes()
    assert host_bytes(t.t()) is None and host_bytes(torch.randn(3, dtype=torch.complex64).conj()) is None
    for x in (t, t.t(), t[3], torch.arange(10), torch.tensor([True, False]), torch.randn(4, dtype=torch.complex64).conj()):
        expected = zlib.crc32(x.resolve_conj().contiguous().numpy().tobytes()) & 0xFFFFFFFF
        assert tensor_crc32(x) == f"{expected:08x}"
    assert tensor_crc32(torch.empty(0)) == "00000000"


def test_kernel_is_built_by_make_venv():
    """``make venv`` builds the extension (setup.py); CI checks it really did, so the fall-back is not
    silently what gets tested and measured."""
    if os.environ.get("CI") and os.environ.get("MSPROBE_FAST_STATS", "1") != "0":
        assert tensor_stats.fast_cpu_stats()
