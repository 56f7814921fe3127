"""The MindSpore dump on real MindSpore (CPU, PyNative): a small network with linear layers, LayerNorm, relu
and attention trained a few steps with ``value_and_grad``; records, names and statistics checked against
values computed independently (NumPy), tensor files read back with NumPy, numbers unchanged."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

import ms_models as M  # noqa: E402  (tests/support is on sys.path)
from dump_walk import saved_summaries  # noqa: E402
from mindspore import mint, nn, ops  # noqa: E402

from msprobe_core.errors import ConfigError, DumpPathError, TokenRangeError  # noqa: E402
from msprobe_core.mindspore import PrecisionDebugger, seed_all  # noqa: E402
from msprobe_core.mindspore import tensor_stats  # noqa: E402
from msprobe_core.mindspore.summarize import Summarizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _fresh_ms_debugger():
    PrecisionDebugger.reset()
    yield
    PrecisionDebugger.reset()


@pytest.fixture(scope="module")
def baseline():
    """Losses and gradients of 2 steps without the tool."""
    net, opt, grad_fn = M.build()
    return M.train(net, opt, grad_fn, M.data(2))


def run(dump_path: Path, config: dict, steps: int = 2, model=lambda net: net, **start_kwargs):
    """Train TinyNet ``steps`` steps with the dump around each step; returns (losses, grads, net)."""
    net, opt, grad_fn = M.build()
    dbg = PrecisionDebugger({"dump_path": str(dump_path), **config})
    target = model(net)
    losses, grads = M.train(net, opt, grad_fn, M.data(steps), before=lambda i: dbg.start(target, **start_kwargs),
                            after=lambda i: (dbg.stop(), dbg.step()))
    return losses, grads, net


def load(dump_path: Path, step: int = 0) -> tuple[dict, dict, dict, Path]:
    """(dump.json, construct.json, stack.json, rank folder) of a step's only rank folder."""
    (rank_dir,) = [Path(p) for p in glob.glob(f"{dump_path}/step{step}/*")]
    read = lambda n: json.loads((rank_dir / n).read_text())  # noqa: E731
    return read("dump.json"), read("construct.json"), read("stack.json"), rank_dir


def stats(a: np.ndarray) -> tuple[float, float, float, float]:
    a = np.asarray(a, dtype=np.float64)
    return a.max(), a.min(), a.mean(), float(np.sqrt((a * a).sum()))


def assert_stats(summary: dict, expected: np.ndarray, rel: float = 1e-5) -> None:
    got = (summary["Max"], summary["Min"], summary["Mean"], summary["Norm"])
    assert got == pytest.approx(stats(expected), rel=rel, abs=1e-6), summary


CELLS = ["embed.Linear", "block.Block", "block.norm1.LayerNorm", "block.attn.Attention", "block.attn.q.Linear",
         "block.attn.k.Linear", "block.attn.v.Linear", "block.attn.proj.Linear", "block.norm2.LayerNorm",
         "block.fc1.Linear", "block.fc2.Linear", "head.Linear"]


# ----------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("level,task,mode", [("L0", "statistics", "statistics"), ("L1", "statistics", "statistics"),
                                             ("mix", "tensor", "statistics"), ("mix", "statistics", "md5"),
                                             ("L1", "structure", "statistics"), ("mix", "overflow_check", "statistics")])
def test_losses_and_gradients_bit_identical(tmp_path, baseline, level, task, mode):
    losses, grads, _ = run(tmp_path / "d", {"level": level, "task": task, task: {"summary_mode": mode}})
    ref_losses, ref_grads = baseline
    assert [l.tobytes() for l in losses] == [l.tobytes() for l in ref_losses]
    for step, ref in zip(grads, ref_grads):
        assert [g.tobytes() for g in step] == [g.tobytes() for g in ref]


