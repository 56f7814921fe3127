"""The dump's snapshots (``snapshot_rows``): an accelerator's small float tensors summarised in batches. The
path is the same on any device, so it runs here on CPU tensors (``_waits`` forced): the summaries equal the usual
path's (Max/Min exactly, Mean/Norm to the last bits), in-place changes after the call do not reach them, a
version recorded twice reads its statistics once, and a failure leaves the summary saying so."""

import math

import pytest
import torch

from msprobe_core.pytorch import summarize, snapshot_rows
from msprobe_core.pytorch.summarize import Summarizer
from msprobe_core.pytorch.tensor_stats import row_summary, summary_stats


def _summaries(s: Summarizer, tensors) -> list[dict]:
    with torch.no_grad():
        out = [s.tensor(t, None, False) for t in tensors]
        s.resolve()
    return out


def _tensors():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(8, 16, generator=g) for _ in range(3)]
    xs[1][0, 0] = float("nan")
    xs[2][1, 1] = float("-inf")
    return xs + [torch.randn(8, 16, generator=g).t(), torch.randn(7, generator=g).to(torch.bfloat16),
                 torch.randn(4, 4, dtype=torch.float64, generator=g), torch.nn.Parameter(torch.randn(3, generator=g))]


def _close(a: dict, b: dict) -> None:
    assert repr({k: v for k, v in a.items() if k not in ("Mean", "Norm")}) == \
        repr({k: v for k, v in b.items() if k not in ("Mean", "Norm")})  # (NaN != NaN; their reprs are equal)
    for k in ("Mean", "Norm"):
        assert a[k] == pytest.approx(b[k], rel=1e-6, nan_ok=True) or (math.isnan(a[k]) and math.isnan(b[k]))


@pytest.fixture
def waiting(monkeypatch):
    """Every float tensor takes the snapshot path, as an accelerator's would."""
    monkeypatch.setattr(summarize, "_waits", lambda t, kind: kind == "float" and snapshot_rows.takes(t))


def test_row_summary_is_summary_stats_row_by_row():
    rows = torch.randn(5, 33, dtype=torch.float64)
    want = torch.stack([torch.stack(summary_stats(r, "float")) for r in rows])
    got = row_summary(rows)
    assert torch.equal(got[:, :2], want[:, :2])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_summaries_equal_the_usual_paths(waiting):
    xs = _tensors()
    usual = _summaries(Summarizer(statistics=True, md5=False), [x.clone() if type(x) is torch.Tensor else x for x in xs])
    s = Summarizer(statistics=True, md5=False)
    snap = _summaries(s, xs)
    for a, b in zip(snap, usual):
        _close(a, b)
    assert not s._snapshots.done and not s._snapshots._waiting  # nothing left behind


def test_values_are_those_of_the_call_and_read_once(waiting, monkeypatch):
    s = Summarizer(statistics=True, md5=False)
    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(7))  # seeded: a mean near 0 has few exact digits
    want = _summaries(Summarizer(statistics=True, md5=False), [x.clone()])[0]
    reads = []
    real = snapshot_rows.SnapshotRows.summarise
    monkeypatch.setattr(snapshot_rows.SnapshotRows, "summarise", lambda self: reads.append(len(self._waiting)) or real(self))
    with torch.no_grad():
        first = s.tensor(x, None, False)
        again = s.tensor(x, None, False)  # the same version: the cached statistics
        x.mul_(10.0)  # after the calls: not in their summaries
        s.resolve()
        later = s.tensor(x, None, False)  # a new version
        s.resolve()
    _close(first, want)
    _close(again, want)
    assert later["Max"] == pytest.approx(want["Max"] * 10.0)
    assert reads == [1, 1]  # one snapshot each time


def test_a_failed_summary_says_so(waiting, monkeypatch):
    s = Summarizer(statistics=True, md5=False)

    def broken(rows):
        raise RuntimeError("device lost")

    s._snapshots = snapshot_rows.SnapshotRows(broken)
    out = _summaries(s, [torch.randn(4)])[0]
    assert out["Max"] is None and out["summary"] == "unsupported: statistics could not be read"
    assert not s._snapshots.done


def test_large_and_other_tensors_keep_the_usual_path(waiting, monkeypatch):
    monkeypatch.setattr(snapshot_rows, "SNAPSHOT_ELEMENTS", 10)
    s = Summarizer(statistics=True, md5=False)
    _summaries(s, [torch.randn(20), torch.arange(5), torch.tensor([True])])
    assert not s._snapshots.done and not s._snapshots._waiting
