"""What the MindSpore dump gets from the core's dump service, shared with PyTorch (real MindSpore, CPU,
PyNative): overflow_check / nan_check on inputs, dump.json written at stop() once the backward ran, odd
tensors recorded without reading them, the dumping-thread policy, ``save`` and ``module_dump``, and
``.npy`` files written by the core's writer process."""

from __future__ import annotations

import glob
import json
import threading
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore.nn") and __import__("mindspore")  # not the tests/msprobe_core/mindspore folder

import ms_models as M  # noqa: E402  (tests/support is on sys.path)
from mindspore import mint  # noqa: E402
from mindspore.common.initializer import Normal  # noqa: E402

from msprobe_core.mindspore import PrecisionDebugger, module_dump, module_dump_end  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_ms_debugger():
    PrecisionDebugger.reset()
    yield
    PrecisionDebugger.reset()


def rank_dir(dump_path: Path, step: int = 0) -> Path:
    (found,) = [Path(p) for p in glob.glob(f"{dump_path}/step{step}/*")]
    return found


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_nan_check_records_calls_with_inf_or_nan_in_inputs_and_saves_their_tensors(tmp_path):
    """A call whose input holds Inf but whose output is finite is an overflow too (as in the PyTorch dump);
    its tensors go to dump_tensor_data/ through the core's writer process."""
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1", "task": "nan_check",
                             "nan_check": {"overflow_nums": -1}})
    x = ms.Tensor(np.array([1.0, -2.0, np.inf], np.float32))
    dbg.start()
    y = mint.clamp(x, -1.0, 1.0)  # Inf in, finite out
    z = mint.mul(y, 2.0)          # finite in and out: not recorded
    dbg.stop()
    dbg.step()
    folder = rank_dir(tmp_path / "d")
    dump = read(folder / "dump.json")
    assert dump["task"] == "overflow_check" and dump["framework"] == "mindspore"
    assert set(dump["data"]) == {"Mint.clamp.0.forward"}
    record = dump["data"]["Mint.clamp.0.forward"]
    assert record["input_args"][0]["Max"] == float("inf") and record["output"][0]["Max"] == 1.0
    for summary in (record["input_args"][0], record["output"][0]):
        saved = np.load(folder / "dump_tensor_data" / summary["data_name"], allow_pickle=False)
        assert saved.dtype == np.float32 and summary["Max"] == float(saved.max())
    assert np.array_equal(z.asnumpy(), np.array([2.0, -2.0, 2.0], np.float32))


def test_overflow_nums_counts_input_overflows(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1", "task": "overflow_check",
                             "overflow_check": {"overflow_nums": 1}})
    x = ms.Tensor(np.array([np.nan, 1.0], np.float32))
    dbg.start()
    mint.clamp(x, 0.0, 1.0)
    mint.clamp(x, 0.0, 1.0)
    dbg.stop()
    dbg.step()
    assert list(read(rank_dir(tmp_path / "d") / "dump.json")["data"]) == ["Mint.clamp.0.forward"]


def test_dump_json_is_written_at_stop_once_the_backward_ran(tmp_path):
    net, opt, grad_fn = M.build()
    (x, y), = M.data(1)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    dbg.start(net)
    grad_fn(ms.Tensor(x), ms.Tensor(y))
    dbg.stop()  # the backward ran: the step's files are complete now, before step()
    folder = rank_dir(tmp_path / "d")
    at_stop = read(folder / "dump.json")["data"]
    assert "Cell.head.Linear.backward.0" in at_stop and "Cell.head.Linear.parameters_grad.0" in at_stop
    assert (folder / "construct.json").exists() and (folder / "stack.json").exists()
    dbg.step()
    assert read(folder / "dump.json")["data"] == at_stop


def test_forward_only_step_writes_dump_json_at_step(tmp_path):
    net = M.TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    dbg.start(net)
    net(ms.Tensor(M.data(1)[0][0]))
    dbg.stop()  # no backward yet: it may still come, so the files wait for step()
    folder = rank_dir(tmp_path / "d")
    assert not (folder / "dump.json").exists()
    dbg.step()
    assert "Cell.head.Linear.forward.0" in read(folder / "dump.json")["data"]


