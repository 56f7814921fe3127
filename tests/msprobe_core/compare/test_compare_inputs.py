"""compare's errors for inputs that are not comparable dumps: each names the offending path."""

from __future__ import annotations

import json
import os

import pytest

from compare_fixtures import DumpBuilder, mlp_run
from msprobe_core.cli import main
from msprobe_core.compare import compare_dumps
from msprobe_core.errors import DumpInputError


def _error(tmp_path, target, golden) -> str:
    with pytest.raises(DumpInputError) as info:
        compare_dumps(target, golden)
    return str(info.value)


def test_missing_path(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    msg = _error(tmp_path, tmp_path / "nope", tmp_path / "g")
    assert str(tmp_path / "nope") in msg and "no such" in msg


def test_folder_that_is_not_a_dump(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    mlp_run(tmp_path / "g/step0/rank0")
    assert "not a dump" in _error(tmp_path, tmp_path / "empty", tmp_path / "g")
    assert "not a dump" in _error(tmp_path, tmp_path / "file.txt", tmp_path / "g")


def test_dump_json_that_is_not_a_dump(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    bad = tmp_path / "bad/step0/rank0"
    bad.mkdir(parents=True)
    (bad / "dump.json").write_text("{not json")
    msg = _error(tmp_path, tmp_path / "bad", tmp_path / "g")
    assert str(bad / "dump.json") in msg and "not valid JSON" in msg
    (bad / "dump.json").write_text(json.dumps({"task": "tensor", "records": []}))
    assert "'data' object" in _error(tmp_path, tmp_path / "bad", tmp_path / "g")


def test_unfinished_dump_suggests_recover(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    b = DumpBuilder()
    b.write(tmp_path / "t/step0/rank0", dump_json=False)
    msg = _error(tmp_path, tmp_path / "t", tmp_path / "g")
    assert "not a finished dump" in msg
    assert f"python -m msprobe_core recover {tmp_path / 't'}" in msg


def test_missing_tensor_file_named(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0")
    victim = tmp_path / "t/step0/rank0/dump_tensor_data/Functional.relu.1.forward.output.0.pt"
    os.remove(victim)
    msg = _error(tmp_path, tmp_path / "t", tmp_path / "g")
    assert str(victim) in msg and "missing tensor file" in msg


def test_corrupt_tensor_file_named(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "t/step0/rank0")
    victim = tmp_path / "t/step0/rank0/dump_tensor_data/Functional.relu.1.forward.output.0.pt"
    victim.write_bytes(b"garbage")
    msg = _error(tmp_path, tmp_path / "t", tmp_path / "g")
    assert str(victim) in msg and "not a readable tensor file" in msg


def test_mismatched_levels_and_frameworks(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", level="L1")
    mlp_run(tmp_path / "t/step0/rank0", level="mix")
    msg = _error(tmp_path, tmp_path / "t", tmp_path / "g")
    assert "level 'mix'" in msg and "level 'L1'" in msg and str(tmp_path / "t") in msg
    path = tmp_path / "t/step0/rank0/dump.json"
    data = json.loads(path.read_text())
    data.update(level="L1", framework="paddle")  # (mindspore and mindtorch compare with pytorch: framework_map)
    path.write_text(json.dumps(data))
    assert "framework 'paddle'" in _error(tmp_path, tmp_path / "t", tmp_path / "g")


def test_overflow_check_dumps_are_refused(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0", task="statistics")
    mlp_run(tmp_path / "t/step0/rank0", task="statistics")
    path = tmp_path / "t/step0/rank0/dump.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "task": "overflow_check"}))
    assert "overflow_check" in _error(tmp_path, tmp_path / "t", tmp_path / "g")


def test_different_steps_or_ranks(tmp_path):
    for step in (0, 1):
        mlp_run(tmp_path / f"g/step{step}/rank0")
    mlp_run(tmp_path / "t/step0/rank0")
    mlp_run(tmp_path / "t/step2/rank0")
    msg = _error(tmp_path, tmp_path / "t", tmp_path / "g")
    assert "different steps" in msg and "only in target: step2" in msg and "only in golden: step1" in msg
    mlp_run(tmp_path / "t2/step0/rank0")
    mlp_run(tmp_path / "t2/step0/rank1")
    msg = _error(tmp_path, tmp_path / "t2/step0", tmp_path / "g/step0")
    assert "different ranks" in msg and "only in target: rank1" in msg


def test_rank_folder_against_a_multi_rank_dump(tmp_path):
    mlp_run(tmp_path / "g/step0/rank0")
    mlp_run(tmp_path / "g/step0/rank1")
    mlp_run(tmp_path / "t/step0/rank0")
    assert "cannot match" in _error(tmp_path, tmp_path / "t/step0/rank0", tmp_path / "g")
    # one rank folder against a dump path holding a single rank is fine
    assert len(compare_dumps(tmp_path / "t/step0/rank0", tmp_path / "t").pairs) == 1


def test_cli_prints_the_error_and_returns_2(tmp_path, capsys):
    rc = main(["compare", "-t", str(tmp_path / "a"), "-g", str(tmp_path / "b"), "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and str(tmp_path / "a") in err
