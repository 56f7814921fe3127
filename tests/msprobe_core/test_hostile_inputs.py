"""Hostile and unusual input at every entry point: it never breaks training or escapes the output folders.

For each case the test asserts one of: a clear error of the project's own type (``MsprobeError``) naming the
problem, or the documented fallback; the training code runs on (bit-identical where it trains); nothing is
written outside the dump path or the monitor folder; and no file is left that looks complete but is not.
Entry points: config files, Python API arguments, user-supplied names, odd tensors, other threads, signals,
a full disk, unwritable or odd output paths, and damaged files fed to ``recover``, ``compare`` and
``anomalies``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import marshal
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dump_models import TinyNet
from killed_run import run_killed_mid_step
from msprobe_core.cli import main as cli_main
from msprobe_core.errors import ConfigError, ConfigFileError, MsprobeError, OutputDirError
from msprobe_core.files import step_recorder
from msprobe_core.files.safe_names import NAME_MAX, TEMP_ROOM, is_plain_file_name, safe_file_name
from msprobe_core.files.step_recorder import StepRecorder, read_frames, replay_journal
from msprobe_core.monitor.trainer_mon import TrainerMon
from msprobe_core.pytorch import PrecisionDebugger, module_dump, module_dump_end, save

ROOT = Path(__file__).resolve().parents[2]
ISSUE_NAME = "../../../../../../../../../../SOMEDIR/x"  # the issue's save() name, verbatim


# ------------------------------------------------------------------------------------------- helpers
def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


@contextlib.contextmanager
def only_written_under(root: Path, *allowed: Path):
    """Fails if a file appears under ``root`` outside the ``allowed`` folders."""
    before = files_under(root)
    yield
    new = {p for p in files_under(root) - before if not any(a == p or a in p.parents for a in allowed)}
    assert not new, f"written outside the output folders: {sorted(map(str, new))}"


def rank_dir(dump: Path, step: int = 0) -> Path:
    return next((dump / f"step{step}").iterdir())


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def leaves(obj):
    """Every tensor summary (a dict with a dtype) inside a record."""
    if isinstance(obj, dict):
        if "dtype" in obj:
            yield obj
        else:
            for v in obj.values():
                yield from leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from leaves(v)


def assert_files_consistent(folder: Path, json_name: str = "dump.json") -> dict:
    """Every data_name of the folder's JSON is a plain file name that exists; no temporary file is left."""
    doc = load(folder / json_name)
    tensor_dir = folder / "dump_tensor_data"
    for record in doc["data"].values():
        for s in leaves(record):
            if "data_name" in s:
                assert is_plain_file_name(s["data_name"]) and (tensor_dir / s["data_name"]).is_file(), s
    assert not list(folder.rglob("*.tmp")), list(folder.rglob("*.tmp"))
    return doc


def debugger(tmp_path: Path, **cfg) -> PrecisionDebugger:
    cfg.setdefault("dump_path", str(tmp_path / "dump"))
    cfg.setdefault("level", "L1")
    return PrecisionDebugger(cfg)


# ------------------------------------------------------------------------------------------- user-supplied names
def test_issue_save_name_with_parent_dirs_writes_inside_the_dump(tmp_path):
    somedir = tmp_path / "SOMEDIR"
    somedir.mkdir()
    dump = tmp_path / "dump"
    dbg = debugger(tmp_path, task="tensor")
    # the same escape aimed at a folder that exists (the issue's name climbs to the file system root)
    tensor_dir_depth = len((dump / "step0" / f"proc{os.getpid()}" / "dump_tensor_data").relative_to(tmp_path).parts)
    aimed = "../" * tensor_dir_depth + "SOMEDIR/x"
    with only_written_under(tmp_path, dump):
        save(torch.ones(2), ISSUE_NAME)
        save(torch.ones(3), aimed)
        dbg.step()
    assert not list(somedir.iterdir()) and not os.path.exists("/SOMEDIR/x.0.debug.pt")
    folder = rank_dir(dump)
    doc = assert_files_consistent(folder, "debug.json")
    assert set(doc["data"]) == {f"{ISSUE_NAME}.0.debug", f"{aimed}.0.debug"}  # the records keep the names
    for key, n in ((f"{ISSUE_NAME}.0.debug", 2), (f"{aimed}.0.debug", 3)):
        name = doc["data"][key]["data_name"]
        assert "/" not in name and torch.equal(torch.load(folder / "dump_tensor_data" / name), torch.ones(n))


HOSTILE_NAMES = ["/etc/abs", "a\x00b", "tab\tnew\nline\x7f", "..", ".", "x" * 400, "名" * 200, "a%2Fb", "a/b",
                 "back\\slash", "\ud800lone"]


