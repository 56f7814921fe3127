"""A small data-parallel training with config_check's dynamic collection, for tests/msprobe_core/config_check/test_config_check_runs.py.

    torchrun --nproc_per_node 2 tests/support/config_check_train.py --lr 1e-4 --seed 1 --pack PACK.zip --shell-path run.sh

Every run starts from the same weights (``torch.manual_seed(0)`` before the model is built, as a
fine-tuning loads one checkpoint); ``--seed`` seeds what happens after (dropout). Each rank trains on
its own fixed batches; the environment variable ``CC_TEST_REVERSE_RANK=R`` makes rank R see them in
reverse order (a data-order bug that nothing in the launch script shows). DDP over gloo, SGD, 4 steps.
Prints the losses as float hex (``LOSSES r: ...``).
"""

from msprobe_core.config_check import ConfigChecker

ConfigChecker.apply_patches(fmk="pytorch")

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from msprobe_core.session import finish_distributed  # noqa: E402

STEPS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--pack", required=True)
    parser.add_argument("--shell-path", default=None)
    parser.add_argument("--no-checker", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(args.seed + rank)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 8, generator=g) for _ in range(STEPS)]
    if os.environ.get("CC_TEST_REVERSE_RANK") == str(rank):
        batches.reverse()
    if not args.no_checker:
        ConfigChecker(model=ddp, shell_path=args.shell_path, output_zip_path=args.pack, fmk="pytorch")
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss).hex())
    print(f"LOSSES {rank}: {' '.join(losses)}", flush=True)
    del ddp, model, opt  # the DDP reducer holds the gloo group: release it before the group goes
    finish_distributed()  # closes the checker (its pack is complete), destroys the process group


if __name__ == "__main__":
    main()
