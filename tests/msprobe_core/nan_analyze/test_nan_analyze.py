"""nan_analyze: the first call that made NaN/Inf across ranks, and the path by which it reached the others.

Unit cases build dump folders in msprobe's format (``DumpBuilder``); the slow case runs two real gloo
processes with the project's PrecisionDebugger, where rank 1 makes a NaN that an all_reduce spreads.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from compare_fixtures import DumpBuilder
from dist_run import run_two_ranks
from msprobe_core.errors import DumpInputError
from msprobe_core.nan_analyze import analyze
from msprobe_core.nan_analyze import cli as nan_cli

NAN = float("nan")


def _ranks_with_allreduce(root: Path, nan_rank: int = 1, output_recorded: bool = False,
                          stale_after: bool = True) -> None:
    """Two ranks: linear -> Bad (sqrt) -> all_reduce(in place) -> sum; ``nan_rank``'s sqrt gets negatives."""
    rng = np.random.default_rng(0)
    x = rng.random((3, 4)).astype(np.float32) + 0.5
    w = rng.random((4, 4)).astype(np.float32)
    per_rank = {}
    for rank in (0, 1):
        xr = -x if rank == nan_rank else x
        h = xr @ w.T
        with np.errstate(invalid="ignore"):
            s = np.sqrt(h).astype(np.float32)
        per_rank[rank] = (xr, h, s)
    reduced = per_rank[0][2] + per_rank[1][2]
    for rank in (0, 1):
        xr, h, s = per_rank[rank]
        b = DumpBuilder(task="statistics", level="mix")
        lin_mod = b.forward("Module.0.Linear.forward.0", [xr], [h], params={"weight": w})
        b.forward("Functional.linear.0.forward", [xr, w], [h], parent=lin_mod)
        bad_mod = b.forward("Module.1.Bad.forward.0", [h], [s])
        b.forward("Torch.sqrt.0.forward", [h], [s], parent=bad_mod,
                  stack=["File /work/train.py, line 18, in <module>, \n out = model(x)",
                         "File /work/train.py, line 7, in forward, \n return torch.sqrt(x)"])
        b.forward("Distributed.all_reduce.0.forward", [s], [reduced if output_recorded else None])
        # today's dumper summarises the tensor once per version; c10d ops do not bump it, so the next
        # record may show the statistics from before the collective (``stale_after``)
        b.forward("Tensor.sum.0.forward", [s if stale_after else reduced], [np.array(reduced.sum(), np.float32)])
        b.write(root / "step0" / f"rank{rank}")


def test_in_place_all_reduce_without_output_names_the_layer_that_made_the_nan(tmp_path):
    _ranks_with_allreduce(tmp_path)
    result = analyze(tmp_path)
    step, origin = result.first
    assert (origin.rank, origin.record, origin.kind) == ("rank1", "Torch.sqrt.0.forward", "computed")
    assert origin.parent == "Module.1.Bad.forward.0" and origin.parent_chain == ["Module.1.Bad.forward.0"]
    assert origin.stack[-1].endswith("return torch.sqrt(x)")
    assert [o.rank for o in step.origins] == ["rank1"], "rank 0's records after the all_reduce are not origins"
    [hop] = step.hops
    assert (hop.from_ranks, hop.to_rank, hop.via) == (["rank1"], "rank0", "Distributed.all_reduce.0.forward")
    assert hop.evidence == "inferred" and hop.first_seen == "Tensor.sum.0.forward"
    assert "before the call" in hop.note
    assert step.status["rank0"].startswith("reached from rank1 via Distributed.all_reduce.0.forward")


def test_in_place_all_reduce_with_output_shows_the_nan_arriving(tmp_path):
    """The better path: once in-place calls record the tensor after the call, the arrival is seen there."""
    _ranks_with_allreduce(tmp_path, output_recorded=True, stale_after=False)
    step, origin = analyze(tmp_path).first
    assert (origin.rank, origin.record) == ("rank1", "Torch.sqrt.0.forward")
    [hop] = step.hops
    assert hop.evidence == "output"
    assert hop.first_seen == hop.via == "Distributed.all_reduce.0.forward"


def test_output_recorded_but_later_statistics_stale_is_still_not_an_origin(tmp_path):
    _ranks_with_allreduce(tmp_path, output_recorded=True, stale_after=True)
    step, origin = analyze(tmp_path).first
    assert origin.rank == "rank1" and [o.rank for o in step.origins] == ["rank1"]
    assert step.hops[0].evidence == "output"


