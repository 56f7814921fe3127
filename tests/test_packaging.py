"""The package as users install it: an sdist and a wheel build, the sdist installs and works where no C
compiler exists (the statistics kernel falls back to torch), and with no extras installed the PyTorch API
needs only torch, numpy and PyYAML."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Everything pyproject.toml lists as an extra (or that an extra pulls in): none may be needed by the core.
EXTRAS_MODULES = ("transformers", "accelerate", "deepspeed", "megatron", "tensorboardX", "tensorboard", "openpyxl",
                  "tqdm", "isal", "mindspore", "vllm", "trl", "safetensors")

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = set(sys.argv[1].split(","))
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None
    sys.meta_path.insert(0, Blocker())
""")


def _run(code: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd or ROOT)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Path:
    """``python -m build`` (without isolation: the dev venv has setuptools) into a fresh folder."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_build_makes_an_sdist_and_a_wheel_with_everything_needed(dists):
    sdist = next(dists.glob("msprobe_toolkit-*.tar.gz"))
    wheel = next(dists.glob("msprobe_toolkit-*.whl"))
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    parts = sorted(p.name for p in (ROOT / "msprobe_core" / "stats").glob("_fast_*.c"))
    assert "_fast_stats.c" in parts
    for part in parts:  # _fast_stats.c and the parts it #includes (setup.py's depends)
        assert any(n.endswith(f"/stats/{part}") for n in names), f"the sdist must carry the kernel's C source {part}"
    for part in ("_torch_facts.cpp", "_torch_facts.h"):  # the optional C++ part (built here: torch imports)
        assert any(n.endswith(f"/stats/{part}") for n in names), f"the sdist must carry the C++ source {part}"
    assert any(n.endswith("support_wrap_ops.yaml") for n in names)
    with zipfile.ZipFile(wheel) as whl:
        wnames = whl.namelist()
    assert any(n.endswith("support_wrap_ops.yaml") for n in wnames)
    assert not any(n.startswith("tests/") for n in wnames), "tests must not be installed as a package"
    meta = next(n for n in wnames if n.endswith("METADATA"))
    with zipfile.ZipFile(wheel) as whl:
        text = whl.read(meta).decode()
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires and all("==" not in line for line in requires), requires  # a range, never an exact pin


def test_sdist_installs_and_works_without_a_c_compiler(dists, tmp_path):
    """CC points at a compiler that does not exist: the optional extension is skipped, the install succeeds and
    statistics come from torch's reductions."""
    sdist = next(dists.glob("msprobe_toolkit-*.tar.gz"))
    target = tmp_path / "site"
    env = dict(os.environ, CC="/nonexistent/cc", CXX="/nonexistent/c++", LDSHARED="/nonexistent/cc -shared")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(sdist)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list(target.rglob("_fast_stats*.so")) and not list(target.rglob("_torch_facts*.so")), \
        "no compiler, so no extension"
    code = textwrap.dedent("""
        import json, sys, torch
        import msprobe_core
        assert msprobe_core.__file__.startswith(sys.argv[1]), msprobe_core.__file__
        from msprobe_core.pytorch import PrecisionDebugger
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        dbg = PrecisionDebugger(dump_path=sys.argv[2], task="statistics", level="L1")
        dbg.start(model)
        model(torch.ones(2, 4)).sum().backward()
        dbg.stop(); dbg.step()
        from pathlib import Path
        data = json.loads(next(Path(sys.argv[2]).glob("step0/*/dump.json")).read_text())["data"]
        rec = data["Functional.linear.0.forward"]["output"][0]
        ref = model[0](torch.ones(2, 4))
        assert abs(rec["Max"] - ref.max().item()) < 1e-6 and abs(rec["Norm"] - ref.norm().item()) < 1e-5, rec
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(target))
    proc = _run(code, str(target), str(tmp_path / "dump"), env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_core_imports_and_dumps_with_only_torch_numpy_and_pyyaml(tmp_path):
    code = BLOCKER + textwrap.dedent("""
        import torch
        import msprobe_core.pytorch as api
        from msprobe_core.pytorch import PrecisionDebugger, seed_all, save
        seed_all(1)
        model = torch.nn.Linear(3, 2)
        dbg = PrecisionDebugger(dump_path=sys.argv[2], task="statistics", level="mix")
        dbg.start(model)
        model(torch.ones(1, 3)).sum().backward()
        dbg.stop(); dbg.step()
        import msprobe_core.compare, msprobe_core.cli
        print("ok")
    """)
    proc = _run(code, ",".join(EXTRAS_MODULES), str(tmp_path / "dump"))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert list((tmp_path / "dump").glob("step0/*/dump.json"))


@pytest.mark.parametrize("module, extra", [("msprobe_integrations.hf", "hf"),
                                           ("msprobe_integrations.deepspeed", "deepspeed"),
                                           ("msprobe_integrations.megatron", "megatron")])
def test_an_integration_without_its_framework_names_the_extra(module, extra):
    code = BLOCKER + textwrap.dedent(f"""
        from msprobe_core.errors import MsprobeError
        try:
            import {module}
        except ImportError as e:
            assert isinstance(e, MsprobeError), type(e).__mro__
            print("MESSAGE:", e)
        else:
            print("imported")
    """)
    proc = _run(code, ",".join(EXTRAS_MODULES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"msprobe-toolkit[{extra}]" in proc.stdout, proc.stdout
