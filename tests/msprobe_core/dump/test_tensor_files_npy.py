"""The core's tensor-file writer (``dump.tensor_files``) writes NumPy arrays as ``.npy`` files through the
writer process shared with PyTorch (or its threads): byte for byte what ``np.save`` writes, the values at
hand-off time, links after their files, nothing lost when the writer process dies."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from msprobe_core.dump.tensor_files import ARENA_ENV, TensorFiles, write_npy

RNG = np.random.default_rng(0)
CASES = {
    "f32": RNG.standard_normal((30, 50)).astype(np.float32),
    "f32-transposed": RNG.standard_normal((50, 30)).astype(np.float32).T,
    "f64-sliced": RNG.standard_normal(100)[3:90:4],
    "f16": RNG.standard_normal(7).astype(np.float16),
    "i64": np.arange(100_000, dtype=np.int64).reshape(100, 1000),
    "u8": np.arange(256, dtype=np.uint8),
    "bool": np.array([True, False, True]),
    "c64": (RNG.standard_normal(5) + 1j).astype(np.complex64),
    "scalar": np.array(3.5, np.float32),
    "empty": np.zeros((0, 4), np.float32),
}


def _np_save_bytes(tmp_path, a: np.ndarray) -> bytes:
    ref = tmp_path / "ref.npy"
    np.save(ref, a, allow_pickle=False)
    return ref.read_bytes()


@pytest.mark.parametrize("process", [True, False], ids=["writer-process", "threads"])
def test_npy_files_are_np_save_bytes(tmp_path, monkeypatch, process):
    if not process:
        monkeypatch.setenv(ARENA_ENV, "0")
    out = tmp_path / "out"
    out.mkdir()
    files = TensorFiles()
    originals = {name: a.copy() for name, a in CASES.items()}
    sources = {name: a.copy() if a.flags.writeable and a.base is None else a for name, a in CASES.items()}
    for name, a in sources.items():
        files.save_array(a, out / f"{name}.npy")
    for a in sources.values():  # the files hold the values at hand-off time
        if a.flags.writeable and a.size and a.dtype != np.bool_:
            a += 1
    files.link(out / "i64.npy", out / "i64_again.npy")
    assert (files.writer is not None) == process
    assert files.flush() == 0
    files.close()
    for name, a in originals.items():
        data = (out / f"{name}.npy").read_bytes()
        assert data == _np_save_bytes(tmp_path, np.ascontiguousarray(a) if a.ndim else a), name
        back = np.load(out / f"{name}.npy", allow_pickle=False)
        assert back.dtype == a.dtype and back.shape == a.shape and np.array_equal(back, a)
    assert (out / "i64.npy").stat().st_ino == (out / "i64_again.npy").stat().st_ino
    assert not list(out.glob("*.tmp"))


def test_write_npy_now(tmp_path):
    a = RNG.standard_normal((4, 6)).astype(np.float32).T
    write_npy(a, tmp_path / "a.npy")
    assert (tmp_path / "a.npy").read_bytes() == _np_save_bytes(tmp_path, np.ascontiguousarray(a))


def test_writer_process_death_loses_no_npy_file(tmp_path):
    """The writer process is killed: what it did not confirm is written from the arena, later files go
    through threads."""
    files = TensorFiles()
    expected = {}
    for i, n in enumerate([10, 100_000, 3]):
        expected[f"a{i}.npy"] = RNG.standard_normal(n).astype(np.float32)
        files.save_array(expected[f"a{i}.npy"], tmp_path / f"a{i}.npy")
    writer = files.writer
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(30)
    for i, n in enumerate([70_000, 5]):
        expected[f"b{i}.npy"] = RNG.standard_normal(n)
        files.save_array(expected[f"b{i}.npy"], tmp_path / f"b{i}.npy")
    assert files.flush() == 0
    assert files.writer is None
    files.close()
    for name, a in expected.items():
        assert np.array_equal(np.load(tmp_path / name), a), name
