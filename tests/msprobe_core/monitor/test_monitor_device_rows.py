"""``DeviceRows`` (an accelerator's rows in batches) and ``row_stats``, run on CPU tensors: the class is the same
on any device (the collector sends it an accelerator's tensors only), so the rows it gives must be
``batched_stats``' one tensor at a time, in the order the tensors came, whatever the batching."""

import numpy as np
import pytest
import torch

from msprobe_core.pytorch import snapshot_rows as device_rows
from msprobe_core.monitor.device_rows import DeviceRows
from msprobe_core.monitor.stats import StatsEngine
from msprobe_core.pytorch.tensor_stats import MONITOR_OPS, batched_stats, row_stats

OPS = ("min", "max", "norm", "mean", "zeros", "nans")
EXACT = [OPS.index(op) for op in ("min", "max", "zeros", "nans")]


def _expected(tensors, ops=OPS):
    return np.stack([batched_stats([t], ops).double().numpy()[0] for t in tensors])


def _same(got: np.ndarray, want: np.ndarray, ops=OPS) -> None:
    exact = [ops.index(op) for op in ("min", "max", "zeros", "nans") if op in ops]
    np.testing.assert_array_equal(got[:, exact], want[:, exact])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)


def _tensors():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(32, 64, generator=g) for _ in range(5)]
    xs[1][0, :7] = 0.0
    xs[2][3, 3] = float("nan")
    xs[3][5, 5] = float("inf")
    xs += [torch.randn(7, generator=g), torch.randn(64, 32, generator=g).t(),  # a size of its own; not contiguous
           torch.randn(32, 64, generator=g).to(torch.bfloat16), torch.full((3, 3), -2.0)]
    return xs


def test_row_stats_is_batched_stats_row_by_row():
    xs = [t.float().reshape(-1) for t in _tensors() if t.numel() == 2048]
    _same(row_stats(torch.stack(xs), OPS).double().numpy(), _expected(xs))
    some = ("nans", "max", "zeros")
    _same(row_stats(torch.stack(xs), some).double().numpy(), _expected(xs, some), some)


def test_row_stats_names_an_unknown_op():
    with pytest.raises(ValueError, match="'median'.*allowed: " + ", ".join(MONITOR_OPS)):
        row_stats(torch.zeros(2, 3), ("median",))


@pytest.mark.parametrize("pending", [device_rows.PENDING_ELEMENTS, 4096])
def test_rows_in_arrival_order_whatever_the_batches(monkeypatch, pending):
    monkeypatch.setattr(device_rows, "PENDING_ELEMENTS", pending)  # 4096: summarised every other tensor
    monkeypatch.setattr(device_rows, "SNAPSHOT_ELEMENTS", 1000)  # the 2,048-element tensors summarised at once
    xs = _tensors()
    engine = StatsEngine(OPS, 1e-8)
    rows = DeviceRows(engine)
    assert [rows.add(t) for t in xs[:4]] == [0, 1, 2, 3]
    block = batched_stats([xs[4]], OPS)
    assert rows.add_block(block) == 4  # rows computed elsewhere keep their place
    assert [rows.add(t) for t in xs[5:]] == [5, 6, 7, 8]
    _same(rows.values(), _expected(xs))


def test_snapshot_taken_at_once_and_large_tensors_summarised_at_once(monkeypatch):
    monkeypatch.setattr(device_rows, "SNAPSHOT_ELEMENTS", 1000)
    engine = StatsEngine(OPS, 1e-8)
    rows = DeviceRows(engine)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))  # seeded: a mean near 0 has few exact digits
    want = _expected([x.clone()])
    rows.add(x)
    x.mul_(100.0)  # a later in-place change: the row is the tensor as it was
    z = torch.randn(40, 40, dtype=torch.float64)  # over SNAPSHOT_ELEMENTS: summarised now, as before
    rows.add(z)
    values = rows.values()
    _same(values[:1], want)
    _same(values[1:], _expected([z]))
    assert rows.values().shape == (2, len(OPS))  # read twice: the same rows


def test_no_rows():
    assert DeviceRows(StatsEngine(OPS, 1e-8)).values().shape == (0, len(OPS))