def test_every_user_supplied_name_stays_in_the_tensor_folder(tmp_path):
    dump = tmp_path / "dump"
    model = nn.Sequential(nn.Linear(2, 2))
    model.add_module("/etc/passwd" + "y" * 300, nn.ReLU())  # a module's own name (add_module allows '/')
    custom = type(sys)("custom_ops")
    custom.scale = lambda t: t * 2
    dbg = debugger(tmp_path, task="tensor", level="mix")
    with only_written_under(tmp_path, dump):
        dbg.start(model)
        dbg.register_custom_api(custom, "scale", api_prefix="../../../../../escape/" + "z" * 300)
        model(torch.ones(1, 2))
        custom.scale(torch.ones(2))
        for name in HOSTILE_NAMES:
            save(torch.arange(3.0), name)
        module_dump(model[0], "../../../../md/" + "\n" * 3)
        model(torch.ones(1, 2))
        module_dump_end()
        dbg.stop()
        dbg.step()
    folder = rank_dir(dump)
    for json_name in ("dump.json", "debug.json"):
        assert_files_consistent(folder, json_name)
    files = list((folder / "dump_tensor_data").iterdir())
    assert all(len(f.name.encode("utf-8", "surrogatepass")) <= NAME_MAX - TEMP_ROOM for f in files)
    debug = load(folder / "debug.json")["data"]
    assert {f"{n}.0.debug" for n in HOSTILE_NAMES} <= set(debug)  # records keep every name as given
    assert len({debug[f"{n}.0.debug"]["data_name"] for n in HOSTILE_NAMES}) == len(HOSTILE_NAMES)  # no collisions
    names = load(folder / "dump.json")["data"]
    assert any(k.startswith("../../../../../escape/") for k in names)
    assert any(k.startswith("Module.../../../../md/") for k in names)
    assert any("/etc/passwd" in k for k in names)


def test_safe_file_name_rules():
    assert safe_file_name("Functional.relu.0.forward.input.0", ".pt") == "Functional.relu.0.forward.input.0.pt"
    for name in HOSTILE_NAMES + ["", "...", "a" * 10_000]:
        out = safe_file_name(name, ".pt")
        assert is_plain_file_name(out) and out.endswith(".pt") and "\x00" not in out and out.isprintable()
        assert len(out.encode("utf-8", "surrogatepass")) <= NAME_MAX - TEMP_ROOM
    assert safe_file_name("..") not in (".", "..") and safe_file_name(".") != "."
    distinct = ["a/b", "a%2Fb", "a\\b", "a%5Cb", "x" * 300 + "1", "x" * 300 + "2"]
    assert len({safe_file_name(n, ".pt") for n in distinct}) == len(distinct)
    assert len(safe_file_name("y" * 300, ".pt", limit=100).encode()) <= 100 - TEMP_ROOM


# ------------------------------------------------------------------------------------------- odd tensors
@pytest.mark.parametrize("task,mode", [("statistics", "statistics"), ("tensor", "statistics"), ("statistics", "md5")])
def test_building_a_model_on_the_meta_device_during_an_l1_dump(tmp_path, task, mode):
    dbg = debugger(tmp_path, task=task, **{task: {"summary_mode": mode}})
    dbg.start()
    with torch.device("meta"):
        big = nn.Linear(16, 8)
    assert big.weight.is_meta
    big = big.to_empty(device="cpu")
    nn.init.ones_(big.weight)
    nn.init.zeros_(big.bias)  # to_empty leaves the memory as it was: it may hold NaN, which equals nothing
    out = big(torch.ones(2, 16))
    dbg.stop()
    dbg.step()
    assert torch.equal(out, torch.full((2, 8), 16.0))
    folder = rank_dir(tmp_path / "dump")
    data = assert_files_consistent(folder)["data"]
    meta = [s for r in data.values() for s in leaves(r) if s.get("summary") == "unsupported: meta tensor"]
    assert meta and all(s["dtype"] == "torch.float32" and s["shape"] in ([8, 16], [8]) for s in meta)
    assert all(s["Max"] is None and "data_name" not in s for s in meta)
    linear = next(r for k, r in data.items() if k.startswith("Functional.linear"))
    assert linear["output"][0]["Max"] is not None  # real tensors after it are summarised as usual
    assert not (folder / "dump_error_info.log").exists()


def _sparse():
    return torch.eye(3).to_sparse()


def _csr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.eye(3).to_sparse_csr()


def _nested(layout=torch.strided):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in recent torch, still made by older code
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


ODD = {
    "sparse_coo": (_sparse, lambda t: torch.mul(t, 2.0), "unsupported: sparse_coo tensor"),
    "sparse_csr": (_csr, lambda t: torch.mul(t, 2.0), "unsupported: sparse_csr tensor"),
    "nested": (_nested, lambda t: F.relu(t), "unsupported: nested tensor"),
    "jagged": (lambda: _nested(torch.jagged), lambda t: F.relu(t), "unsupported: nested tensor"),
    "quantized": (_quantized, lambda t: F.relu(t), "unsupported: quantized tensor"),
    "meta": (lambda: torch.ones(3, device="meta"), lambda t: torch.mul(t, 2.0), "unsupported: meta tensor"),
}


