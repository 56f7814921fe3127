"""seed_all(is_enhanced=True): every repeated random call gives the same values, Tensor methods (hence
nn.init), numpy.random and Python's random included; across processes too."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PRELUDE = "from msprobe_core.pytorch import seed_all\nimport torch, numpy as np, random, torch.nn as nn\n"


def run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=ROOT)).stdout.split()


def test_tensor_methods_and_nn_init_repeat():
    code = ("seed_all(1234, is_enhanced=True)\n"
            "print(torch.equal(nn.Linear(4, 4).weight, nn.Linear(4, 4).weight),"
            " torch.equal(torch.empty(5).normal_(), torch.empty(5).normal_()),"
            " torch.equal(torch.empty(5).uniform_(), torch.empty(5).uniform_()),"
            " torch.equal(nn.init.trunc_normal_(torch.empty(3, 3)), nn.init.trunc_normal_(torch.empty(3, 3))),"
            " torch.equal(torch.empty(4).random_(0, 100), torch.empty(4).random_(0, 100)))")
    assert run(code) == ["True"] * 5


def test_numpy_and_python_random_repeat():
    code = ("seed_all(7, is_enhanced=True)\n"
            "print(np.random.rand(3).tolist() == np.random.rand(3).tolist(),"
            " np.random.randint(0, 1000, 4).tolist() == np.random.randint(0, 1000, 4).tolist(),"
            " random.random() == random.random(), random.randint(0, 10**9) == random.randint(0, 10**9))\n"
            "a = list(range(20)); b = list(range(20)); random.shuffle(a); random.shuffle(b); print(a == b)")
    assert run(code) == ["True"] * 5


def test_same_values_across_processes_and_plain_seed_all_unchanged():
    code = "seed_all(1234, is_enhanced=True); print(nn.Linear(3, 2).weight.sum().item(), np.random.rand(), random.random())"
    assert run(code) == run(code)
    plain = run("seed_all(1234); print(torch.equal(nn.Linear(4, 4).weight, nn.Linear(4, 4).weight), "
                "np.random.rand() == np.random.rand(), random.random() == random.random())")
    assert plain == ["False", "False", "False"]


def test_seed_doc_example_value():
    """Seed 003: with is_enhanced, torch.mean(torch.randn(2, 2)) is tensor(-0.0866) both times."""
    out = run("seed_all(seed=1234, mode=True, is_enhanced=True)\n"
              "print(round(torch.mean(torch.randn(2, 2)).item(), 4), round(torch.mean(torch.randn(2, 2)).item(), 4))")
    assert out == ["-0.0866", "-0.0866"]