def test_odd_tensors_are_recorded_without_reading_them(tmp_path):
    """A tensor whose data is not made yet (deferred initialisation: reading it would run its initializer)
    and a float8 tensor (no NumPy counterpart, no CPU kernels) get records that say why they carry no
    statistics; nothing reads or saves them."""
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1", "task": "tensor",
                             "tensor": {"summary_mode": "md5"}})
    lazy = ms.Tensor(shape=(2, 3), dtype=ms.float32, init=Normal())
    f8 = ms.Tensor(np.ones(3, np.uint8), dtype=ms.float8_e4m3fn)
    x = ms.Tensor(np.ones(3, np.float32))
    dbg.start()
    dbg.save({"lazy": lazy, "f8": f8, "x": x}, "odd")
    dbg.stop()
    dbg.step()
    saved = read(rank_dir(tmp_path / "d") / "debug.json")["data"]["odd.0.debug"]
    assert saved["lazy"]["summary"] == "unsupported: uninitialized tensor (deferred initialisation)"
    assert saved["lazy"]["shape"] == [2, 3] and saved["lazy"]["dtype"] == "Float32"
    assert saved["lazy"]["Max"] is None and saved["lazy"]["md5"] is None and "data_name" not in saved["lazy"]
    assert saved["f8"]["summary"] == "unsupported: dtype Float8E4M3FN (no NumPy counterpart)"
    assert saved["f8"]["shape"] == [3] and "data_name" not in saved["f8"]
    assert saved["x"]["Max"] == 1.0 and "data_name" in saved["x"]
    assert lazy.has_init  # never materialised by the tool


def test_calls_from_other_threads_are_not_dumped(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    x = ms.Tensor(np.arange(4, dtype=np.float32))
    dbg.start()
    worker = threading.Thread(target=lambda: mint.add(x, x))
    worker.start()
    worker.join()
    mint.mul(x, x)
    dbg.stop()
    dbg.step()
    assert set(read(rank_dir(tmp_path / "d") / "dump.json")["data"]) == {"Mint.mul.0.forward"}


def test_save_with_backward(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1", "task": "tensor"})
    x = ms.Tensor(np.array([1.0, 2.0, 3.0], np.float32))

    def forward(v):
        h = v * 2.0
        dbg.save(h, "h")
        return (h * h).sum()

    dbg.start()
    dbg.save({"lr": 0.5, "x": x}, "inputs")
    ms.value_and_grad(forward)(x)
    dbg.stop()
    dbg.step()
    folder = rank_dir(tmp_path / "d")
    debug = read(folder / "debug.json")
    assert debug["level"] == "debug" and debug["framework"] == "mindspore"
    data = debug["data"]
    assert data["inputs.0.debug"]["lr"] == {"type": "float", "value": 0.5}
    assert data["h.0.debug"]["Max"] == 6.0
    grad = data["h_grad.0.debug"]  # d(sum(h*h))/dh = 2h
    assert (grad["Max"], grad["Min"]) == (12.0, 4.0)
    assert np.array_equal(np.load(folder / "dump_tensor_data" / grad["data_name"]), np.array([4.0, 8.0, 12.0], np.float32))


def test_level_debug_records_only_save(tmp_path):
    """msprobe's single-point save (PyNative): level ``debug`` writes debug.json and nothing else, counts
    repeated names and saves the tensors' gradients."""
    PrecisionDebugger(dump_path=str(tmp_path / "d"), level="debug", task="tensor")
    net = M.TinyNet()
    x = ms.Tensor(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32))

    def forward(v):
        h = v * 2.0
        PrecisionDebugger.save({"h": h, "n": 3, "l": [h + 1.0, "s"]}, "var")
        PrecisionDebugger.save(h, "single")
        return (h * h).sum()

    PrecisionDebugger.start(net)  # level debug hooks nothing
    for _ in range(2):
        ms.value_and_grad(forward)(x)
        net(ms.Tensor(np.ones((1, M.IN), np.float32)))
    PrecisionDebugger.stop()
    PrecisionDebugger.step()
    folder = rank_dir(tmp_path / "d")
    assert not (folder / "dump.json").exists()
    doc = read(folder / "debug.json")
    assert (doc["level"], doc["framework"], doc["task"]) == ("debug", "mindspore", "tensor")
    data = doc["data"]
    assert set(data) == {f"{k}.{n}.debug" for k in ("var", "single", "var_grad", "single_grad") for n in (0, 1)}
    assert data["var.0.debug"]["n"] == {"type": "int", "value": 3}
    assert data["var.1.debug"]["l"][1] == {"type": "str", "value": "s"}
    assert data["single.1.debug"]["Max"] == 8.0
    assert data["var_grad.0.debug"]["h"]["Max"] == 16.0  # d(sum(h*h))/dh = 2h
    saved = data["var.0.debug"]["l"][0]["data_name"]
    assert saved == "var.0.debug.l.0.npy"
    assert np.array_equal(np.load(folder / "dump_tensor_data" / saved), np.array([[3.0, 5.0, 7.0, 9.0]], np.float32))


def test_module_dump_dumps_one_cell_alone(tmp_path):
    net = M.TinyNet()
    x = ms.Tensor(M.data(1)[0][0])
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    dbg.start()
    module_dump(net.block, "blk")
    net(x)
    module_dump_end()
    mint.add(x, x)
    dbg.stop()
    dbg.step()
    data = read(rank_dir(tmp_path / "d") / "dump.json")["data"]
    assert set(data) == {"Cell.blk.Block.forward.0", "Mint.add.0.forward"}
    assert data["Cell.blk.Block.forward.0"]["output"][0]["shape"] == [M.BATCH, M.SEQ, M.DIM]
