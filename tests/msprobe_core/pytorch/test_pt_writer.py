"""The GIL-friendly .pt writer produces files torch.load (weights_only) and the compare reader accept."""

from __future__ import annotations

import zipfile

import pytest
import torch

from msprobe_core.pytorch.pt_writer import write_file
from msprobe_core.stats.kernel import KERNEL

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
    from msprobe_core.dumpdir.tensor_reader import load_array

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


def _check_archive(path, expected):
    back = torch.load(path, weights_only=True)
    assert back.dtype == expected.dtype and back.shape == expected.shape and torch.equal(back, expected)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        assert (info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)) % 64 == 0
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned (O_DIRECT)", "unaligned (plain write)"])
def test_in_place_archive(tmp_path, aligned):
    """The storage already sits in a buffer: the headers go around it and the file is written from it."""
    import mmap

    from msprobe_core.files.pt_archive import header_bytes_needed, trailer_bytes_needed, write_pt_in_place
    from msprobe_core.pytorch.pt_writer import tensor_pickle

    t = torch.randn(300, 257)
    path = tmp_path / "Functional.linear.0.forward.output.0.pt"
    pkl = tensor_pickle(t.dtype, tuple(t.shape))
    n = t.numel() * 4
    data_offset = header_bytes_needed(len(path.name), len(pkl))
    size = data_offset + n + trailer_bytes_needed(len(path.name)) + 4096
    mem = mmap.mmap(-1, size + 4096)
    view = memoryview(mem)[0 if aligned else 64:]
    view[data_offset:data_offset + n] = t.numpy().tobytes()
    write_pt_in_place(path, pkl, view, data_offset, n)
    _check_archive(path, t)
    view.release()
    mem.close()


def test_in_place_rejects_a_short_buffer(tmp_path):
    from msprobe_core.files.pt_archive import write_pt_in_place

    with pytest.raises(ValueError, match="does not fit"):
        write_pt_in_place(tmp_path / "x.pt", b"p" * 10, memoryview(bytearray(1000)), 320, 600)
    assert not list(tmp_path.iterdir())


@pytest.fixture(params=["tmp", "shm"])
def out_dir(request, tmp_path):
    """A folder on the temp file system (a disk here: O_DIRECT) and one on tmpfs (page-cache writes)."""
    if request.param == "tmp":
        return tmp_path
    import os
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no /dev/shm")
    folder = tempfile.mkdtemp(dir="/dev/shm")
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    from pathlib import Path
    return Path(folder)


def test_file_system_type():
    import os

    from msprobe_core.files.pt_archive import file_system_type

    assert file_system_type("/proc/self") == "proc"
    if os.path.ismount("/dev/shm"):
        assert file_system_type("/dev/shm/not/there") == "tmpfs"


