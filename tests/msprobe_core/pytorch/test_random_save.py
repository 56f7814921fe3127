"""random_save(output_path): the randomness API call sites of a training, as msprobe's CSV."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent("""
    import sys, random, numpy as np, torch, torch.nn as nn, torch.nn.functional as F
    if sys.argv[1] == "on":
        from msprobe_core.pytorch import random_save
        random_save(output_path=sys.argv[2])
    if len(sys.argv) > 3:
        import os, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0); np.random.seed(0); random.seed(0)

    class ModuleOP(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(in_features=8, out_features=4)

        def forward(self, x):
            return F.dropout(F.relu(self.linear(x)), 0.5, self.training)

    model = ModuleOP()
    losses = []
    for _ in range(3):
        x = torch.randn(10, 8)
        loss = model(x).sum()
        loss.backward()
        losses.append(loss.item())
    print(losses, np.random.rand(), random.random(), model.linear.weight.grad.sum().item())
    from msprobe_core.session import finish_distributed
    finish_distributed()
""")


def _run(tmp_path, *args):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=ROOT)).stdout


def test_random_save_writes_each_call_site_once_and_changes_no_number(tmp_path):
    out = tmp_path / "output"
    assert _run(tmp_path, "on", str(out)) == _run(tmp_path, "off", "")
    [csv_path] = list(out.iterdir())
    assert re.fullmatch(r"random_proc\d+_\d{14}\.csv", csv_path.name)
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["api_name", "stack"]
    apis = [r["api_name"] for r in rows]
    assert apis.count("torch.randn") == 1   # one call site, called 3 times
    for api in ("torch.Tensor.uniform_", "torch.randn", "torch.nn.functional.dropout", "numpy.random.rand",
                "random.random", "torch.manual_seed", "numpy.random.seed", "random.seed"):
        assert api in apis, api
    init = next(r for r in rows if r["api_name"] == "torch.Tensor.uniform_")
    assert "model = ModuleOP()" in init["stack"] and "kaiming_uniform_" in init["stack"]
    assert init["stack"].splitlines()[0].startswith("File ") and "train.py" in init["stack"]
    dropout = next(r for r in rows if r["api_name"] == "torch.nn.functional.dropout")
    assert "in forward" in dropout["stack"]


@pytest.mark.distributed
def test_random_save_file_is_named_by_rank_once_distributed_is_up(tmp_path):
    from dist_run import free_port
    port = free_port()
    out = tmp_path / "output"
    _run(tmp_path, "on", str(out), str(port))
    [csv_path] = list(out.iterdir())
    assert re.fullmatch(r"random_rank0_\d{14}\.csv", csv_path.name)


def test_bad_output_path(tmp_path):
    from msprobe_core.errors import ConfigError
    from msprobe_core.pytorch import random_save

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="output_path"):
        random_save(output_path=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="output_path"):
        random_save(output_path="")