# ----------------------------------------------------------------------------------------- L0
def test_l0_records_names_and_statistics(tmp_path):
    net, opt, grad_fn = M.build()
    weights = M.weights_of(net)  # step 0's weights: the reference forward uses them
    (x, y), = M.data(1)
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    dbg.start(net)
    loss, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
    dbg.stop()
    dbg.step()
    dump, construct, stack, rank_dir = load(tmp_path / "d")
    assert rank_dir.name == f"proc{os.getpid()}"
    assert (dump["task"], dump["level"], dump["framework"]) == ("statistics", "L0", "mindspore")
    data = dump["data"]
    forward = [f"Cell.{c}.forward.0" for c in CELLS]
    assert [k for k in data if ".forward." in k] == forward  # execution order
    assert {k for k in data if ".backward." in k} == {f"Cell.{c}.backward.0" for c in CELLS}
    with_params = [c for c in CELLS if c.endswith(("Linear", "LayerNorm"))]
    assert {k for k in data if ".parameters_grad." in k} == {f"Cell.{c}.parameters_grad.0" for c in with_params}

    ref = M.numpy_forward(weights, x)
    for path in ("embed", "block.norm1", "block.attn", "block.fc1", "block", "head"):
        (name,) = [k for k in forward if k.startswith(f"Cell.{path}.") and k.count(".") == path.count(".") + 4]
        out = data[name]["output"][0]
        assert (out["type"], out["dtype"], out["shape"]) == ("mindspore.Tensor", "Float32", list(ref[path].shape))
        assert_stats(out, ref[path], rel=1e-4)
    fc1 = data["Cell.block.fc1.Linear.forward.0"]
    assert_stats(fc1["parameters"]["weight"], weights["block.fc1.weight"])
    assert fc1["parameters"]["weight"]["requires_grad"] is True
    assert_stats(fc1["input_args"][0], ref["block.norm2"], rel=1e-4)
    # d loss / d head output = 2 (out - y) / N: the head's backward input
    dout = 2 * (ref["head"] - y) / y.size
    assert_stats(data["Cell.head.Linear.backward.0"]["input"][0], dout, rel=1e-4)
    # parameter gradients as value_and_grad returned them
    by_name = dict(zip([p.name for p in opt.parameters], grads))
    pgrad = data["Cell.block.norm1.LayerNorm.parameters_grad.0"]
    assert set(pgrad) == {"gamma", "beta"}
    assert_stats(pgrad["gamma"][0], by_name["block.norm1.gamma"].asnumpy())
    assert_stats(data["Cell.embed.Linear.parameters_grad.0"]["weight"][0], by_name["embed.weight"].asnumpy())

    assert construct["Cell.block.fc1.Linear.forward.0"] == "Cell.block.Block.forward.0"
    assert construct["Cell.block.attn.q.Linear.forward.0"] == "Cell.block.attn.Attention.forward.0"
    assert construct["Cell.block.attn.q.Linear.backward.0"] == "Cell.block.attn.Attention.backward.0"
    assert construct["Cell.embed.Linear.forward.0"] is None
    assert any("ms_models.py" in line and "construct" in line for line in stack["Cell.block.fc1.Linear.forward.0"])
    own = f"File {ROOT / 'msprobe_core'}{os.sep}"  # the toolkit's own frames are left out
    assert not any(line.startswith(own) for frames in stack.values() for line in frames)


def test_list_of_cells_is_indexed(tmp_path):
    run(tmp_path / "d", {"level": "L0"}, steps=1, model=lambda net: [net.block])
    data = load(tmp_path / "d")[0]["data"]
    assert "Cell.0.attn.q.Linear.forward.0" in data and "Cell.0.fc1.Linear.backward.0" in data
    assert not any(k.startswith(("Cell.embed", "Cell.head", "Cell.0.Block")) for k in data)


# ----------------------------------------------------------------------------------------- L1, mix
def test_l1_api_names_with_msprobe_prefixes(tmp_path):
    run(tmp_path / "d", {"level": "L1"}, steps=1)
    data = load(tmp_path / "d")[0]["data"]
    for name in ("Mint.matmul.0", "Mint.matmul.1", "MintFunctional.softmax.0", "MintFunctional.relu.0",
                 "Tensor.transpose.0", "Tensor.__mul__.0", "Tensor.__add__.0", "Tensor.__sub__.0",
                 "Tensor.__pow__.0", "Tensor.mean.0", "Primitive.dense.Dense.0", "Primitive.dense.Dense.7",
                 "Primitive.layer_norm.LayerNorm.1"):
        assert f"{name}.forward" in data and f"{name}.backward" in data, name
    assert not any(k.startswith("Cell.") for k in data)
    relu = data["MintFunctional.relu.0.forward"]
    assert relu["output"][0]["Min"] == 0.0 and relu["input_args"][0]["shape"] == [M.BATCH, M.SEQ, 2 * M.DIM]
    softmax = data["MintFunctional.softmax.0.forward"]
    assert softmax["input_kwargs"] == {"dim": {"type": "int", "value": -1}}
    assert softmax["output"][0]["Max"] <= 1.0 and softmax["output"][0]["Mean"] == pytest.approx(1 / M.SEQ, rel=1e-5)
    mean_bwd = data["Tensor.mean.0.backward"]
    assert mean_bwd["input"][0]["Max"] == 1.0 and mean_bwd["input"][0]["shape"] == []


