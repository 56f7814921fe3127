"""The Megatron integration against real megatron-core 0.16.1 on the CPU.

In-process: a tiny ``GPTModel`` in megatron-core's DDP, a Megatron optimizer (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params`` under bf16, ``DistributedOptimizer``; all in a
``ChainedOptimizer``) and ``get_forward_backward_func`` with two micro-batches per iteration, trained for
three iterations with and without the probe: losses and weights are bit-identical, and the dump's and the
monitor's numbers equal statistics computed directly with torch from tensors captured (by plain hooks)
in the run without the probe. Subprocesses: the recipe and the launcher (``python -m
msprobe_integrations.megatron recipes/pretrain_gpt.py``, against the test stand-in of
``megatron.training`` in ``tests/standins/megatron_lm``), data parallelism with the distributed optimizer
(sharded statistics equal the full-tensor ones of the non-distributed optimizer) and pipeline + virtual
pipeline parallelism (chunk-indexed names, micro-batches, pipeline stage), each with two gloo ranks.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RECIPES = os.path.join(ROOT, "recipes")
if RECIPES not in sys.path:
    sys.path.insert(0, RECIPES)

import megatron_support as ms  # noqa: E402
from dist_run import torchrun  # noqa: E402

from msprobe_integrations.megatron import (MegatronHooks, MegatronProbe, add_args, compose,  # noqa: E402
                                           parse_known, with_msprobe_args)

MONITOR = {"targets": {}, "xy_distribution": True, "wg_distribution": True, "mv_distribution": True,
           "param_distribution": True, "ops": ["min", "max", "norm", "mean", "nans"], "format": ["api", "csv"]}
PARAM = "decoder.layers.0.mlp.linear_fc1.weight"
LAYER = "decoder.final_layernorm"


# ================================================================================ argument parsing (fast)
def _user_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--user-flag", type=int, default=0)
    return parser


def test_add_args_composes_with_the_users_provider_megatron_style():
    import megatron_core_gpt as recipe

    argv = ["--num-layers", "3", "--user-flag", "7", "--msprobe-config", "d.json", "--msprobe-monitor-config", "m.json"]
    args = recipe.parse_args(compose(_user_provider, add_args), argv=argv)
    assert (args.num_layers, args.user_flag, args.msprobe_config, args.msprobe_monitor_config) == (3, 7, "d.json", "m.json")
    assert args.msprobe_monitor_output_dir is None and args.msprobe_no_hparams is False
    # twice (the script's own provider and the launcher's) is harmless; None providers are skipped
    twice = recipe.parse_args(compose(add_args, with_msprobe_args(None), None), argv=["--msprobe-config", "x"])
    assert twice.msprobe_config == "x"
    probe = MegatronProbe.from_args(args)
    assert probe.enabled and probe.config_path == "d.json" and probe.monitor_config_path == "m.json"
    assert not MegatronProbe.from_args(recipe.parse_args(add_args, argv=[])).enabled
    assert parse_known(["--lr", "0.1", "--msprobe-monitor-config", "m.json"]).msprobe_monitor_config == "m.json"


def test_parse_args_wrapper_adds_the_flags_to_megatrons_parser():
    import megatron_core_gpt as recipe

    wrapped = MegatronHooks().parse_args_wrapper(recipe.parse_args)
    args = wrapped(_user_provider, argv=["--user-flag", "2", "--msprobe-config", "c.json"])
    assert args.user_flag == 2 and args.msprobe_config == "c.json"
    args = wrapped(argv=["--msprobe-monitor-config", "m.json"])  # no user provider at all
    assert args.msprobe_monitor_config == "m.json"
    assert MegatronHooks().parse_args_wrapper(wrapped) is wrapped  # never wrapped twice
    with pytest.raises(SystemExit):
        recipe.parse_args(None, argv=["--msprobe-config", "c.json"])  # unknown to Megatron without add_args


_run = ms.run_child


def test_launcher_help_and_usage_errors(tmp_path):
    out = _run([sys.executable, "-m", "msprobe_integrations.megatron", "--help"])
    assert out.returncode == 0
    for flag in ("--msprobe-config", "--msprobe-monitor-config", "--msprobe-monitor-output-dir", "--msprobe-config-check",
                 "train_step"):
        assert flag in out.stdout
    out = _run([sys.executable, "-m", "msprobe_integrations.megatron", "recipes/pretrain_gpt.py",
                "--msprobe-config", str(tmp_path / "missing.json")], env={"EXTRA_PATH": ms.STANDIN})
    assert out.returncode == 2 and "missing.json" in out.stderr and "no such file" in out.stderr
    if importlib.util.find_spec("megatron.training") is None:  # megatron-core < 0.17 ships no Megatron-LM loop
        cfg = tmp_path / "c.json"
        cfg.write_text("{}")
        out = _run([sys.executable, "-m", "msprobe_integrations.megatron", "recipes/pretrain_gpt.py", "--msprobe-config",
                    str(cfg)])
        assert out.returncode == 2 and "megatron.training" in out.stderr  # megatron-core alone has no train_step


def test_mindspeed_patch_manager_registration_contract():
    """mindspeed is not installable here (not on PyPI; needs torch_npu). This checks the contract of its
    ``MindSpeedPatchesManager`` that the registration relies on, with a recording stand-in: the three
    dotted targets, decorators whose names end in "wrapper" (MindSpeed applies those on top of its own
    replacements instead of refusing a second replacement), and wrappers that call through."""
    from msprobe_integrations.megatron import mindspeed

    calls = []

    class RecordingManager:  # test stand-in with MindSpeedPatchesManager's two static methods
        @staticmethod
        def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
            calls.append((orig_func_name, new_func))

        @staticmethod
        def apply_patches():
            calls.append(("apply", None))

    hooks = MegatronHooks()
    mindspeed.register(hooks, RecordingManager)
    assert [c[0] for c in calls] == ["megatron.training.training.train_step",
                                     "megatron.training.training.setup_model_and_optimizer",
                                     "megatron.training.arguments.parse_args", "apply"]
    assert all(fn.__name__.endswith("wrapper") for _, fn in calls[:3])
    train_step = calls[0][1](lambda forward_step_func, data_iterator, model, optimizer, *rest: "stepped")
    assert train_step(None, None, [], None) == "stepped"  # no flags given: calls straight through
    assert not hooks.get_probe().enabled
    calls.clear()
    mindspeed.register(hooks, RecordingManager, apply=False)  # inside a feature: MindSpeed applies
    assert "apply" not in [c[0] for c in calls]


# ================================================================================ in-process, real megatron-core
@pytest.fixture(scope="module")
def megatron_cpu():
    with ms.megatron_on_cpu():
        yield


class Spy:
    """Independent capture (plain hooks, no msprobe code) at one iteration of a run without the probe."""

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.current = 0
        self.outputs: list[torch.Tensor] = []
        self.grad = self.weight = self.exp_avg = self.exp_avg_sq = None

    def hook(self, module, args, output):
        if self.current == self.iteration:
            self.outputs.append(output.detach().float().clone())

    def before_step(self, param):
        if self.current == self.iteration:
            self.grad = param.main_grad.detach().float().clone()
            main = getattr(param, "main_param", None)
            self.weight = (main if main is not None else param).detach().float().clone()

    def after_step(self, param, optimizer):
        if self.current != self.iteration:
            return
        main = getattr(param, "main_param", None)
        for leaf in optimizer.chained_optimizers:
            for key, state in leaf.optimizer.state.items():
                same = key is main if main is not None else (key.data_ptr() == param.data_ptr() and key.numel() == param.numel())
                if same:
                    self.exp_avg, self.exp_avg_sq = state["exp_avg"].clone(), state["exp_avg_sq"].clone()


def train(kind: str, steps: int = 3, probe: MegatronProbe | None = None, spy: Spy | None = None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    bf16, dist = kind == "bf16", kind == "distributed"
    model = ms.wrap_ddp(ms.gpt_chunks(ms.transformer_config(bf16=bf16), seed=0), use_distributed_optimizer=dist)
    optimizer = ms.megatron_optimizer(model, ms.optimizer_config(bf16=bf16, use_distributed_optimizer=dist))
    ms.set_schedule_hooks(model, optimizer)
    inner = model[0].module
    param = dict(inner.named_parameters())[PARAM]
    handle = inner.get_submodule(LAYER).register_forward_hook(spy.hook) if spy else None
    if probe is not None:
        args = SimpleNamespace(num_layers=2, hidden_size=32, num_attention_heads=4, micro_batch_size=4, global_batch_size=8,
                               lr=1e-2, clip_grad=1.0, train_iters=steps, bf16=bf16, seq_length=ms.SEQ, iteration=0,
                               use_distributed_optimizer=dist)
        probe.setup(model, optimizer, None, args)
    data, step_fn = ms.batches(4, seed=1), get_forward_backward_func()
    losses, metrics = [], {}
    for i in range(1, steps + 1):
        if spy:
            spy.current = i
        if probe:
            probe.begin_iteration(i)
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = step_fn(forward_step_func=ms.forward_step, data_iterator=data, model=model, num_microbatches=2,
                          seq_length=ms.SEQ, micro_batch_size=4, forward_only=False)
        if spy:
            spy.before_step(param)
        optimizer.step()
        if spy:
            spy.after_step(param, optimizer)
        if probe:
            probe.end_iteration()
            if probe.session.monitor is not None:
                metrics[i] = probe.session.monitor.get_metrics()
        losses.append(ms.reported_loss(reduced))
    if handle:
        handle.remove()
    weights = {n: p.detach().clone() for n, p in inner.named_parameters()}
    return losses, weights, metrics, optimizer


def expected(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double().flatten()
    return {"min": t.min().item(), "max": t.max().item(), "norm": t.norm().item(), "mean": t.mean().item()}


def assert_stats(got: dict, tensor: torch.Tensor, keys=("min", "max", "norm", "mean"), names=None) -> None:
    want = expected(tensor)
    scale = max(abs(want["min"]), abs(want["max"]))
    for key in keys:
        g = got[(names or {}).get(key, key)]
        assert math.isclose(g, want[key], rel_tol=1e-5, abs_tol=1e-6 * scale), (key, g, want[key])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "bf16", "distributed"])
def test_dump_and_monitor_equal_an_independent_computation_losses_unchanged(megatron_cpu, tmp_path, kind):
    spy = Spy(iteration=2)
    ref_losses, ref_weights, _, ref_opt = train(kind, spy=spy)
    expected_leaf = {"fp32": "FP32Optimizer", "bf16": "Float16OptimizerWithFloat16Params",
                     "distributed": "DistributedOptimizer"}[kind]
    assert [type(o).__name__ for o in ref_opt.chained_optimizers] == [expected_leaf]

    dump = tmp_path / "dump"
    probe = MegatronProbe({"task": "statistics", "level": "L0", "dump_path": str(dump)}, MONITOR,
                          monitor_output_dir=str(tmp_path / "mon"))
    try:
        losses, weights, metrics, optimizer = train(kind, probe=probe)
    finally:
        probe.close()
    assert losses == ref_losses and all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    assert "step" not in vars(optimizer)  # optimizer.step restored

    # dump: one step per iteration (Megatron's numbering), both micro-batches, chunk-indexed names
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == ["step1", "step2", "step3"]
    data = json.loads((dump / "step2" / "rank0" / "dump.json").read_text())["data"]
    base = f"Module.0.{LAYER}.LayerNorm"
    assert f"{base}.forward.1" in data and f"{base}.forward.2" not in data and f"{base}.backward.1" in data
    for micro in (0, 1):
        out = data[f"{base}.forward.{micro}"]["output"][0]
        assert_stats(out, spy.outputs[micro], names={"min": "Min", "max": "Max", "norm": "Norm", "mean": "Mean"})

    # monitor at iteration 2: activations per micro-batch, reduced main_grad, fp32 main weights, Adam moments
    step2 = metrics[2]
    assert step2["step"] == 2
    m = step2["metrics"]
    for micro in (0, 1):
        assert_stats(m["actv"][f"{LAYER}.output:{micro}"], spy.outputs[micro])
    assert_stats(m["grad"][PARAM], spy.grad)
    assert_stats(m["param"][PARAM], spy.weight)
    assert_stats(m["exp_avg"][PARAM], spy.exp_avg)
    assert_stats(m["exp_avg_sq"][PARAM], spy.exp_avg_sq)
    assert m["grad"][PARAM]["nans"] == 0
    assert sorted(metrics) == [1, 2, 3]

    # hyperparameters: Megatron's own names under args, normalised values, optimizer chain
    hp = json.loads((dump / "hyperparameters.json").read_text())
    assert hp["source"] == "megatron"
    assert hp["args"]["num_layers"] == 2 and hp["args"]["micro_batch_size"] == 4 and hp["args"]["lr"] == 1e-2
    norm = hp["normalized"]
    assert norm["learning_rate"] == 1e-2 and norm["micro_batch_size"] == 4 and norm["max_steps"] == 3
    assert norm["max_grad_norm"] == 1.0 and norm["num_layers"] == 2 and norm["gradient_accumulation_steps"] == 2
    assert norm["mixed_precision"] == ("bf16" if kind == "bf16" else "fp32")
    assert hp["megatron_optimizer"] == {"class": "ChainedOptimizer", "chained": [expected_leaf]}
    assert hp["model_config"]["hidden_size"] == 32 and hp["optimizer_config"]["clip_grad"] == 1.0
    assert (tmp_path / "mon" / "hyperparameters.json").exists()


# ================================================================================ subprocesses
_losses = ms.lm_losses


def _configs(tmp_path):
    dump_cfg = tmp_path / "dump.json"
    dump_cfg.write_text(json.dumps({"task": "statistics", "level": "L0", "dump_path": str(tmp_path / "dump")}))
    mon_cfg = tmp_path / "monitor.json"
    mon_cfg.write_text(json.dumps(dict(MONITOR, format=["csv"])))
    return dump_cfg, mon_cfg


def _check_outputs(tmp_path, iters: int, extra_arg: str | None = None) -> dict:
    dump, mon = tmp_path / "dump", tmp_path / "mon"
    assert sorted(p.name for p in dump.iterdir() if p.is_dir()) == [f"step{i}" for i in range(1, iters + 1)]
    for i in range(1, iters + 1):
        rows = list(csv.DictReader(open(mon / "rank0" / f"grad_{i}-{i}.csv")))
        assert rows and {r["step"] for r in rows} == {str(i)}
    hp = json.loads((dump / "hyperparameters.json").read_text())
    for name in ("num_layers", "hidden_size", "micro_batch_size", "global_batch_size", "lr", "train_iters",
                 "clip_grad", "seq_length", "msprobe_config"):
        assert name in hp["args"], name
    assert hp["args"]["train_iters"] == iters and hp["normalized"]["max_steps"] == iters
    if extra_arg:
        assert extra_arg in hp["args"]
    assert json.loads((mon / "hyperparameters.json").read_text())["args"] == hp["args"]
    return hp


@pytest.fixture(scope="module")
def plain_losses():
    """The recipe's losses without any msprobe flag (two iterations)."""
    plain = _run([sys.executable, "recipes/megatron_core_gpt.py", "--train-iters", "2"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    losses = _losses(plain.stdout)
    assert len(losses) == 2
    return losses


@pytest.mark.slow
def test_recipe_flags_dump_monitor_hyperparameters_losses_unchanged(tmp_path, plain_losses):
    dump_cfg, mon_cfg = _configs(tmp_path)
    probed = _run([sys.executable, "recipes/megatron_core_gpt.py", "--train-iters", "2", "--msprobe-config",
                   str(dump_cfg), "--msprobe-monitor-config", str(mon_cfg), "--msprobe-monitor-output-dir",
                   str(tmp_path / "mon")])
    assert probed.returncode == 0, probed.stderr[-3000:]
    assert _losses(probed.stdout) == plain_losses
    _check_outputs(tmp_path, 2)


@pytest.mark.slow
def test_launcher_runs_a_pretrain_gpt_shaped_script_with_zero_edits(tmp_path, plain_losses):
    """``python -m msprobe_integrations.megatron recipes/pretrain_gpt.py ...`` against the labelled test
    stand-in of Megatron-LM's ``megatron.training`` (tests/standins/megatron_lm). The script trains the same
    model on the same data as the recipe, so its losses must be the recipe's plain ones."""
    dump_cfg, mon_cfg = _configs(tmp_path)
    launched = _run([sys.executable, "-m", "msprobe_integrations.megatron", "recipes/pretrain_gpt.py",
                     "--train-iters", "2", "--gpt-recipe-tag", "t", "--msprobe-config", str(dump_cfg),
                     "--msprobe-monitor-config", str(mon_cfg)],
                    env={"EXTRA_PATH": ms.STANDIN, "MONITOR_OUTPUT_DIR": str(tmp_path / "mon")})
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "building GPT model" in launched.stdout  # the script's own model_provider ran
    assert _losses(launched.stdout) == plain_losses
    hp = _check_outputs(tmp_path, 2, extra_arg="gpt_recipe_tag")  # the script's own provider still composes
    assert hp["args"]["gpt_recipe_tag"] == "t" and hp["args"]["msprobe_config"] == str(dump_cfg)
    assert hp["args"]["tokenizer_type"] == "NullTokenizer"  # args_defaults of pretrain() kept


def _torchrun(args):
    """The recipe as two gloo ranks; its stdout (a failed or hung job fails the test)."""
    return torchrun(os.path.join(RECIPES, "megatron_core_gpt.py"), *args, timeout=300, cwd=ROOT,
                    env={"PYTHONWARNINGS": "ignore"})


def _rows(path) -> dict[str, dict[str, float]]:
    return {r["name"]: {k: float(v) for k, v in r.items() if k not in ("name", "step")} for r in csv.DictReader(open(path))}


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_optimizer_shards_combine_to_full_tensor_statistics(tmp_path):
    """Two data-parallel ranks: the distributed optimizer's shard statistics (combined over the DP group)
    equal the full-tensor statistics of the same run with the non-distributed optimizer."""
    _, mon_cfg = _configs(tmp_path)
    outs = {}
    for name, extra in (("full", []), ("sharded", ["--use-distributed-optimizer"])):
        out_dir = tmp_path / name
        stdout = _torchrun(["--train-iters", "2", "--msprobe-monitor-config", str(mon_cfg),
                            "--msprobe-monitor-output-dir", str(out_dir)] + extra)
        outs[name] = (out_dir, _losses(stdout))
    assert outs["full"][1] == outs["sharded"][1]
    for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
        full = _rows(outs["full"][0] / "rank0" / f"{kind}_2-2.csv")
        for rank in (0, 1):
            sharded = _rows(outs["sharded"][0] / f"rank{rank}" / f"{kind}_2-2.csv")
            assert sharded.keys() == full.keys()
            for name, values in full.items():
                for op, v in values.items():
                    assert math.isclose(sharded[name][op], v, rel_tol=2e-5, abs_tol=1e-9), (kind, name, op)


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_and_virtual_pipeline_chunks_micro_batches_and_stages(tmp_path):
    dump_cfg, mon_cfg = _configs(tmp_path)
    stdout = _torchrun(["--train-iters", "2", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1", "--msprobe-config", str(dump_cfg),
                        "--msprobe-monitor-config", str(mon_cfg), "--msprobe-monitor-output-dir", str(tmp_path / "mon")])
    assert len(_losses(stdout)) == 2
    for rank in (0, 1):
        data = json.loads((tmp_path / "dump" / "step2" / f"rank{rank}" / "dump.json").read_text())["data"]
        for chunk in (0, 1):  # every rank holds two virtual pipeline chunks: Module.{chunk}.…
            layer = f"Module.{chunk}.decoder.layers.0.mlp.linear_fc1.ColumnParallelLinear"
            assert f"{layer}.forward.0" in data and f"{layer}.forward.1" in data and f"{layer}.forward.2" not in data
        actv = list(csv.DictReader(open(tmp_path / "mon" / f"rank{rank}" / "actv_2-2.csv")))
        names = {r["name"].split(":")[0] for r in actv}
        assert names == {"0", "1"} and {r["micro_step"] for r in actv} == {"0", "1"}
        grads = _rows(tmp_path / "mon" / f"rank{rank}" / "grad_2-2.csv")
        assert any(n.startswith("0:") for n in grads) and any(n.startswith("1:") for n in grads)
    # the first stage holds the embedding (chunk 0), the last the output layer (chunk 1)
    assert "0:embedding.word_embeddings.weight" in _rows(tmp_path / "mon" / "rank0" / "grad_2-2.csv")
    assert "1:output_layer.weight" in _rows(tmp_path / "mon" / "rank1" / "grad_2-2.csv")
