"""The L0 dump under FSDP2 and DTensor tensor parallel on two real gloo ranks: records are named as in the
model without FSDP (``Module.0.Linear``, not ``FSDPLinear``), ``parameters_grad`` records are present and
carry the full gradient's statistics (combined from the shards: ``combined_from_shards``), and the losses
are bit-identical with the dump on and off. FSDP2: ``compare`` finds no divergence against the same model
dumped in one process (every rank feeds the global batch). Tensor parallel: a sharded weight or activation
in a forward record is this rank's shard (``local_shard``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dist_run import run_two_ranks
from native_sharding import FSDP2, dump_run, make_model, reference

from msprobe_core.compare import compare_dumps

WORKER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from native_sharding import dump_run, make_model, shard, train

    tmp, setup = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    plain = train(shard(make_model(), setup), setup, steps=2, replicated_batch=True)
    losses = dump_run(f"{tmp}/dump", shard(make_model(), setup), setup)
    with open(f"{tmp}/rank{dist.get_rank()}.json", "w") as f:
        json.dump({"plain": plain, "losses": losses}, f)
    finish_distributed()
""")


def single_device_dump(tmp_path: Path) -> Path:
    dump_run(str(tmp_path / "single"), make_model(), "single")
    return tmp_path / "single"


def rank_dir(root: Path, step: int, rank: str) -> Path:
    return root / f"step{step}" / rank


@pytest.mark.distributed
@pytest.mark.parametrize("setup", [FSDP2, "tp", "fsdp1_orig", "fsdp1_flat"])
def test_dump_pairs_with_single_device(tmp_path, setup):
    run_two_ranks(WORKER, tmp_path, str(tmp_path), setup, timeout=240, name="worker.py")
    golden = single_device_dump(tmp_path)
    single = next(p.name for p in (golden / "step0").iterdir())
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["losses"] == result["plain"]
        data = json.loads((rank_dir(tmp_path / "dump", 0, f"rank{rank}") / "dump.json").read_text())["data"]
        want = json.loads((rank_dir(golden, 0, single) / "dump.json").read_text())["data"]
        assert set(data) == set(want), sorted(set(data) ^ set(want))
        grad = data["Module.0.Linear.parameters_grad.0"]["weight"][0]
        assert grad["combined_from_shards"] == 2
        ref = reference(1)[0]["grad"]["0.weight"]
        assert grad["Norm"] == pytest.approx(ref["norm"], rel=1e-5)
        if setup == "tp":  # a sharded weight in a forward record is this rank's shard, and says so
            assert data["Module.0.Linear.forward.0"]["parameters"]["weight"]["local_shard"] is True
            assert "local_shard" not in data["Module.2.Linear.forward.0"]["parameters"]["bias"]  # replicated
            continue
        later = json.loads((rank_dir(tmp_path / "dump", 1, f"rank{rank}") / "dump.json").read_text())["data"]
        assert set(later) == set(data)  # the same records every step
        for step in (0, 1):
            result = compare_dumps(rank_dir(tmp_path / "dump", step, f"rank{rank}"), rank_dir(golden, step, single))
            assert not result.has_errors, result.divergence
