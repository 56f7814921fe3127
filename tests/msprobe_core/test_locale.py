"""The toolkit works under any locale: a dump, a compare and ``--help`` in processes started with the C
locale and Python's UTF-8 mode off (text files are read and written as UTF-8 whatever the locale says),
with a non-ASCII dump path and module name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
C_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "", "PYTHONCOERCECLOCALE": "0"}
MODULE = "层_é"

DUMP = textwrap.dedent(f"""
    import locale, sys, torch
    from msprobe_core.pytorch import PrecisionDebugger
    assert sys.flags.utf8_mode == 0 and locale.getpreferredencoding(False) != "UTF-8", "not the C locale"
    dump_path, scale, task = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module({MODULE!r}, torch.nn.Linear(4, 3))
    model.add_module("act", torch.nn.ReLU())
    with torch.no_grad():
        model[0].weight.mul_(scale)         # the runs first differ in the non-ASCII module
    debugger = PrecisionDebugger(dump_path=dump_path, level="mix", task=task)
    debugger.start(model)
    model(torch.ones(2, 4)).sum()
    debugger.stop()
    debugger.step()
    print("dumped", dump_path)
""")


def _run(args: list[str], cwd: Path, status: int = 0) -> subprocess.CompletedProcess:
    """``python args`` under the C locale, expected to exit with ``status``; its output as bytes (decoded by
    the test, not by the locale)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **C_LOCALE)
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, timeout=300)
    assert proc.returncode == status, proc.stderr.decode("utf-8", "replace")[-4000:]
    return proc


@pytest.mark.slow
def test_dump_compare_and_help_under_the_c_locale_with_non_ascii_names(tmp_path):
    script = tmp_path / "dump_model.py"
    script.write_text(DUMP, encoding="utf-8")
    base = tmp_path / "运行_é"
    for name, scale in (("golden", "1.0"), ("target", "1.5")):
        out = _run([str(script), str(base / name), scale, "statistics"], tmp_path).stdout
        assert str(base / name).encode() in out
    [rank] = (base / "golden" / "step0").iterdir()
    data = json.loads((rank / "dump.json").read_text(encoding="utf-8"))["data"]
    record = f"Module.{MODULE}.Linear.forward.0"
    assert record in data, sorted(data)
    assert record in json.loads((rank / "construct.json").read_text(encoding="utf-8"))

    out_dir = base / "比对"
    proc = _run(["-m", "msprobe_core", "compare", "-t", str(base / "target"), "-g", str(base / "golden"),
                 "-o", str(out_dir)], tmp_path, status=1)  # 1: the runs diverge
    printed = proc.stdout.decode("utf-8")  # the C locale's ASCII stdout writes UTF-8 rather than fail
    assert f"First divergence: Functional.linear.0.forward (parent {record})" in printed, printed
    results = [p for p in out_dir.rglob("*") if p.is_file()]
    csvs = [p for p in results if p.suffix == ".csv"]
    assert csvs and any(record in p.read_text(encoding="utf-8") for p in csvs)

    # task tensor: a tensor file cannot carry the non-ASCII name while file names are ASCII, so it is escaped
    _run([str(script), str(base / "tensors"), "1.0", "tensor"], tmp_path)
    [rank] = (base / "tensors" / "step0").iterdir()
    linear = json.loads((rank / "dump.json").read_text(encoding="utf-8"))["data"][record]
    data_name = linear["input_args"][0]["data_name"]
    assert data_name.isascii() and (rank / "dump_tensor_data" / data_name).is_file(), data_name

    help_text = _run(["-m", "msprobe_core", "--help"], tmp_path).stdout.decode("ascii")
    assert "compare" in help_text and "nan_analyze" in help_text
