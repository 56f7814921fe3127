"""In-place communication calls record the tensor as it is after the call, and nothing after them reads
statistics taken before it (c10d's collectives do not bump the version counter). Two real gloo processes."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from dist_run import run_two_ranks

SCRIPT = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from msprobe_core.session import finish_distributed
    from msprobe_core.pytorch import PrecisionDebugger
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dbg = PrecisionDebugger({{"dump_path": {out!r}, "level": "L1", "task": {task!r}}})
    dbg.start()
    t = torch.full((4,), float(rank + 1))
    torch.mul(t, 1.0)                               # t's statistics cached (before the collective)
    version = t._version
    dist.all_reduce(t)                              # 1 + 2 = 3 on both ranks, written in place
    bumped = t._version != version
    y = torch.mul(t, 2.0)                           # must read 3, not the cached 1 or 2
    parts = [torch.zeros(2), torch.zeros(2)]
    dist.all_gather(parts, torch.full((2,), float(10 * (rank + 1))))
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    buf = torch.full((6,), float(rank + 1))
    view = buf[2:4]
    torch.add(view, 0.0)                            # a view of the buffer: cached too
    dist.all_reduce(buf)
    torch.add(view, 0.0)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    dbg.stop()
    dbg.step()
    print(json.dumps({{"bumped": bumped}}))
    finish_distributed()
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_in_place_collectives_record_their_result_and_refresh_cached_statistics(tmp_path):
    out = tmp_path / "dump"
    stdout = run_two_ranks(SCRIPT.format(out=str(out), task="statistics"), tmp_path)
    assert '"bumped": false' in stdout, "c10d now bumps the version counter: the cache refresh is a no-op"
    for rank in (0, 1):
        data = json.loads((out / "step0" / f"rank{rank}" / "dump.json").read_text())["data"]
        ar = data["Distributed.all_reduce.0.forward"]
        assert ar["input_args"][0]["Max"] == rank + 1          # before the call
        assert ar["output"][0]["Max"] == 3.0 and ar["output"][0]["shape"] == [4]   # after it
        assert data["Torch.mul.1.forward"]["input_args"][0]["Max"] == 3.0          # not the stale cache
        assert data["Torch.mul.1.forward"]["output"][0]["Max"] == 6.0
        gathered = data["Distributed.all_gather.0.forward"]["output"]
        assert [g["Max"] for g in gathered] == [10.0, 20.0]
        assert data["Distributed.broadcast.0.forward"]["output"][0]["Max"] == 1.0
        assert data["Distributed.broadcast.0.forward"]["input_args"][0]["Max"] == float(rank)
        # a view of a buffer an all_reduce wrote: its earlier statistics are dropped too
        assert data["Torch.add.0.forward"]["input_args"][0]["Max"] == rank + 1
        assert data["Torch.add.1.forward"]["input_args"][0]["Max"] == 3.0
        # asynchronous: the values arrive at wait(), so the output is the returned Work, not the tensor
        assert data["Distributed.all_reduce.2.forward"]["output"] == [{"type": "Work", "value": None}]


@pytest.mark.slow
@pytest.mark.distributed
def test_overflow_check_sees_a_nan_arriving_through_all_reduce(tmp_path):
    """Rank 1 makes a NaN, the all_reduce spreads it: rank 0's overflow_check records the all_reduce."""
    out = tmp_path / "dump"
    run_two_ranks(textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from msprobe_core.session import finish_distributed
        from msprobe_core.pytorch import PrecisionDebugger
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dbg = PrecisionDebugger({{"dump_path": {str(out)!r}, "level": "L1", "task": "nan_check",
                                  "nan_check": {{"overflow_nums": -1}}}})
        dbg.start()
        t = torch.sqrt(torch.full((4,), -1.0 if rank == 1 else 1.0))
        dist.all_reduce(t)
        dbg.stop()
        dbg.step()
        finish_distributed()
    """), tmp_path)
    rank0 = json.loads((out / "step0" / "rank0" / "dump.json").read_text())
    assert rank0["task"] == "overflow_check"
    assert list(rank0["data"]) == ["Distributed.all_reduce.0.forward"]
    rank1 = json.loads((out / "step0" / "rank1" / "dump.json").read_text())["data"]
    assert list(rank1) == ["Torch.sqrt.0.forward", "Distributed.all_reduce.0.forward"]
    files = sorted(p.name for p in (out / "step0" / "rank0" / "dump_tensor_data").iterdir())
    assert files == ["Distributed.all_reduce.0.forward.input.0.pt", "Distributed.all_reduce.0.forward.output.0.pt"]
    saved = torch.load(out / "step0" / "rank0" / "dump_tensor_data" / files[1])
    assert torch.isnan(saved).all()
