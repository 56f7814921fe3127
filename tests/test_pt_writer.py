"""The GIL-friendly .pt writer produces files torch.load (weights_only) and the compare reader accept."""

from __future__ import annotations

import zipfile

import pytest
import torch

from msprobe_core.pytorch.pt_writer import write_file

CASES = [
    torch.randn(3, 4), torch.randn(2, 3, dtype=torch.float64), torch.randn(5).half(), torch.randn(4, 2).bfloat16(),
    torch.arange(6).reshape(2, 3), torch.arange(6, dtype=torch.int32), torch.tensor([True, False]),
    torch.randn(3, dtype=torch.complex64), torch.zeros(0, 4), torch.tensor(3.5), torch.randn(4, 6).t(),
    torch.randn(10)[2:7], torch.arange(256, dtype=torch.uint8), torch.tensor([1, -2], dtype=torch.int8),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}-{list(t.shape)}")
def test_round_trip(tmp_path, t):
    path = tmp_path / "Functional.linear.0.forward.input.0.pt"
    write_file(t, path)
    back = torch.load(path, weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    assert back.is_contiguous() and not back.requires_grad
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        data_start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        assert data_start % 64 == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_compare_reader_reads_it(tmp_path):
    from msprobe_core.compare.ptfile import load_array

    t = torch.randn(4, 5)
    path = tmp_path / "x.pt"
    write_file(t, path)
    arr = load_array(str(path))
    assert arr.dtype == "float32" and arr.shape == (4, 5)
    assert arr.values().tolist() == t.flatten().tolist()


def test_archive_is_a_valid_zip_with_correct_crcs(tmp_path):
    path = tmp_path / "a.pt"
    write_file(torch.randn(1000), path)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        names = zf.namelist()
    assert any(n.endswith("/data.pkl") for n in names) and any(n.endswith("/data/0") for n in names)
