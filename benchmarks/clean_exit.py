"""Proof that two-rank runs with msprobe on end with exit status 0 every time (``make exit-check``).

A gloo process group torn down at interpreter exit while a framework wrapper (the DDP module and its
reducer, a DeepSpeed engine, megatron-core's DDP) still holds it can abort a rank ("terminate called
without an active exception", exit -6), and torchrun then fails the whole run. The documented end of a
run is: close msprobe, release the wrappers, ``msprobe_core.session.finish_distributed()``
(``msprobe_core.pytorch.shutdown``). This launches each scenario ``--repeats`` times as two ranks under
``torch.distributed.run`` and counts the runs that exit 0:

- ``ddp-statistics`` / ``ddp-tensor``: torch DDP with ``ProbeSession``: the dump (L1, ``statistics`` or
  ``tensor``) and the monitor (activations, gradients, weights, Adam moments; CSV and TensorBoard);
- ``hf``: the Hugging Face Trainer (gloo DDP) with ``MsprobeCallback`` (L1 statistics dump and monitor);
- ``deepspeed``: ``recipes/deepspeed_zero.py`` (ZeRO-2, ``patch_engine``: L1 dump and monitor);
- ``megatron``: ``recipes/megatron_core_gpt.py`` with ``--msprobe-config`` / ``--msprobe-monitor-config``
  (the Megatron hooks);
- ``ddp-unreleased`` (not in the default set): plain DDP ending with ``destroy_process_group()`` while
  the DDP module is still alive, to see the abort this avoids.

    python benchmarks/clean_exit.py [--repeats 30] [--scenarios ddp-statistics,hf,...]

Exits 1 unless every run of every scenario exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from msprobe_core.common.ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RECIPES = os.path.join(ROOT, "recipes")

DEFAULT = ("ddp-statistics", "ddp-tensor", "hf", "deepspeed", "megatron")
MONITOR = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
           "param_distribution": True, "ops": ["min", "max", "norm", "nans"], "format": ["csv", "tensorboard"]}


# ------------------------------------------------------------------------------------------ the ranks
def ddp_worker(out: str, task: str, release: bool = True) -> None:
    """Two-rank DDP, 4 steps, with the dump and the monitor through ``ProbeSession``."""
    import torch
    import torch.distributed as dist

    from msprobe_core.session import ProbeSession, finish_distributed

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    session = None
    if release:
        session = ProbeSession({"task": task, "level": "L1", "dump_path": os.path.join(out, "dump")}, MONITOR,
                               monitor_output_dir=os.path.join(out, "monitor"))
        session.attach(ddp, optimizer, start_iteration=1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(1, 5):
        if session:
            session.begin_step(step)
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        if session:
            session.before_optimizer_step()
        optimizer.step()
        if session:
            session.after_optimizer_step(step)
            session.end_step()
    if not release:  # what the abort looks like: the DDP module is alive while the group goes
        dist.destroy_process_group()
        return
    session.close()
    del ddp, model, optimizer
    finish_distributed()


def hf_worker(out: str) -> None:
    """The Trainer (DDP over gloo, a tiny Llama, 3 optimizer steps) with ``MsprobeCallback``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from msprobe_core.session import finish_distributed
    from msprobe_integrations.hf import MsprobeCallback

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 256, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))
    callback = MsprobeCallback(config_path={"task": "statistics", "level": "L1", "dump_path": os.path.join(out, "dump")},
                               monitor_config_path=MONITOR, monitor_output_dir=os.path.join(out, "monitor"))
    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), max_steps=3, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, ddp_backend="gloo",
                             logging_steps=1, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    trainer.train()  # the callback closes its session at on_train_end
    del trainer, model
    finish_distributed()


# ------------------------------------------------------------------------------------------ the driver
def command(scenario: str, out: str) -> list[str]:
    """The script and arguments each rank runs for ``scenario``."""
    if scenario == "deepspeed":
        return [os.path.join(RECIPES, "deepspeed_zero.py"), "--stage", "2", "--steps", "2", "--level", "L1",
                "--out", out]
    if scenario == "megatron":
        dump, monitor = os.path.join(out, "dump.json"), os.path.join(out, "monitor.json")
        with open(dump, "w") as f:
            json.dump({"task": "statistics", "level": "L1", "dump_path": os.path.join(out, "dump")}, f)
        with open(monitor, "w") as f:
            json.dump(MONITOR, f)
        return [os.path.join(RECIPES, "megatron_core_gpt.py"), "--train-iters", "2", "--msprobe-config", dump,
                "--msprobe-monitor-config", monitor, "--msprobe-monitor-output-dir", os.path.join(out, "monitor")]
    return [os.path.abspath(__file__), "--worker", scenario, "--out", out]


def run_once(scenario: str, timeout: float) -> tuple[int, str]:
    """One two-rank run in a fresh folder: (exit status, the tail of its output)."""
    out = tempfile.mkdtemp(prefix=f"clean_exit_{scenario}_")
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *command(scenario, out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return -9, f"timed out after {timeout} s\n{exc.stderr or ''}"[-1500:]
        return proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--scenarios", default=",".join(DEFAULT),
                    help=f"comma-separated, of {', '.join(DEFAULT)}, ddp-unreleased (default: all but the last)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "hf":
        hf_worker(args.out)
        return 0
    if args.worker:
        task = args.worker.split("-")[1]
        ddp_worker(args.out, task if task != "unreleased" else "statistics", release=task != "unreleased")
        return 0
    failed = False
    for scenario in args.scenarios.split(","):
        t0, ok, seen = time.time(), 0, []
        for i in range(args.repeats):
            t1 = time.time()
            code, tail = run_once(scenario, args.timeout)
            ok += code == 0
            print(f"  {scenario} run {i + 1}: exit {code} ({time.time() - t1:.1f} s)", file=sys.stderr, flush=True)
            if code != 0 and len(seen) < 2:
                seen.append(tail)
        failed |= ok != args.repeats
        print(f"{scenario:15s} {ok:3d} of {args.repeats} runs exited 0  ({(time.time() - t0) / args.repeats:.1f} s a run)",
              flush=True)
        for tail in seen:
            print("  a failed run ended with:\n    " + tail.strip().replace("\n", "\n    "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
