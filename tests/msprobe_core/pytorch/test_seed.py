"""seed_all: the rows of msprobe's table that apply on CPU/CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from msprobe_core.errors import ConfigError
from msprobe_core.pytorch import seed_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", "from msprobe_core.pytorch import seed_all\nimport torch, numpy as np, random\n" + code],
                          capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT)).stdout


def test_seeds_every_generator_and_sets_env():
    out1 = run("seed_all(42); print(torch.randn(3).tolist(), np.random.rand(), random.random())")
    out2 = run("seed_all(42); print(torch.randn(3).tolist(), np.random.rand(), random.random())")
    assert out1 == out2
    out = run("import os; seed_all(7); print(os.environ['PYTHONHASHSEED'], os.environ['HCCL_DETERMINISTIC'], "
              "torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, "
              "torch.are_deterministic_algorithms_enabled())")
    assert out.split() == ["7", "True", "False", "False", "True", "False"]
    assert run("seed_all(mode=True); print(torch.are_deterministic_algorithms_enabled())").strip() == "True"


def test_is_enhanced_repeats_random_values():
    assert run("seed_all(1234, is_enhanced=True); a = torch.randn(2, 2).mean(); b = torch.randn(2, 2).mean(); print(bool(a == b))").strip() == "True"
    assert run("seed_all(1234); a = torch.randn(2, 2).mean(); b = torch.randn(2, 2).mean(); print(bool(a == b))").strip() == "False"


def test_rm_dropout():
    code = ("seed_all(rm_dropout=True); import torch.nn as nn, torch.nn.functional as F; x = torch.ones(100);"
            "print(bool((F.dropout(x, 0.5, True) == x).all()), nn.Dropout(0.3).p, bool((nn.Dropout2d(0.5).train()(torch.ones(2, 3, 4, 4)) == 1).all()))")
    assert run(code).split() == ["True", "0.0", "True"]


@pytest.mark.parametrize("kwargs,field", [({"seed": -1}, "seed"), ({"seed": "1"}, "seed"), ({"mode": 1}, "mode")])
def test_bad_arguments(kwargs, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        seed_all(**kwargs)
