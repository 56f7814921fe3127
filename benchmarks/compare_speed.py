"""Compare speed on the small GPT: two L1 tensor dumps of one training step, then ``compare`` timed.

Three dumps, each in a fresh process: the golden run; an identical rerun; and a run whose
``blocks[2].mlp.fc`` weight has its sign flipped, so every tensor from that layer on differs (the worst
case for the metrics: nothing is bitwise equal). Then ``python -m msprobe_core compare`` runs end to end
(process start, reading, metrics, CSV and xlsx) on identical and on perturbed, ``--repeats`` times each,
pinned to ``--cpus`` CPUs; the median wall time is reported, plus the dump size. The perturbed compare
must name ``Functional.linear.10.forward`` (block 2's fc) as the first divergence.

    python benchmarks/compare_speed.py [--repeats 3] [--cpus 2] [--workers N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXPECTED = "Functional.linear.10.forward"

DUMP_CHILD = r"""
import sys
sys.path.insert(0, {here!r})
import torch
torch.set_num_threads(2)
import small_gpt
from msprobe_core.pytorch import PrecisionDebugger
model, opt, data = small_gpt.build()
if {perturb!r}:
    with torch.no_grad():
        model.blocks[2].mlp.fc.weight.neg_()
dbg = PrecisionDebugger({{"task": "tensor", "dump_path": {out!r}, "level": "L1", "step": [0]}})
small_gpt.train(model, opt, data, 1, lambda i: dbg.start(model), lambda i: (dbg.stop(), dbg.step()))
"""


def dump(out: str, perturb: bool) -> None:
    """Dump one step of the small GPT at L1, task tensor, in a fresh process."""
    code = DUMP_CHILD.format(here=HERE, perturb=perturb, out=out)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)


def dump_size(path: str) -> tuple[int, int, int]:
    """(tensor files, their bytes, bytes on disk) under ``path``: the dumper hard-links a tensor saved
    twice, which compare also reads once."""
    files = total = 0
    inodes: dict[tuple[int, int], int] = {}
    for folder, _, names in os.walk(path):
        for name in names:
            if name.endswith(".pt"):
                st = os.stat(os.path.join(folder, name))
                files += 1
                total += st.st_size
                inodes[(st.st_dev, st.st_ino)] = st.st_size
    return files, total, sum(inodes.values())


def _pin(cpus: int):
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    chosen = set(available[:cpus]) if available else None

    def preexec() -> None:
        if chosen:
            os.sched_setaffinity(0, chosen)
    return preexec, (len(chosen) if chosen else os.cpu_count())


def time_compare(target: str, golden: str, out: str, cpus: int, workers: int | None) -> tuple[float, dict]:
    """Wall seconds of one ``python -m msprobe_core compare`` run, and its compare_summary.json."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "msprobe_core", "compare", "-t", target, "-g", golden, "-o", out, "-q"]
    if workers:
        cmd += ["--workers", str(workers)]
    preexec, _ = _pin(cpus)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=preexec)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"compare failed ({proc.returncode}): {proc.stderr}")
    with open(os.path.join(out, "compare_summary.json"), encoding="utf-8") as f:
        return seconds, json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs the compare process may use")
    parser.add_argument("--workers", type=int, default=None, help="compare --workers (default: its own)")
    parser.add_argument("--keep", default=None, help="keep the dumps in this folder (reused when present)")
    args = parser.parse_args()

    root = args.keep or tempfile.mkdtemp(prefix="compare_speed_")
    paths = {name: os.path.join(root, name) for name in ("golden", "same", "perturbed")}
    t0 = time.perf_counter()
    for name, path in paths.items():
        if not os.path.isdir(path):
            dump(path, perturb=name == "perturbed")
    dump_seconds = time.perf_counter() - t0
    files, size, disk = dump_size(paths["golden"])
    _, cpus = _pin(args.cpus)
    print(f"small GPT, one training step dumped at L1 (task tensor): {files} tensor files, "
          f"{size / 2**20:.0f} MiB per dump ({disk / 2**20:.0f} MiB on disk; dumping 3 runs took "
          f"{dump_seconds:.0f} s)")
    results = {}
    try:
        for name in ("same", "perturbed"):
            times = []
            for _ in range(args.repeats):
                seconds, summary = time_compare(paths[name], paths["golden"], os.path.join(root, f"out_{name}"),
                                                args.cpus, args.workers)
                times.append(seconds)
            pair = summary["pairs"][0]
            div = pair["first_divergence"]
            results[name] = {"median_s": round(statistics.median(times), 3), "runs_s": [round(t, 3) for t in times],
                             "rows": pair["rows"], "first_divergence": div and div["target_record"]}
            print(f"  compare {name:>9} vs golden on {cpus} CPUs: {statistics.median(times):.2f} s median "
                  f"(runs {', '.join(f'{t:.2f}' for t in times)}); rows {pair['rows']}; first divergence: "
                  f"{div['target_record'] if div else 'none'}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"benchmark": "compare_speed", "tensor_files": files, "bytes_per_dump": size,
                      "bytes_on_disk": disk,
                      "cpus": cpus, **results}))
    ok = results["same"]["first_divergence"] is None and results["perturbed"]["first_divergence"] == EXPECTED
    if not ok:
        print(f"unexpected result: the perturbed compare should name {EXPECTED}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