def test_l1_without_model_records_no_primitives_and_ops_are_functional(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    x = ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) - 2)
    matmul = ops.MatMul()
    dbg.start()
    y = ops.matmul(x, x.T)
    z = ops.relu(y)
    w = matmul(z, z)  # a primitive called directly, without a model: not recorded
    dbg.stop()
    dbg.step()
    data = load(tmp_path / "d")[0]["data"]
    assert "Functional.matmul.0.forward" in data and "Functional.relu.0.forward" in data
    assert not any(k.startswith("Primitive.") for k in data)
    assert_stats(data["Functional.relu.0.forward"]["output"][0], np.maximum(x.asnumpy() @ x.asnumpy().T, 0))
    assert w.shape == (2, 2)


def test_mix_nests_apis_in_cells(tmp_path):
    run(tmp_path / "d", {"level": "mix"}, steps=1)
    dump, construct, _, _ = load(tmp_path / "d")
    assert dump["level"] == "mix"
    assert construct["MintFunctional.relu.0.forward"] == "Cell.block.Block.forward.0"
    assert construct["Primitive.dense.Dense.5.forward"] == "Cell.block.fc1.Linear.forward.0"
    assert construct["Mint.matmul.0.forward"] == "Cell.block.attn.Attention.forward.0"
    assert construct["Mint.matmul.0.backward"] == "Cell.block.attn.Attention.backward.0"


@ms.jit
def _jit_scaled_relu(x, w):
    return ops.relu(ops.matmul(x, w)) * 2


def test_jit_calls_are_one_record_each(tmp_path):
    w = ms.Parameter(ms.Tensor(np.random.RandomState(0).randn(4, 2).astype(np.float32)), name="w")
    x = ms.Tensor(np.random.RandomState(1).randn(3, 4).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda x: _jit_scaled_relu(x, w).sum(), None, [w])
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1"})
    dbg.start()
    _, (grad,) = grad_fn(x)
    dbg.stop()
    dbg.step()
    data = load(tmp_path / "d")[0]["data"]
    assert list(data) == ["Jit._jit_scaled_relu.0.forward", "Tensor.sum.0.forward", "Tensor.sum.0.backward",
                          "Jit._jit_scaled_relu.0.backward"]
    jit = data["Jit._jit_scaled_relu.0.forward"]
    assert_stats(jit["output"][0], np.maximum(x.asnumpy() @ w.asnumpy(), 0) * 2)
    assert_stats(data["Jit._jit_scaled_relu.0.backward"]["output"][1], grad.asnumpy())


# ----------------------------------------------------------------------------------------- tasks
def test_tensor_files_load_with_numpy_and_match_statistics(tmp_path):
    run(tmp_path / "d", {"level": "mix", "task": "tensor"}, steps=1)
    dump, _, _, rank_dir = load(tmp_path / "d")
    tensor_dir = rank_dir / "dump_tensor_data"
    assert dump["dump_data_dir"] == str(tensor_dir.absolute())
    names = []
    for summary in saved_summaries(dump["data"]):
        names.append(summary["data_name"])
        arr = np.load(tensor_dir / summary["data_name"], allow_pickle=False)
        assert list(arr.shape) == summary["shape"] and arr.dtype == np.float32
        assert_stats(summary, arr)
    assert len(names) == len(set(names)) > 100
    assert sorted(names) == sorted(os.listdir(tensor_dir))
    assert "Cell.block.fc1.Linear.forward.0.parameters.weight.npy" in names
    assert "MintFunctional.relu.0.backward.output.0.npy" in names
    assert "Cell.block.norm1.LayerNorm.parameters_grad.0.gamma.npy" in names


