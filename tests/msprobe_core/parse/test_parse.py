"""parse: one record's statistics (or its tensor files' summaries), its stack and its parent chain."""

from __future__ import annotations

import argparse
import json

import pytest

from compare_fixtures import mlp_run
from msprobe_core.errors import DumpInputError
from msprobe_core.parse import cli as parse_cli


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parse_cli.add_arguments(parser)
    return parse_cli.run(parser.parse_args(argv))


@pytest.fixture
def rank_dir(tmp_path):
    return mlp_run(tmp_path / "dump" / "step0" / "rank0", task="tensor", level="mix", layers=2)


def test_prints_statistics_file_summaries_parent_chain_and_stack(rank_dir, capsys):
    assert _run([str(rank_dir), "Functional.linear.1.forward"]) == 0
    out = capsys.readouterr().out
    dump = json.loads((rank_dir / "dump.json").read_text())["data"]["Functional.linear.1.forward"]
    x_max = dump["input_args"][0]["Max"]
    assert out.startswith("Statistic Info:")
    assert f"[Functional.linear.1.forward.input.0][dtype: torch.float32][shape: [4, 8]][max: {x_max:.8g}]" in out
    assert "from file: max=" in out and "nan=0 inf=0 numel=32" in out
    assert "Parent chain: Module.layers.1.Layer.forward.0" in out
    assert "Trace back(Functional.linear.1.forward):" in out and "File /work/model.py" in out


def test_json_output_and_tensor_name(rank_dir, capsys):
    assert _run([str(rank_dir), "Functional.relu.0.forward.output.0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["record"] == "Functional.relu.0.forward"
    [t] = info["tensors"]
    assert t["name"] == "Functional.relu.0.forward.output.0"
    assert t["from_file"]["Min"] >= 0 and t["from_file"]["numel"] == 32  # relu output
    assert info["parent_chain"] == ["Module.layers.0.Layer.forward.0"]


def test_backward_record_uses_its_forward_stack(rank_dir, capsys):
    assert _run([str(rank_dir), "Functional.linear.0.backward"]) == 0
    assert "Trace back(Functional.linear.0.backward, stack of Functional.linear.0.forward):" in capsys.readouterr().out


def test_missing_name_lists_the_nearest(rank_dir):
    with pytest.raises(DumpInputError) as err:
        _run([str(rank_dir), "Functional.linaer.1.forwad"])
    message = str(err.value)
    assert "no record 'Functional.linaer.1.forwad'" in message
    assert "nearest: Functional.linear.1.forward" in message


def test_ptdbg_style_name_and_a_step_folder_with_one_rank(rank_dir, capsys):
    assert _run([str(rank_dir.parent), "Functional_relu_1_forward"]) == 0
    assert "[Functional.relu.1.forward.input.0]" in capsys.readouterr().out


def test_folder_with_several_ranks_is_refused(tmp_path):
    for r in (0, 1):
        mlp_run(tmp_path / "step0" / f"rank{r}", task="statistics", layers=1)
    with pytest.raises(DumpInputError, match="holds 2 rank folders"):
        _run([str(tmp_path / "step0"), "Functional.relu.0.forward"])


def test_commands_are_registered_in_the_cli(rank_dir, capsys):
    from msprobe_core.cli import COMMANDS, main

    assert {"nan_analyze", "parse", "report"} <= set(COMMANDS)
    assert main(["parse", str(rank_dir), "Functional.relu.9.forward"]) == 2
    assert "nearest:" in capsys.readouterr().err
