"""Can a user trust the monitor's alerts? False alerts on healthy runs and faults caught, over a model zoo.

The workloads are ``benchmarks.alert_models``: transformers with -inf, ``finfo.min`` and boolean masks, a
TinyGPT (2 layers, hidden 64),
Hugging Face Llama and GPT-2 from tiny configs, a CNN with BatchNorm and Dropout on SGD with momentum, a
noisy small-batch MLP, autocast fp16/bf16 with a dynamic loss scaler; LR warm-up and decay, gradient
clipping, gradient accumulation. Every metric is on (``xy``, ``wg``, ``mv``, ``param``, all six ops) with
msprobe's default rule (``AnomalyTurbulence``, threshold 0.5).

* **Healthy**: ``--steps`` (40) optimizer steps per workload; every alert is a false alert. Steps the loss
  scaler skipped are counted apart (they are reported as skipped steps, not as anomalies).
* **Faults**: each fault of ``alert_models.FAULTS`` injected at step ``--fault-step`` (25) of a fresh run,
  which goes on 5 steps. A fault is caught when the first alert at or after the fault's step is at that
  step and names the fault's parameter, its module, the learning rate, or (a NaN in the batch) the input
  of the first module; under fp16 loss scaling a gradient that explodes overflows, and the step reported
  as skipped, naming the overflowing gradient, catches it too. "events" counts the alerts the fault raised
  (one event per fault is the goal).

Usage: ``python benchmarks/monitor_alerts.py [--seeds 0,1] [--workloads hf_llama,cnn_bn_sgd] [--json]``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from alert_models import FAULT_STEP, FAULTS, MONITOR_CONFIG, STEPS, WORKLOADS, Fault, build, run  # noqa: E402

AFTER_FAULT = 5
"""Steps a faulted run goes on after the fault."""


@dataclass
class HealthyResult:
    workload: str
    seed: int
    steps: int
    false_alerts: list[str] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    """Monitor steps whose update the loss scaler skipped (reported apart, not as alerts)."""
    scaler_skips: list[int] = field(default_factory=list)
    """The same, as training-loop iterations."""
    seconds: float = 0.0


@dataclass
class FaultResult:
    workload: str
    fault: str
    seed: int
    step: int
    """The monitor step the fault was injected at (optimizer steps taken before it)."""
    caught: bool
    first: Optional[str]
    events: int
    early_alerts: int
    """Alerts before the fault (false alerts)."""
    expected: str
    masked: bool = False
    """A gradient fault at an iteration the loss scaler skips in the healthy run too: the update is discarded
    (and clipping zeroes the finite gradients), so the fault changes nothing and is not counted."""


def _monitor(w: Any, out: Path, config: dict | None = None) -> Any:
    from msprobe_core.pytorch import TrainerMon

    mon = TrainerMon(dict(config or MONITOR_CONFIG), output_dir=str(out))
    mon.set_monitor(w.model, w.grad_acc, w.optimizer)
    return mon


def healthy_run(name: str, seed: int = 0, steps: int = STEPS, config: dict | None = None) -> HealthyResult:
    """Train workload ``name`` ``steps`` healthy steps with every metric on; the alerts are false alerts."""
    w = build(name, seed)
    with tempfile.TemporaryDirectory(prefix="alerts_") as tmp:
        mon = _monitor(w, Path(tmp), config)
        t0 = time.perf_counter()
        try:
            run(w, steps)
        finally:
            mon.close()
    return HealthyResult(name, seed, steps, [a.describe() for a in mon.anomalies],
                         [s.step for s in mon.skipped_steps], list(w.skipped), time.perf_counter() - t0)


def fault_run(name: str, fault_kind: str, seed: int = 0, fault_step: int = FAULT_STEP,
              config: dict | None = None, healthy_skips: tuple[int, ...] = ()) -> Optional[FaultResult]:
    """Inject ``fault_kind`` at ``fault_step`` of workload ``name``; None when the fault does not apply.
    ``healthy_skips``: the iterations the loss scaler skips in the healthy run (see ``FaultResult.masked``)."""
    w = build(name, seed)
    fault = Fault(fault_kind, fault_step)
    if not fault.applies_to(w):
        return None
    at: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="alerts_") as tmp:
        mon = _monitor(w, Path(tmp), config)

        def before(step: int) -> None:
            if step == fault_step:
                at["step"] = mon.step_index

        try:
            run(w, fault_step + AFTER_FAULT, fault, before_step=before)
        finally:
            mon.close()
    step = at["step"]
    found = mon.anomalies
    early = [a for a in found if a.step < step]
    later = [a for a in found if a.step >= step]
    first = later[0] if later else None
    caught = first is not None and first.step == step and fault.named_by(w, first)
    described = first.describe() if first else None
    if first is None or first.step > step:  # under a loss scaler, an exploding gradient overflows: a skipped step
        skip = next((s for s in mon.skipped_steps if s.step == step and w.target in s.overflowed), None)
        if skip is not None and fault.kind == "grad_explode":
            caught = True
            described = (f"skipped step {skip.step}: {w.target} among the {len(skip.overflowed)} overflowing "
                         f"gradients (first {skip.origin})")
    masked = fault.kind == "grad_explode" and fault_step in healthy_skips and not caught
    return FaultResult(name, fault_kind, seed, step, caught, described, len(later), len(early), fault.expected(w),
                       masked)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ", ".join(FAULTS))
    p.add_argument("--seeds", default="0", help="comma-separated seeds (each a fresh run of every workload)")
    p.add_argument("--steps", type=int, default=STEPS, help="healthy steps per workload")
    p.add_argument("--fault-step", type=int, default=FAULT_STEP, help="the step faults are injected at")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (results do not depend on it)")
    p.add_argument("--json", action="store_true", help="print every result as JSON at the end")
    p.add_argument("-v", "--verbose", action="store_true", help="print each false alert and each fault's first alert")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("msprobe_core").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    names = [n for n in args.workloads.split(",") if n]
    faults = [f for f in args.faults.split(",") if f]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"--workloads: unknown workload '{n}'; known: {', '.join(WORKLOADS)}")
    for f in faults:
        if f not in FAULTS:
            p.error(f"--faults: unknown fault '{f}'; known: {', '.join(FAULTS)}")

    healthy: list[HealthyResult] = []
    injected: list[FaultResult] = []
    t0 = time.perf_counter()
    print(f"{'workload':<18} {'seed':>4} {'healthy steps':>13} {'false alerts':>12} {'skipped':>7}   "
          f"faults caught (events)")
    for seed in seeds:
        for name in names:
            h = healthy_run(name, seed, args.steps)
            healthy.append(h)
            row: list[str] = []
            for f in faults:
                r = fault_run(name, f, seed, args.fault_step, healthy_skips=tuple(h.scaler_skips))
                if r is None:
                    continue
                injected.append(r)
                row.append(f"{f}:{'masked' if r.masked else 'ok' if r.caught else 'MISSED'}({r.events})")
            print(f"{name:<18} {seed:>4} {h.steps:>13} {len(h.false_alerts):>12} {len(h.skipped_steps):>7}   "
                  f"{' '.join(row)}", flush=True)
            if args.verbose:
                for line in h.false_alerts:
                    print(f"    false alert: {line}")
                for r in injected[-len(row):] if row else []:
                    print(f"    {r.fault} at step {r.step} (expected {r.expected}): {r.first}")
    steps = sum(h.steps for h in healthy)
    false = sum(len(h.false_alerts) for h in healthy)
    masked = sum(r.masked for r in injected)
    injected = [r for r in injected if not r.masked]
    caught = sum(r.caught for r in injected)
    one_event = sum(r.caught and r.events <= 1 for r in injected)
    early = sum(r.early_alerts for r in injected)
    print()
    print(f"false alerts on healthy runs: {false} in {steps} healthy steps ({len(healthy)} runs); "
          f"loss-scaler skipped steps reported apart: {sum(len(h.skipped_steps) for h in healthy)}")
    print(f"faults caught at their step, naming their origin: {caught}/{len(injected)} "
          f"(one event per fault: {one_event}/{len(injected)}; alerts before a fault: {early}"
          + (f"; {masked} masked by a step the loss scaler skips anyway, not counted" if masked else "") + ")")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        print(json.dumps({"healthy": [asdict(h) for h in healthy], "faults": [asdict(r) for r in injected]}, indent=1))
    return 0 if false == 0 and caught == len(injected) else 1


if __name__ == "__main__":
    sys.exit(main())