@pytest.mark.parametrize("kind", sorted(ODD))
def test_a_tensor_the_tool_cannot_summarise_gets_a_record_that_says_so(tmp_path, kind):
    make, use, note = ODD[kind]
    dbg = debugger(tmp_path, task="tensor")
    t = make()
    dbg.start()
    use(t)
    torch.add(torch.ones(2), 1)  # the records after it are whole
    dbg.stop()
    dbg.step()
    folder = rank_dir(tmp_path / "dump")
    data = assert_files_consistent(folder)["data"]
    notes = [s.get("summary") for r in data.values() for s in leaves(r)]
    assert note in notes
    assert data["Torch.add.0.forward"]["output"][0]["Max"] == 2.0
    assert not (folder / "dump_error_info.log").exists()


def test_fake_tensors_of_torch_compile_tracing_are_reported_not_read(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    dbg = debugger(tmp_path)
    dbg.start()
    with FakeTensorMode():
        out = torch.mul(torch.ones(4), 3.0)
    assert out.shape == (4,)
    real = torch.mul(torch.ones(4), 3.0)
    dbg.stop()
    dbg.step()
    data = load(rank_dir(tmp_path / "dump") / "dump.json")["data"]
    notes = [s.get("summary") for r in data.values() for s in leaves(r)]
    assert "unsupported: fake tensor (torch.compile tracing)" in notes
    assert torch.equal(real, torch.full((4,), 3.0))
    assert any(s.get("Max") == 3.0 for r in data.values() for s in leaves(r))


@pytest.mark.slow
def test_torch_compile_under_an_l1_dump_keeps_the_numbers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    ref = model(x).sum()
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")
    dbg = debugger(tmp_path)
    dbg.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(x).sum()
    out.backward()
    dbg.stop()
    dbg.step()
    assert torch.equal(out, ref) and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
    assert not (rank_dir(tmp_path / "dump") / "dump_error_info.log").exists()


def test_lazy_modules_and_float8_and_complex(tmp_path):
    model = nn.Sequential(nn.LazyLinear(3))
    dbg = debugger(tmp_path, level="mix")
    dbg.start(model)
    model(torch.ones(2, 4))  # the lazy module's parameters are made in its own pre-hook, then recorded
    save(nn.parameter.UninitializedParameter(), "lazy_param")  # one that is still uninitialised
    torch.clone(torch.ones(4).to(torch.float8_e4m3fn))  # float8: summarised in float32
    torch.mul(torch.ones(3, dtype=torch.complex64), 2)  # complex: summarised by magnitude
    dbg.stop()
    dbg.step()
    folder = rank_dir(tmp_path / "dump")
    data = assert_files_consistent(folder)["data"]
    assert data["Module.0.LazyLinear.forward.0"]["parameters"]["weight"]["shape"] == [3, 4]
    lazy = load(folder / "debug.json")["data"]["lazy_param.0.debug"]
    assert lazy["summary"] == "unsupported: uninitialized parameter (lazy module)" and lazy["shape"] is None
    f8 = data["Torch.clone.0.forward"]
    assert f8["input_args"][0]["dtype"] == "torch.float8_e4m3fn" and f8["input_args"][0]["Max"] == 1.0
    cplx = data["Torch.mul.0.forward"]
    assert cplx["output"][0]["Max"] == 2.0
    assert not (folder / "dump_error_info.log").exists()


class _NoKernels(torch.Tensor):
    """A tensor subclass whose every operation fails (a device or library the tool knows nothing of)."""

    @staticmethod
    def __new__(cls, device):
        return torch.Tensor._make_wrapper_subclass(cls, (2, 3), dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("no kernels here")


@pytest.mark.parametrize("task,mode", [("tensor", "statistics"), ("statistics", "md5")])
@pytest.mark.parametrize("device,note", [("xla", "unsupported: tensor on device 'xla'"),
                                         ("cpu", "unsupported: no")])
def test_tensors_of_unknown_devices_and_failing_subclasses(tmp_path, device, note, task, mode):
    dbg = debugger(tmp_path, task=task, **{task: {"summary_mode": mode}})
    dbg.start()
    save(_NoKernels(device), "odd")
    save(torch.ones(2), "fine")
    dbg.stop()
    dbg.step()
    folder = rank_dir(tmp_path / "dump")
    debug = assert_files_consistent(folder, "debug.json")["data"]
    assert debug["odd.0.debug"]["summary"].startswith(note) and debug["odd.0.debug"]["shape"] == [2, 3]
    assert debug["fine.0.debug"]["Max"] == 1.0


def test_statistics_that_cannot_reach_the_host_cost_only_their_own_summary():
    from msprobe_core.pytorch.summarize import Summarizer
    from msprobe_core.pytorch.tensor_stats import summary_stats

    s = Summarizer(statistics=True, md5=False)
    good, bad = {"dtype": "torch.float32"}, {"dtype": "torch.float32"}
    with torch.no_grad():
        s._pending.append((good, summary_stats(torch.ones(3, dtype=torch.float64), "float"), "float", 3))
        s._pending.append((bad, summary_stats(torch.ones(3, device="meta"), "float"), "float", 3))
        s.resolve()
    assert good["Max"] == 1.0 and good["Norm"] == pytest.approx(math.sqrt(3))
    assert bad["summary"].startswith("unsupported: statistics could not be read")


def test_overflow_check_with_meta_tensors(tmp_path):
    dbg = debugger(tmp_path, task="overflow_check")
    dbg.start()
    with torch.device("meta"):
        nn.Linear(4, 4)
    torch.div(torch.ones(2), 0)
    dbg.stop()
    dbg.step()
    data = load(rank_dir(tmp_path / "dump") / "dump.json")["data"]
    assert list(data) == ["Torch.div.0.forward"]


def test_monitor_reads_sparse_gradients(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(self.emb(x))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon({"targets": {}, "wg_distribution": True, "format": "api", "ops": ["max", "norm", "zeros"]},
                     output_dir=tmp_path / "mon")
    mon.set_monitor(model, optimizer=opt)
    model(torch.tensor([1, 2, 3])).sum().backward()
    dense = model.emb.weight.grad.to_dense()
    opt.step()
    grads = mon.get_metrics()["metrics"]["grad"]
    mon.close()
    assert math.isclose(grads["emb.weight"]["norm"], float(dense.norm()), rel_tol=1e-5)
    assert grads["emb.weight"]["max"] == float(dense.max())
    assert grads["emb.weight"]["zeros"] == pytest.approx(float((dense == 0).float().mean()))
    assert "lin.weight" in grads  # the dense gradients of the same step are there too


# ------------------------------------------------------------------------------------------- threads
def _train_with_threads(tmp_path: Path, threads: int, out: str, level: str = "L1"):
    torch.manual_seed(0)
    model = TinyNet()
    x = torch.randn(4, 8)
    stop = threading.Event()

    def busy(i):
        y = torch.ones(32) * i
        while not stop.is_set():
            y = torch.relu(y * 1.0001)
            model.block(torch.ones(1, 4))  # the same modules the main thread runs
            save(y, f"thread{i}")  # save() from another thread: not recorded either

    dbg = PrecisionDebugger({"dump_path": str(tmp_path / out), "level": level})
    workers = [threading.Thread(target=busy, args=(i,), name=f"busy{i}") for i in range(threads)]
    dbg.start(model)
    for w in workers:
        w.start()
    losses = []
    for _ in range(20):
        loss = model(x).sum()
        loss.backward()
        losses.append(loss.item())
        save(loss, "loss")
    stop.set()
    for w in workers:
        w.join()
    dbg.stop()
    dbg.step()
    PrecisionDebugger.reset()
    return losses, rank_dir(tmp_path / out)


@pytest.mark.parametrize("level", ["L1", "mix"])
def test_four_threads_doing_torch_ops_during_a_dump(tmp_path, caplog, level):
    ref_losses, ref_dir = _train_with_threads(tmp_path, 0, "alone", level)
    with caplog.at_level(logging.INFO, logger="msprobe_core"):
        losses, folder = _train_with_threads(tmp_path, 4, "threads", level)
    assert losses == ref_losses
    assert not (folder / "dump_error_info.log").exists()
    for json_name in ("dump.json", "debug.json"):
        ours, alone = load(folder / json_name), load(ref_dir / json_name)
        assert list(ours["data"]) == list(alone["data"])  # the main thread's records, complete and in order
        assert ours["data"] == alone["data"]
    text = caplog.text
    assert all(f"thread 'busy{i}'" in text for i in range(4)) and "not dumped" in text


def test_journal_appends_from_many_threads_stay_whole_and_ordered(tmp_path):
    rec = StepRecorder(tmp_path / "rank0", {"task": "statistics", "level": "L1"})
    per_thread = 300

    def work(t):
        for i in range(per_thread):
            name = f"T{t}.op.{i}.forward"
            rec.put(name, {"input_args": [], "input_kwargs": {}, "output": [{"type": "int", "value": i}]},
                    rec.reserve(name))
            rec.put_parent(name, None)
            rec.sync_journal()

    workers = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rec.sync_journal()
    _, _, data, _, construct = replay_journal(read_frames(rec.journal_path.read_bytes()))
    assert len(data) == len(construct) == 4 * per_thread
    for t in range(4):  # each thread's records in its own order
        mine = [k for k in data if k.startswith(f"T{t}.")]
        assert mine == [f"T{t}.op.{i}.forward" for i in range(per_thread)]
    rec.finish()
    assert len(load(tmp_path / "rank0" / "dump.json")["data"]) == 4 * per_thread


# ------------------------------------------------------------------------------------------- output paths
def test_monitor_output_dir_that_is_a_file_fails_at_set_monitor(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for target in (blocker, blocker / "under", "/proc/msprobe-hostile/out"):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(target))
        mon = TrainerMon({"targets": {}, "wg_distribution": True, "format": "csv"})
        with pytest.raises(OutputDirError, match="MONITOR_OUTPUT_DIR") as e:
            mon.set_monitor(nn.Linear(2, 2))
        assert isinstance(e.value, MsprobeError) and str(target) in str(e.value)
        mon.close()
    mon = TrainerMon({"targets": {}, "wg_distribution": True, "format": "csv"}, output_dir="bad\x00name")
    with pytest.raises(OutputDirError, match="NUL"):  # no environment variable holds a NUL: the argument can
        mon.set_monitor(nn.Linear(2, 2))
    mon.close()
    assert blocker.read_text() == "not a folder"


def test_monitor_folder_is_the_only_place_it_writes(tmp_path):
    out = tmp_path / "mon"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with only_written_under(tmp_path, out):
        mon = TrainerMon({"targets": {}, "xy_distribution": True, "wg_distribution": True, "format": "csv",
                          "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
                                    "dump": True}}, output_dir=out)
        mon.set_monitor(model, optimizer=opt)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.close()
    assert list(out.rglob("*.csv"))


@pytest.mark.parametrize("where", ["under_a_file", "proc", "nul"])
def test_dump_path_that_cannot_be_written(tmp_path, where):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    path = {"under_a_file": str(blocker / "d"), "proc": "/proc/msprobe-hostile/d", "nul": "d\x00x"}[where]
    with pytest.raises(MsprobeError, match="dump_path") as e:
        dbg = PrecisionDebugger({"dump_path": path, "level": "L1"})
        dbg.start()  # the config accepts what it cannot see yet; start() checks the folder
    assert isinstance(e.value, (ConfigError, OutputDirError))
    PrecisionDebugger.reset()
    assert torch.relu(torch.ones(1)).item() == 1.0  # torch is left unpatched
    assert blocker.read_text() == "x"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"),
                    reason="mounting a read-only file system needs root")
def test_dump_path_on_a_read_only_file_system(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("mount is not permitted here")
    try:
        dbg = PrecisionDebugger({"dump_path": str(ro / "d"), "level": "L1"})
        with pytest.raises(OutputDirError, match="dump_path.*Read-only file system"):
            dbg.start()
    finally:
        subprocess.run(["umount", str(ro)], check=False)


# ------------------------------------------------------------------------------------------- config files and API arguments
def _bad_config(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"config_{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(65 << 20)  # sparse: no disk used
    elif kind == "array":
        path.write_text("[1, 2]")
    elif kind == "empty":
        path.write_text("")
    elif kind == "missing":
        pass
    elif kind == "nul":
        return str(path) + "\x00x"
    return str(path)


@pytest.mark.parametrize("kind", ["fifo", "directory", "deep", "binary", "huge", "array", "empty", "missing", "nul"])
def test_config_files_that_are_not_json_objects(tmp_path, kind):
    path = _bad_config(tmp_path, kind)
    with pytest.raises(ConfigFileError) as e:
        PrecisionDebugger(path)
    assert "config file" in str(e.value) and path.split("\x00")[0] in str(e.value)
    with pytest.raises(ConfigFileError):
        TrainerMon(path)


@pytest.mark.parametrize("call,field", [
    (lambda d: d.start(model="model"), "model"),
    (lambda d: d.start(model=nn.Linear(1, 1), token_range=[2, 1]), "token_range"),
    (lambda d: d.start(model=nn.Linear(1, 1), rank_id=-3), "rank_id"),
    (lambda d: d.set_init_step(-1), "step"),
    (lambda d: d.save(torch.ones(1), name=3), "name"),
    (lambda d: d.save(torch.ones(1), name=""), "name"),
    (lambda d: d.register_custom_api(torch, "no_such_api"), "api"),
    (lambda d: module_dump("not a module", "x"), "module"),
])
def test_bad_python_api_arguments(tmp_path, call, field):
    dbg = debugger(tmp_path)
    with pytest.raises(ConfigError, match=f"'{field}'"):
        call(dbg)
    dbg.stop()
    assert not (tmp_path / "dump" / "step0").exists()


@pytest.mark.parametrize("kwargs,field", [({"grad_acc_steps": 0}, "grad_acc_steps"), ({"start_iteration": -1},
                                          "start_iteration"), ({"model": []}, "model")])
def test_bad_monitor_arguments(tmp_path, kwargs, field):
    mon = TrainerMon({"targets": {}, "wg_distribution": True, "format": "csv"}, output_dir=tmp_path / "m")
    args = {"model": nn.Linear(1, 1), **kwargs}
    with pytest.raises(ConfigError, match=field):
        mon.set_monitor(**args)
    mon.close()


# ------------------------------------------------------------------------------------------- signals
def test_sigterm_mid_step_keeps_what_was_recorded_and_recover_rebuilds_it(tmp_path):
    with only_written_under(tmp_path, tmp_path / "dump"):
        proc, out = run_killed_mid_step(tmp_path, "SIGTERM")
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    step0, step1 = rank_dir(out, 0), rank_dir(out, 1)
    assert not (step1 / "dump.json").exists() and (step1 / ".dump.journal").exists()  # nothing looks finished
    assert cli_main(["recover", str(out)]) == 0
    recovered = assert_files_consistent(step1)
    assert recovered["recovered"] is True
    assert list(recovered["data"]) == list(load(step0 / "dump.json")["data"])


def test_sigint_mid_step_writes_the_step_marked_interrupted(tmp_path):
    proc, out = run_killed_mid_step(tmp_path, "SIGINT")
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    step1 = rank_dir(out, 1)
    doc = assert_files_consistent(step1)
    assert doc["interrupted"] is True and not (step1 / ".dump.journal").exists()
    assert "interrupted" not in load(rank_dir(out, 0) / "dump.json")
    assert list(doc["data"]) == list(load(rank_dir(out, 0) / "dump.json")["data"])


# ------------------------------------------------------------------------------------------- a full disk
@contextlib.contextmanager
def small_file_system(tmp_path: Path, mount: bool, size: str = "4m"):
    """A tmpfs of ``size`` at tmp_path/small when ``mount`` and mounting is permitted; else None (the caller
    injects the faults instead)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = (mount and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount") is not None
               and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                  capture_output=True).returncode == 0)
    try:
        yield mnt if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _train(model, steps):
    """Plain SGD steps (the input of step i is seeded with i, so a run may be split in parts)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Enospc:
    """Fault injection where no small file system can be made: journal appends and JSON writes fail."""

    def __init__(self, monkeypatch):
        self.full = True
        real_append, real_write = step_recorder.Journal.append, step_recorder.write_json_atomic

        def append(journal, data):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_append(journal, data)

        def write(path, obj):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(path, obj)

        monkeypatch.setattr(step_recorder.Journal, "append", append)
        monkeypatch.setattr(step_recorder, "write_json_atomic", write)


@pytest.mark.parametrize("freed", [True, False], ids=["space-freed-before-step", "still-full-at-step"])
@pytest.mark.parametrize("disk", ["small-file-system", "injected-faults"])
def test_a_full_disk_mid_step(tmp_path, monkeypatch, freed, disk):
    torch.manual_seed(0)
    reference = _train(TinyNet(), range(3))
    with small_file_system(tmp_path, mount=disk == "small-file-system") as mnt:
        dump = (mnt or tmp_path) / "dump"
        injected = None
        torch.manual_seed(0)
        model = TinyNet()
        dbg = PrecisionDebugger({"dump_path": str(dump), "level": "mix", "task": "tensor"})
        dbg.start(model)
        losses = _train(model, range(1))
        filler = _fill(mnt) if mnt else None
        if mnt is None:
            injected = _Enospc(monkeypatch)
        losses += _train(model, range(1, 3))
        if freed:
            if filler:
                filler.unlink()
            if injected:
                injected.full = False
        dbg.stop()
        dbg.step()  # never raises: the error is logged, the journal kept
        assert losses == reference  # training went on, the numbers unchanged
        folder = rank_dir(dump)
        if freed:
            doc = assert_files_consistent(folder)
            assert not (folder / ".dump.journal").exists()
            assert len(doc["data"]) > 0
        else:
            assert not (folder / "dump.json").exists()  # nothing looks complete
            assert not list(folder.rglob("*.tmp"))
            if filler:
                filler.unlink()
            if injected:
                injected.full = False
            assert cli_main(["recover", str(dump)]) == 0
            doc = assert_files_consistent(folder)
            assert doc["recovered"] is True and doc["data"]
        PrecisionDebugger.reset()


# ------------------------------------------------------------------------------------------- damaged files fed to the commands
def _frame(entry) -> bytes:
    body = marshal.dumps(entry)
    return struct.pack("<I", len(body)) + body


HEADER = ("h", {"task": "statistics", "level": "L1", "framework": "pytorch", "dump_data_dir": None}, "dump.json")
RECORD = ("j", "Functional.relu.0.forward", 0, json.dumps({"input_args": [], "input_kwargs": {}, "output": []}))

BAD_JOURNALS = {
    "random_bytes": (os.urandom(300), "not a dump journal"),
    "no_header": (_frame(RECORD), "not a dump journal"),
    "header_names_a_path": (_frame(("h", {}, "../../../escaped.json")) + _frame(RECORD), "not a dump journal"),
    "header_not_a_dict": (_frame(("h", [1, 2], "dump.json")), "not a dump journal"),
}


@pytest.mark.parametrize("kind", sorted(BAD_JOURNALS))
def test_recover_refuses_a_journal_it_cannot_use(tmp_path, capsys, kind):
    raw, message = BAD_JOURNALS[kind]
    folder = tmp_path / "dump" / "step0" / "rank0"
    folder.mkdir(parents=True)
    (folder / ".dump.journal").write_bytes(raw)
    good = tmp_path / "dump" / "step0" / "rank1"  # another rank's journal is still recovered
    good.mkdir()
    (good / ".dump.journal").write_bytes(_frame(HEADER) + _frame(RECORD))
    with only_written_under(tmp_path, good):
        assert cli_main(["recover", str(tmp_path / "dump")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and str(folder / ".dump.journal") in err
    assert not (folder / "dump.json").exists() and (folder / ".dump.journal").exists()
    assert list(load(good / "dump.json")["data"]) == ["Functional.relu.0.forward"]


@pytest.mark.parametrize("damage", ["wrong_shapes", "torn_tail", "bad_json_text", "bad_field_path", "bad_stack"])
def test_recover_skips_and_counts_damaged_entries(tmp_path, damage):
    folder = tmp_path / "dump" / "step0" / "rank0"
    folder.mkdir(parents=True)
    bad = {"wrong_shapes": _frame(5) + _frame(("r",)) + _frame(("zz", 1, 2)) + _frame(("j", 3, 0, "{}")),
           "torn_tail": _frame(("j", "Functional.relu.1.forward", 1, "{}"))[:-3],
           "bad_json_text": _frame(("j", "Functional.relu.1.forward", 1, "{not json")),
           "bad_field_path": _frame(("f", "Functional.relu.0.forward", "not a list", 1)),
           "bad_stack": _frame(("S", 1, [("file", "not a line", "f"), 7])) + _frame(("s", RECORD[1], 1))}[damage]
    (folder / ".dump.journal").write_bytes(_frame(HEADER) + _frame(RECORD) + bad)
    with only_written_under(tmp_path, folder):
        assert cli_main(["recover", str(tmp_path / "dump")]) == 0
    doc = load(folder / "dump.json")
    assert doc["recovered"] is True and "Functional.relu.0.forward" in doc["data"]
    if damage != "bad_stack":
        assert doc["damaged_journal_entries"] >= 1


def test_recover_of_odd_paths(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert cli_main(["recover", str(tmp_path / "afile")]) == 2
    assert cli_main(["recover", str(tmp_path / "missing")]) == 2
    folder = tmp_path / "dump" / "step0" / "rank0"
    (folder / ".dump.journal").mkdir(parents=True)  # a folder where the journal should be
    assert cli_main(["recover", str(tmp_path / "dump")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def _dump_json(folder: Path, data, task: str = "statistics", extra: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"task": task, "level": "L1", "framework": "pytorch", "dump_data_dir": None, "data": data, **(extra or {})}
    (folder / "dump.json").write_text(json.dumps(doc))


T = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0, "Mean": 0.5, "Norm": 1.0,
     "requires_grad": False}
GOOD = {"input_args": [T], "input_kwargs": {}, "output": [T]}


@pytest.mark.parametrize("bad", [{}, 5, None, "text", {"input_args": 3}, {"input_args": [{"type": "torch.Tensor"}],
                                                                         "input_kwargs": {}, "output": []}])
def test_compare_reports_a_record_it_cannot_read(tmp_path, capsys, bad):
    for side in ("t", "g"):
        _dump_json(tmp_path / side / "step0" / "rank0", {"Functional.relu.0.forward": GOOD,
                                                         "Functional.gelu.0.forward": bad if side == "t" else GOOD})
    out = tmp_path / "out"
    with only_written_under(tmp_path, out):
        assert cli_main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "--output", str(out),
                         "--no-xlsx", "-q"]) == 0
    text = capsys.readouterr().out
    assert "No divergence:" not in text and "1 records could not be read" in text
    pair = load(out / "compare_summary.json")["pairs"][0]
    assert pair["unreadable_records"] == 1 and pair["unreadable"] == ["Functional.gelu.0.forward"]
    assert pair["rows"]["warning"] >= 1
    rows = (out / "compare_result.csv").read_text()
    assert "target record cannot be read" in rows


@pytest.mark.parametrize("damage", ["not_json", "data_not_object", "top_is_list", "binary"])
def test_compare_refuses_a_dump_json_it_cannot_read(tmp_path, capsys, damage):
    _dump_json(tmp_path / "g" / "step0" / "rank0", {"Functional.relu.0.forward": GOOD})
    t = tmp_path / "t" / "step0" / "rank0"
    t.mkdir(parents=True)
    content = {"not_json": b'{"data": {', "data_not_object": json.dumps({"task": "statistics", "data": [1]}).encode(),
               "top_is_list": b"[1, 2]", "binary": os.urandom(200)}[damage]
    (t / "dump.json").write_bytes(content)
    assert cli_main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "--output",
                     str(tmp_path / "out"), "--no-xlsx", "-q"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(t / "dump.json") in err


def test_compare_never_reads_a_data_name_outside_the_tensor_folder(tmp_path, capsys):
    secret = tmp_path / "secret.pt"
    torch.save(torch.full((2,), 99.0), secret)
    hostile = dict(T, data_name="../../../secret.pt")
    for side in ("t", "g"):
        _dump_json(tmp_path / side / "step0" / "rank0", {"Functional.relu.0.forward": {
            "input_args": [hostile], "input_kwargs": {}, "output": []}}, task="tensor")
        (tmp_path / side / "step0" / "rank0" / "dump_tensor_data").mkdir()
    assert cli_main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "--output",
                     str(tmp_path / "out"), "--no-xlsx", "-q"]) == 0
    assert "judged from statistics" in (tmp_path / "out" / "compare_result.csv").read_text()


def _anomaly_dict(**over):
    base = {"rank": 0, "step": 3, "micro_step": 0, "stage": "forward", "call_id": 1, "kind": "actv", "name": "fc1",
            "module": "fc1", "metric": "norm", "value": 5.0, "baseline": 1.0, "rule": "AnomalyTurbulence"}
    base.update(over)
    return base


BAD_ANOMALIES = {
    "invalid_json": b"[{",
    "top_is_object": json.dumps({"a": 1}).encode(),
    "list_of_numbers": b"[1, 2]",
    "missing_fields": json.dumps([{"step": 1}]).encode(),
    "value_is_text": json.dumps([_anomaly_dict(), _anomaly_dict(value="big")]).encode(),
    "step_is_text": json.dumps([_anomaly_dict(), _anomaly_dict(step="three")]).encode(),
    "rank_is_null": json.dumps([_anomaly_dict(), _anomaly_dict(rank=None)]).encode(),
    "name_is_number": json.dumps([_anomaly_dict(name=5)]).encode(),
    "fake_sqlite": b"SQLite format 3\x00" + os.urandom(100),
    "binary": os.urandom(300),
}


@pytest.mark.parametrize("kind", sorted(BAD_ANOMALIES))
def test_anomalies_refuses_a_file_it_cannot_read(tmp_path, capsys, kind):
    folder = tmp_path / "mon" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomalies.json").write_bytes(BAD_ANOMALIES[kind])
    with only_written_under(tmp_path):
        assert cli_main(["anomalies", str(tmp_path / "mon")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "anomal" in err and str(folder / "anomalies.json") in err


def test_the_commands_exit_with_a_clear_error_not_a_traceback(tmp_path):
    """``python -m msprobe_core recover|compare|anomalies`` on damaged input: exit status 2, one line."""
    journal = tmp_path / "dump" / "step0" / "rank0" / ".dump.journal"
    journal.parent.mkdir(parents=True)
    journal.write_bytes(BAD_JOURNALS["header_names_a_path"][0])
    (tmp_path / "t" / "step0" / "rank0").mkdir(parents=True)
    (tmp_path / "t" / "step0" / "rank0" / "dump.json").write_bytes(b"\xff\xfe not json")
    (tmp_path / "mon" / "rank0").mkdir(parents=True)
    (tmp_path / "mon" / "rank0" / "anomalies.json").write_bytes(BAD_ANOMALIES["step_is_text"])
    for args, needle in ((["recover", str(tmp_path / "dump")], "not a dump journal"),
                         (["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "t"), "--output",
                           str(tmp_path / "out")], "not UTF-8"),
                         (["anomalies", str(tmp_path / "mon")], "field 'step'")):
        proc = subprocess.run([sys.executable, "-m", "msprobe_core", *args], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "escaped.json").exists() and not (tmp_path / "out").exists()


def test_anomalies_of_odd_paths(tmp_path, capsys):
    assert cli_main(["anomalies", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli_main(["anomalies", str(tmp_path / "empty")]) == 0
    assert "no anomalies" in capsys.readouterr().out