def test_md5_is_the_crc32_of_the_tensor_bytes(tmp_path):
    net, _, _ = M.build()
    weight = net.block.fc1.weight.asnumpy().copy()
    run(tmp_path / "d", {"level": "L0", "statistics": {"summary_mode": "md5"}}, steps=1)
    param = load(tmp_path / "d")[0]["data"]["Cell.block.fc1.Linear.forward.0"]["parameters"]["weight"]
    assert param["md5"] == "%08x" % zlib.crc32(weight.tobytes())
    assert param["Max"] == pytest.approx(float(weight.max()))


def test_structure_task_has_no_statistics(tmp_path):
    run(tmp_path / "d", {"level": "L0", "task": "structure"}, steps=1)
    out = load(tmp_path / "d")[0]["data"]["Cell.head.Linear.forward.0"]["output"][0]
    assert out["Max"] is None and out["shape"] == [M.BATCH, M.SEQ, M.OUT]


def test_overflow_check_keeps_only_calls_with_inf_or_nan(tmp_path):
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L1", "task": "overflow_check",
                             "overflow_check": {"overflow_nums": -1}})
    x = ms.Tensor(np.array([1.0, 2.0, 3.0e38], np.float32))
    dbg.start()
    y = mint.add(x, x)      # 6e38 overflows float32: Inf
    z = mint.mul(x, 0.5)    # finite
    w = mint.sqrt(mint.neg(x))  # NaN
    dbg.stop()
    dbg.step()
    data = load(tmp_path / "d")[0]["data"]
    assert set(data) == {"Mint.add.0.forward", "Mint.sqrt.0.forward"}
    assert data["Mint.add.0.forward"]["output"][0]["Max"] == float("inf")
    assert np.isinf(y.asnumpy()).any() and np.isfinite(z.asnumpy()).all() and np.isnan(w.asnumpy()).any()


# ----------------------------------------------------------------------------------------- config keys
@pytest.mark.slow
def test_list_scope_data_mode_step_and_rank(tmp_path):
    run(tmp_path / "list", {"level": "L1", "statistics": {"list": ["relu"]}}, steps=1)
    assert set(load(tmp_path / "list")[0]["data"]) == {"MintFunctional.relu.0.forward", "MintFunctional.relu.0.backward"}
    PrecisionDebugger.reset()
    run(tmp_path / "fwd", {"level": "L0", "statistics": {"data_mode": ["forward"]}}, steps=1)
    data = load(tmp_path / "fwd")[0]["data"]
    assert data and all(".forward." in k for k in data)
    PrecisionDebugger.reset()
    run(tmp_path / "scope", {"level": "L0", "statistics": {"scope": ["Cell.block.norm2.LayerNorm.forward.0",
                                                                      "Cell.block.fc2.Linear.forward.0"]}}, steps=1)
    fwd = [k for k in load(tmp_path / "scope")[0]["data"] if ".forward." in k]
    assert fwd == ["Cell.block.norm2.LayerNorm.forward.0", "Cell.block.fc1.Linear.forward.0",
                   "Cell.block.fc2.Linear.forward.0"]
    PrecisionDebugger.reset()
    run(tmp_path / "step", {"level": "L0", "step": [1]}, steps=3)
    assert sorted(os.listdir(tmp_path / "step")) == ["step1"]
    PrecisionDebugger.reset()
    run(tmp_path / "rank", {"level": "L0", "rank": [1]}, steps=1, rank_id=0)
    assert not (tmp_path / "rank").exists()
    PrecisionDebugger.reset()
    run(tmp_path / "rank1", {"level": "L0", "rank": [1]}, steps=1, rank_id=1)
    assert os.listdir(tmp_path / "rank1" / "step0") == ["rank1"]