def test_origin_on_rank0_spreads_to_rank1(tmp_path):
    _ranks_with_allreduce(tmp_path, nan_rank=0)
    step, origin = analyze(tmp_path).first
    assert (origin.rank, origin.record) == ("rank0", "Torch.sqrt.0.forward")
    assert step.hops[0].to_rank == "rank1"


def test_nan_already_in_the_inputs_is_from_outside_the_dump(tmp_path):
    b = DumpBuilder(task="statistics", level="L1")
    x = np.array([1.0, NAN], np.float32)
    b.forward("Functional.relu.0.forward", [x], [np.maximum(x, 0)])
    b.forward("Torch.exp.0.forward", [np.ones(2, np.float32)], [np.array([np.inf, 1], np.float32)])
    b.write(tmp_path / "step0" / "rank0")
    step, origin = analyze(tmp_path).first
    assert (origin.record, origin.kind) == ("Functional.relu.0.forward", "from_outside")
    assert "outside" in origin.describe()


def test_module_is_narrowed_to_the_call_inside_it(tmp_path):
    b = DumpBuilder(task="statistics", level="mix")
    x = np.ones(3, np.float32)
    out = np.array([1, np.inf, 1], np.float32)
    mod = b.forward("Module.block.Block.forward.0", [x], [out])
    b.forward("Functional.relu.0.forward", [x], [x], parent=mod)
    inner = b.forward("Module.block.div.Div.forward.0", [x], [out], parent=mod)
    b.forward("Torch.div.0.forward", [x, np.zeros(3, np.float32)], [out], parent=inner)
    b.write(tmp_path / "rank0")
    _, origin = analyze(tmp_path / "rank0").first
    assert origin.record == "Torch.div.0.forward"
    assert origin.parent_chain == ["Module.block.div.Div.forward.0", "Module.block.Block.forward.0"]


def test_collective_that_overflows_is_itself_the_origin(tmp_path):
    big = np.full(2, 3.0e38, np.float32)
    for rank in (0, 1):
        b = DumpBuilder(task="statistics", level="L1")
        b.forward("Distributed.all_reduce.0.forward", [big], [np.full(2, np.inf, np.float32)])
        b.write(tmp_path / "step0" / f"rank{rank}")
    step, origin = analyze(tmp_path).first
    assert origin.kind == "collective" and origin.record == "Distributed.all_reduce.0.forward"
    assert {o.rank for o in step.origins} == {"rank0", "rank1"} and not step.hops


def test_send_recv_carries_nan_to_the_receiver(tmp_path):
    bad = np.array([NAN, 1.0], np.float32)
    b0 = DumpBuilder(task="statistics", level="L1")
    b0.forward("Torch.log.0.forward", [np.array([-1.0, 1.0], np.float32)], [bad])
    b0.forward("Distributed.send.0.forward", [bad, 1], [None])
    b0.write(tmp_path / "step0" / "rank0")
    b1 = DumpBuilder(task="statistics", level="L1")
    b1.forward("Torch.zeros.0.forward", [2], [np.zeros(2, np.float32)])
    b1.forward("Distributed.recv.0.forward", [np.zeros(2, np.float32), 0], [None])
    b1.forward("Tensor.add.0.forward", [bad, 1.0], [bad + 1])
    b1.write(tmp_path / "step0" / "rank1")
    step, origin = analyze(tmp_path).first
    assert (origin.rank, origin.record) == ("rank0", "Torch.log.0.forward")
    [hop] = step.hops
    assert (hop.to_rank, hop.via, hop.first_seen) == ("rank1", "Distributed.recv.0.forward", "Tensor.add.0.forward")
    assert hop.sender_records == {"rank0": "Distributed.send.0.forward"}


def test_tensor_file_is_read_when_the_summary_has_no_statistics(tmp_path):
    b = DumpBuilder(task="tensor", level="L1")
    x = np.ones(4, np.float32)
    y = np.array([1, 2, np.inf, 4], np.float32)
    b.forward("Torch.exp.0.forward", [x], [y])
    for leaf in b.data["Torch.exp.0.forward"]["output"]:
        for key in ("Max", "Min", "Mean", "Norm"):
            leaf[key] = None
    b.write(tmp_path / "rank0")
    _, origin = analyze(tmp_path / "rank0").first
    assert origin.record == "Torch.exp.0.forward"
    [out] = [t for t in origin.tensors if t["path"] == "output.0"]
    assert (out["inf"], out["nan"], out["numel"]) == (1, 0, 4)


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    nan_cli.add_arguments(parser)
    return nan_cli.run(parser.parse_args(argv))


