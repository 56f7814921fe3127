"""compare on real dumps of a small torch model written by msprobe_core.pytorch.PrecisionDebugger."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from msprobe_core.cli import main  # noqa: E402
from msprobe_core.compare import compare_dumps  # noqa: E402
from msprobe_core.pytorch import PrecisionDebugger  # noqa: E402

pytestmark = pytest.mark.slow


class Net(nn.Module):
    def __init__(self, extra_call: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.extra_call = extra_call

    def forward(self, x):
        x = F.relu(self.fc1(x))
        if self.extra_call:
            x = torch.add(x, 0.0)  # one more API call, same values
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def dump(path: Path, level: str = "L1", task: str = "tensor", perturb: Optional[str] = None,
         extra_call: bool = False) -> Path:
    """One forward/backward step of Net dumped to ``path``; ``perturb`` names a layer whose weight is
    replaced by noise of the same scale."""
    torch.manual_seed(0)
    model = Net(extra_call)
    x = torch.randn(8, 16)
    if perturb:
        with torch.no_grad():
            weight = getattr(model, perturb).weight
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)) * weight.std())
    PrecisionDebugger.reset()
    try:
        debugger = PrecisionDebugger(task=task, dump_path=str(path), level=level)
        debugger.start(model)
        model(x).square().mean().backward()
        debugger.stop()
        debugger.step()
    finally:
        PrecisionDebugger.reset()
    return path


@pytest.mark.parametrize("level, task", [("L1", "tensor"), ("L0", "tensor"), ("mix", "statistics")])
def test_identical_runs_compare_clean(tmp_path, level, task, capsys):
    dump(tmp_path / "g", level, task)
    dump(tmp_path / "t", level, task)
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[-1].startswith("No divergence")
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    assert result.pairs[0].rows and not result.pairs[0].only_target and not result.pairs[0].only_golden


@pytest.mark.parametrize("level, task, expected, parent", [
    ("L1", "tensor", "Functional.linear.1.forward", None),
    ("L1", "statistics", "Functional.linear.1.forward", None),
    ("L0", "tensor", "Module.fc2.Linear.forward.0", None),
    ("mix", "tensor", "Functional.linear.1.forward", "Module.fc2.Linear.forward.0"),
])
def test_perturbed_weight_is_the_first_divergence(tmp_path, level, task, expected, parent, capsys):
    dump(tmp_path / "g", level, task)
    dump(tmp_path / "t", level, task, perturb="fc2")
    rc = main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 1, out
    div = compare_dumps(tmp_path / "t", tmp_path / "g").pairs[0].divergence
    assert div.target_record == expected
    assert div.parent == parent
    assert expected in out.splitlines()[-1]
    assert div.stack and any("forward" in frame for frame in div.stack)


def test_extra_api_call_on_one_side_still_aligns(tmp_path, capsys):
    dump(tmp_path / "g")
    dump(tmp_path / "t", extra_call=True)
    result = compare_dumps(tmp_path / "t", tmp_path / "g")
    pair = result.pairs[0]
    assert pair.divergence is None, pair.divergence
    assert pair.only_target and all(name.startswith("Torch.add.") for name in pair.only_target)
    assert not pair.only_golden
    # and the other way round, with a real divergence after the extra call
    dump(tmp_path / "t2", perturb="fc3")
    pair = compare_dumps(tmp_path / "t2", tmp_path / "g").pairs[0]
    assert pair.divergence.target_record == "Functional.linear.2.forward"
    dump(tmp_path / "t3", extra_call=True, perturb="fc3")
    pair = compare_dumps(tmp_path / "t3", tmp_path / "g").pairs[0]
    assert pair.divergence.target_record == "Functional.linear.2.forward"
    assert all(name.startswith("Torch.add.") for name in pair.only_target)