def test_async_dump_and_tensor_list(tmp_path):
    run(tmp_path / "a", {"level": "L1", "async_dump": True, "statistics": {"tensor_list": ["relu"]}}, steps=1)
    PrecisionDebugger.reset()  # async_dump: step() does not wait for the writer process; close() does
    dump, _, _, rank_dir = load(tmp_path / "a")
    saved = sorted(os.listdir(rank_dir / "dump_tensor_data"))
    assert saved and all(name.startswith("MintFunctional.relu.0.") for name in saved)
    assert "data_name" not in dump["data"]["Mint.matmul.0.forward"]["output"][0]
    relu = dump["data"]["MintFunctional.relu.0.forward"]["output"][0]
    assert_stats(relu, np.load(rank_dir / "dump_tensor_data" / relu["data_name"]))


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="'level' = 'L3'"):
        PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L3"})
    with pytest.raises(ConfigError, match="unknown key 'levl'; did you mean 'level'"):
        PrecisionDebugger({"dump_path": str(tmp_path / "d"), "levl": "L0"})
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    with pytest.raises(ConfigError, match="'model' = None.*mindspore.nn.Cell"):
        dbg.start()
    with pytest.raises(ConfigError, match="'model' = 'int'"):
        dbg.start(3)
    with pytest.raises(TokenRangeError):
        dbg.start(M.TinyNet(), token_range=[3, 1])
    assert not (tmp_path / "d").exists()  # nothing half-written


def test_never_overwrites_another_runs_dump(tmp_path):
    run(tmp_path / "d", {"level": "L0"}, steps=1)
    PrecisionDebugger.reset()
    net = M.TinyNet()
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    with pytest.raises(DumpPathError, match="never overwrites"):
        dbg.start(net)


def test_class_level_calls_and_token_range(tmp_path):
    net = M.TinyNet()
    PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "L0"})
    x = ms.Tensor(M.data(1)[0][0])
    PrecisionDebugger.start(net, token_range=[1, 2])  # class-level call (cross-file usage)
    for _ in range(4):  # prefill + 3 decode steps
        net(x)
    PrecisionDebugger.stop()
    PrecisionDebugger.step()
    heads = sorted(k for k in load(tmp_path / "d")[0]["data"] if k.startswith("Cell.head"))
    assert heads == ["Cell.head.Linear.forward.0", "Cell.head.Linear.forward.1"]


# ----------------------------------------------------------------------------------------- restore
def test_stop_restores_every_patched_attribute(tmp_path):
    owners = [ops, mint, mint.nn.functional, ms.Tensor]
    before = [dict(vars(o)) for o in owners]
    net = M.TinyNet()
    prim_classes = {id(c): type(c.dense) for _, c in net.cells_and_names() if hasattr(c, "dense")}
    dbg = PrecisionDebugger({"dump_path": str(tmp_path / "d"), "level": "mix"})
    dbg.start(net)
    assert ops.matmul is not before[0]["matmul"] and type(net.head.dense) is not prim_classes[id(net.head)]
    dbg.stop()
    for owner, saved in zip(owners, before):
        now = dict(vars(owner))
        assert now.keys() == saved.keys() and all(now[k] is saved[k] for k in saved), owner
    assert {id(c): type(c.dense) for _, c in net.cells_and_names() if hasattr(c, "dense")} == prim_classes
    t = ms.Tensor(np.ones(3, np.float32))
    assert float((t + t).sum()) == 6.0 and (t * 2).asnumpy().tolist() == [2.0, 2.0, 2.0]