def test_writer_process_round_trip(out_dir):
    """Small and large tensors through the writer process and its arena, a hard link, in order."""
    from msprobe_core.pytorch.pt_writer import IN_PLACE_MIN, TensorFiles

    tmp_path = out_dir
    files = TensorFiles()
    tensors = {f"t{i}.pt": torch.randn(n) for i, n in enumerate([3, 1000, IN_PLACE_MIN // 4 + 1, 200_000, 7])}
    tensors["int.pt"] = torch.arange(100_000, dtype=torch.int64).reshape(100, 1000)
    saved = {name: t.clone() for name, t in tensors.items()}
    for name, t in tensors.items():
        files.save(t, tmp_path / name)
        t.add_(1)  # the file holds the value at save time
    files.link(tmp_path / "t3.pt", tmp_path / "t3_again.pt")
    assert files.writer is not None
    assert files.flush() == 0
    files.close()
    for name, t in saved.items():
        _check_archive(tmp_path / name, t)
    assert (tmp_path / "t3.pt").stat().st_ino == (tmp_path / "t3_again.pt").stat().st_ino


@pytest.mark.parametrize("t", [torch.randn(300, 500), torch.randn(500, 300).t(), torch.randn(70_000).bfloat16(),
                               torch.arange(10, dtype=torch.int32), torch.randn(8).half(), torch.tensor([True, False])],
                         ids=["f32", "f32-transposed", "bf16", "int32", "f16", "bool"])
def test_statistics_from_the_file_copy(out_dir, t):
    """A saved tensor's statistics come from the copy made for its file and equal host_stats'."""
    from msprobe_core.pytorch.pt_writer import TensorFiles
    from msprobe_core.pytorch.tensor_stats import host_stats

    files = TensorFiles()
    stats = files.save(t, out_dir / "a.pt", True)
    assert files.flush() == 0
    files.close()
    expected = host_stats(t)
    if t.dtype == torch.float16 or KERNEL is None:  # a small float16 tensor is copied as bytes, and without
        assert stats is None                          # the kernel nothing reads the copy: the caller computes them
        return
    assert stats is not None and len(stats) == len(expected)
    assert all(a == pytest.approx(b, rel=1e-9, abs=1e-12) for a, b in zip(stats, expected))
    _check_archive(out_dir / "a.pt", t.contiguous())


def test_writer_process_death_loses_nothing(out_dir):
    """The writer process is killed: what it was given and did not confirm is written by the trainer's
    process from the arena, later files go through threads, and links still find their files."""
    import os
    import signal

    from msprobe_core.pytorch.pt_writer import TensorFiles

    files = TensorFiles()
    expected = {}
    for i, n in enumerate([10, 100_000, 3]):
        t = torch.randn(n)
        expected[f"a{i}.pt"] = t.clone()
        files.save(t, out_dir / f"a{i}.pt")
        t.zero_()
    writer = files.writer
    assert writer is not None
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(30)  # dead for sure, however loaded the machine
    for i, n in enumerate([100_000, 5, 70_000]):
        expected[f"b{i}.pt"] = torch.randn(n)
        files.save(expected[f"b{i}.pt"], out_dir / f"b{i}.pt")
    files.link(out_dir / "b0.pt", out_dir / "c0.pt")
    expected["c0.pt"] = expected["b0.pt"]
    assert files.flush() == 0
    assert files.writer is None  # threads from now on
    files.close()
    for name, t in expected.items():
        _check_archive(out_dir / name, t)


def test_writer_death_noticed_at_close(tmp_path):
    """The writer dies after being handed files and nothing else happens before close(): all written."""
    import os
    import signal

    from msprobe_core.pytorch.pt_writer import TensorFiles

    files = TensorFiles()
    tensors = {f"t{i}.pt": torch.randn(50_000 + i) for i in range(4)}
    files.save(torch.randn(3), tmp_path / "first.pt")
    os.kill(files.writer.pid, signal.SIGKILL)
    files.writer.wait(30)  # dead for sure, however loaded the machine
    for name, t in tensors.items():
        files.save(t, tmp_path / name)
    files.close()
    for name, t in tensors.items():
        _check_archive(tmp_path / name, t)


def test_failover_with_a_live_writer(tmp_path, monkeypatch):
    """A failure on the training side while the writer lives: the writer finishes what it was given (no
    file is written twice at once), and the rest goes through threads."""
    from msprobe_core.pytorch import pt_writer

    files = pt_writer.TensorFiles()
    tensors = {f"t{i}.pt": torch.randn(30_000 + i) for i in range(6)}
    names = list(tensors)
    for name in names[:3]:
        files.save(tensors[name], tmp_path / name)
    writer = files.writer
    monkeypatch.setattr(pt_writer._ProcessFiles, "_alloc", lambda *a, **k: (_ for _ in ()).throw(OSError("no space")))
    for name in names[3:]:
        files.save(tensors[name], tmp_path / name)
    assert files.writer is None and writer.returncode == 0
    assert files.flush() == 0
    files.close()
    for name, t in tensors.items():
        _check_archive(tmp_path / name, t)