def test_cli_writes_json_and_report_and_exit_status(tmp_path, capsys):
    _ranks_with_allreduce(tmp_path / "dump")
    from msprobe_core.cli import main  # --report is rendered by the command line once the analysis has run

    assert main(["nan_analyze", "-i", str(tmp_path / "dump"), "-o", str(tmp_path / "out"), "--report"]) == 1
    printed = capsys.readouterr().out
    [json_path] = (tmp_path / "out").glob("nan_analyze_*.json")
    data = json.loads(json_path.read_text())
    assert data["first_nan"]["rank"] == "rank1" and data["first_nan"]["record"] == "Torch.sqrt.0.forward"
    assert data["propagation"][0]["to_rank"] == "rank0"
    assert f"result: {json_path}" in printed
    report = json_path.with_suffix(".html")
    assert f"report: {report}" in printed and report.stat().st_size > 1000
    assert "First NaN/Inf: step0 rank1: Torch.sqrt.0.forward" in printed


def test_cli_clean_dump_exits_0_and_bad_input_is_a_clear_error(tmp_path, capsys):
    b = DumpBuilder(task="statistics", level="L1")
    b.forward("Functional.relu.0.forward", [np.ones(2, np.float32)], [np.ones(2, np.float32)])
    b.write(tmp_path / "rank0")
    assert _run_cli(["-i", str(tmp_path / "rank0"), "-o", str(tmp_path / "out")]) == 0
    assert "No NaN/Inf" in capsys.readouterr().out
    with pytest.raises(DumpInputError, match="not a dump"):
        analyze(tmp_path / "out")


WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from msprobe_core.pytorch import PrecisionDebugger
    tmp = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Bad(torch.nn.Module):
        def forward(self, x):
            return torch.sqrt(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Bad(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.abs_(); model[0].bias.abs_()
    debugger = PrecisionDebugger(dump_path=f"{tmp}/dump", level="mix", task="statistics")
    debugger.start(model)
    x = torch.rand(3, 4) + 0.5
    if rank == 1:
        x = -x                      # rank 1's Bad layer takes the square root of negatives
    out = model(x)
    dist.all_reduce(out)            # ... and the all_reduce spreads the NaN to rank 0
    loss = out.sum()
    debugger.stop()
    debugger.step()
    finish_distributed()
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_name_rank1_layer_not_rank0_all_reduce(tmp_path):
    run_two_ranks(WORKER, tmp_path, str(tmp_path), timeout=180)
    result = analyze(tmp_path / "dump")
    step, origin = result.first
    assert origin.rank == "rank1", origin.describe()
    assert origin.record == "Torch.sqrt.0.forward" and origin.parent == "Module.1.Bad.forward.0"
    assert [o.rank for o in step.origins] == ["rank1"]
    [hop] = step.hops
    assert (hop.to_rank, hop.via) == ("rank0", "Distributed.all_reduce.0.forward")
    rank0 = json.loads((tmp_path / "dump/step0/rank0/dump.json").read_text())["data"]
    recorded = [o for o in rank0["Distributed.all_reduce.0.forward"].get("output") or [] if o]
    if recorded:  # the dumper records in-place results: the NaN is seen arriving in the call itself
        assert hop.evidence == "output" and hop.first_seen == hop.via
    else:         # today: no output; the arrival is inferred at rank 0's next record holding NaN
        assert hop.evidence == "inferred" and hop.first_seen == "Tensor.sum.0.forward"


# ---------------------------------------------------------------- collectives on two process groups
# Rank 0 runs all_reduce on the world, then on its own group [0], alternately; rank 1 starts with its own
# group [1]. Rank 1 makes NaN between its calls, and its second world all_reduce brings it to rank 0 (rank
# 0's all_reduce.2). Paired by name and count, rank 0's all_reduce.2 would meet rank 1's all_reduce.2 (its
# own group, before the NaN): the NaN would seem made by rank 0's all_reduce.
GROUP_ORDER = {0: ["world", [0], "world", [0]], 1: [[1], "world", [1], "world"]}


def _group_arg(group) -> dict:
    ranks = [0, 1] if group == "world" else group
    return {"type": "torch.ProcessGroup", "group_ranks": ranks, "group_id": "x"}


def _ranks_with_two_groups(root: Path, record_groups: bool = True) -> None:
    one, nan = np.ones(2, np.float32), np.array([NAN, 1.0], np.float32)
    for rank, order in GROUP_ORDER.items():
        b = DumpBuilder(task="statistics", level="L1")
        bad = False
        for n, group in enumerate(order):
            if rank == 1 and n == 3:  # rank 1 makes NaN before its last (world) call
                b.forward("Torch.log.0.forward", [-one], [nan])
                bad = True
            arrives = rank == 0 and n == 2  # rank 1's NaN arrives in rank 0's second world call
            name = f"Distributed.all_reduce.{n}.forward"
            b.forward(name, [nan if bad else one], [nan if (bad or arrives) else one])
            if rank == 0 and n == 2:
                bad = True
            if record_groups:
                b.data[name]["input_kwargs"]["group"] = _group_arg(group)
            elif group != "world":  # an older dump: the group object without its ranks
                b.data[name]["input_kwargs"]["group"] = {"type": "ProcessGroup", "value": None}
        b.write(root / "step0" / f"rank{rank}")


def test_collectives_pair_by_process_group_and_count_on_it(tmp_path):
    _ranks_with_two_groups(tmp_path)
    step, origin = analyze(tmp_path).first
    assert (origin.rank, origin.record, origin.kind) == ("rank1", "Torch.log.0.forward", "computed")
    [hop] = step.hops
    assert (hop.from_ranks, hop.to_rank, hop.via) == (["rank1"], "rank0", "Distributed.all_reduce.2.forward")
    assert hop.sender_records == {"rank1": "Distributed.all_reduce.3.forward"} and hop.evidence == "output"
    assert not step.notes


def test_dump_without_group_ranks_falls_back_to_name_and_count_with_a_note(tmp_path):
    _ranks_with_two_groups(tmp_path, record_groups=False)
    step, origin = analyze(tmp_path).first
    assert (origin.rank, origin.kind) == ("rank0", "collective"), "the old pairing's known mispairing"
    assert any("without their ranks" in note for note in step.notes)


GROUPS_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from msprobe_core.pytorch import PrecisionDebugger
    tmp = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    own = [dist.new_group([0]), dist.new_group([1])][rank]   # every rank creates every group
    # world and own group alternately, in opposite orders on the two ranks (as TP and DP groups interleave)
    order = [None, own, dist.group.WORLD, own] if rank == 0 else [own, None, own, dist.group.WORLD]

    def step():
        t = torch.ones(2) * (rank + 1)
        results = []
        for n, group in enumerate(order):
            if rank == 1 and n == 3:
                t = torch.log(t - 5.0)          # rank 1 makes NaN before its last (world) all_reduce
            t = t.clone()
            dist.all_reduce(t) if group is None else dist.all_reduce(t, group=group)
            results.append(t.clone())
        return results

    plain = step()
    debugger = PrecisionDebugger(dump_path=f"{tmp}/dump", level="L1", task="statistics")
    debugger.start()
    dumped = step()
    debugger.stop()
    debugger.step()
    same = all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())
               for a, b in zip(plain, dumped))
    print(json.dumps({"same": same}))
    finish_distributed()
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks_two_process_groups_pair_by_group(tmp_path):
    stdout = run_two_ranks(GROUPS_WORKER, tmp_path, str(tmp_path), timeout=180)
    assert '"same": true' in stdout, "the dump changed the collectives' results"
    rank0 = json.loads((tmp_path / "dump/step0/rank0/dump.json").read_text())["data"]
    own = rank0["Distributed.all_reduce.1.forward"]["input_kwargs"]["group"]
    assert own["type"] == "torch.ProcessGroup" and own["group_ranks"] == [0]
    assert rank0["Distributed.all_reduce.2.forward"]["input_kwargs"]["group"]["group_ranks"] == [0, 1]
    step, origin = analyze(tmp_path / "dump").first
    assert (origin.rank, origin.record, origin.kind) == ("rank1", "Torch.log.0.forward", "computed"), origin.describe()
    [hop] = step.hops
    assert (hop.to_rank, hop.via) == ("rank0", "Distributed.all_reduce.2.forward")
    assert hop.sender_records == {"rank1": "Distributed.all_reduce.3.forward"}
    for path in (tmp_path / "dump").rglob("dump.json"):  # the same dump as older dumps recorded groups
        data = json.loads(path.read_text(encoding="utf-8"))
        for record in data["data"].values():
            if isinstance((record.get("input_kwargs") or {}).get("group"), dict):
                record["input_kwargs"]["group"] = {"type": "ProcessGroup", "value": None}
        path.write_text(json.dumps(data), encoding="utf-8")
    _, origin = analyze(tmp_path / "dump").first
    assert (origin.rank, origin.kind) == ("rank0", "collective"), "name-and-count pairing mispairs this run"