# ----------------------------------------------------------------------------------------- statistics
def test_statistics_paths_agree_without_norm_kernels(monkeypatch, tmp_path):
    """Host kernel, NumPy and the deferred device path give the same statistics, and none of them needs
    the LinalgVectorNorm kernel that MindSpore's CPU backend lacks."""
    def no_kernel(*args, **kwargs):
        raise RuntimeError("The kernel LinalgVectorNorm unregistered")

    for owner, name in ((mint, "norm"), (mint.linalg, "vector_norm"), (ops, "norm")):
        monkeypatch.setattr(owner, name, no_kernel)
    rng = np.random.RandomState(3)
    arrays = [rng.randn(7, 9).astype(np.float32), rng.randn(300).astype(np.float64),
              rng.randint(-5, 5, size=(4, 4)).astype(np.int32), (rng.randn(5) > 0)]
    transposed = ms.Tensor(arrays[0]).transpose(1, 0)  # a view: read in place, no MindSpore kernel
    for a, t in [(a, ms.Tensor(a)) for a in arrays] + [(arrays[0].T, transposed), (arrays[0].T[2:5], transposed[2:5])]:
        kind = tensor_stats.kind_of(t.dtype)
        host = tensor_stats.host_stats(t)
        with monkeypatch.context() as m:
            m.setattr(tensor_stats, "KERNEL", None)  # as with MSPROBE_FAST_STATS=0 or no C compiler
            numpy_only = tensor_stats.host_stats(t)
        device = tensor_stats.rows_to_host([tensor_stats.device_stats(t, kind)])[0]
        assert (tensor_stats.host_array(t) == a).all()
        if kind == "bool":
            assert host[:2] == numpy_only[:2] == device[:2] == (1.0, 0.0) and host[2] == device[2] == a.sum()
            continue
        x = a.astype(np.float64)
        expected = (x.max(), x.min(), x.sum(), (x * x).sum())
        assert host == pytest.approx(expected, rel=1e-6)
        assert numpy_only == pytest.approx(expected, rel=1e-6)
        assert device == pytest.approx(expected, rel=1e-5)
    deferred = Summarizer(statistics=True, md5=False, on_host=False)
    summary = deferred.summarize(ms.Tensor(arrays[0]), None, False)
    assert summary["Max"] is None and deferred.has_pending
    deferred.resolve()
    assert_stats(summary, arrays[0])
    bf16 = ms.Tensor(arrays[0]).astype(ms.bfloat16)
    s = Summarizer(statistics=True, md5=False, on_host=True).summarize(bf16, None, False)
    assert s["dtype"] == "BFloat16" and s["Max"] == pytest.approx(float(arrays[0].max()), rel=1e-2)
    saver = Summarizer(statistics=True, md5=False, on_host=True)
    saver.tensor_dir = tmp_path
    name = saver.summarize(bf16, "bf16", True)["data_name"]
    assert saver.files.flush() == 0  # written by the core's writer process
    saved = np.load(tmp_path / name, allow_pickle=False)
    assert saved.dtype == np.float32 and saved.max() == s["Max"]  # NumPy has no bfloat16: saved as float32


# ----------------------------------------------------------------------------------------- seed_all
def test_seed_all(monkeypatch):
    seed_all(1234)
    a = M.TinyNet().head.weight.asnumpy().copy()
    seed_all(1234)
    assert (M.TinyNet().head.weight.asnumpy() == a).all()
    with pytest.raises(ConfigError, match="'seed'"):
        seed_all(-1)
    with pytest.raises(ConfigError, match="'rm_dropout'"):
        seed_all(1, rm_dropout="yes")
    monkeypatch.setattr(ms, "set_deterministic", lambda flag: None)  # process-wide; not left on for other tests
    seed_all(7, mode=True, rm_dropout=True)
    assert os.environ["HCCL_DETERMINISTIC"] == "true"
    x = ms.Tensor(np.ones((64, 64), np.float32))
    drop = mint.nn.Dropout(p=0.5)
    drop.set_train(True)
    assert (drop(x).asnumpy() == 1).all()
    assert (mint.nn.functional.dropout(x, p=0.9, training=True).asnumpy() == 1).all()
    assert (nn.Dropout(keep_prob=0.5).set_train(True)(x).asnumpy() == 1).all()


# ----------------------------------------------------------------------------------------- crash safety
@pytest.mark.slow
def test_killed_mid_step_loses_no_record(tmp_path):
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests' / 'support')!r})
import mindspore as ms, ms_models as M
from msprobe_core.mindspore import PrecisionDebugger
net, opt, grad_fn = M.build()
(x, y), = M.data(1)
dbg = PrecisionDebugger({{"dump_path": {str(tmp_path / 'd')!r}, "level": "L0"}})
dbg.start(net)
grad_fn(ms.Tensor(x), ms.Tensor(y))
os._exit(9)  # no stop(), no step(): only the journal holds the records
"""
    subprocess.run([sys.executable, "-c", script], check=False, timeout=300)
    (rank_dir,) = glob.glob(f"{tmp_path}/d/step0/*")
    assert not os.path.exists(f"{rank_dir}/dump.json") and os.path.exists(f"{rank_dir}/.dump.journal")
    subprocess.run([sys.executable, "-m", "msprobe_core", "recover", str(tmp_path / "d")], check=True, cwd=ROOT)
    dump = json.loads(Path(rank_dir, "dump.json").read_text())
    assert dump["recovered"] is True and dump["framework"] == "mindspore"
    assert {f"Cell.{c}.forward.0" for c in CELLS} | {f"Cell.{c}.backward.0" for c in CELLS} <= set(dump["data"])
