"""``python -m msprobe_core anomalies MONITOR_DIR``: list the monitor's anomalies in order, name the first.

Reads every rank's ``anomalies.json`` (written when the config's ``alert.dump`` is true) or the SQLite
database of ``alert.inform`` (one event per fault: its origin and how many tensors it reached), orders them
across ranks as the data was produced (step; weights, then forward and backward per micro-batch, then
gradients and optimizer state; pipeline stage; call order) and prints one line each.
"""

from __future__ import annotations

import argparse
import json

from msprobe_core.monitor.anomaly_store import load_anomalies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of the ``anomalies`` command."""
    parser.add_argument("monitor_dir", help="the monitor output folder (MONITOR_OUTPUT_DIR), a rank folder, "
                                            "one anomalies.json, or the SQLite database of alert.inform")
    parser.add_argument("-k", "--top", type=int, default=0, help="list only the first K anomalies (0: all)")
    parser.add_argument("-s", "--step", type=int, action="append", default=None,
                        help="only this step (repeat for several)")
    parser.add_argument("--rank", type=int, action="append", default=None, help="only this rank (repeat for several)")
    parser.add_argument("--json", action="store_true", help="print the ordered anomalies as JSON")


def run(args: argparse.Namespace) -> int:
    """List the anomalies; returns 0 (also when there are none)."""
    anomalies = load_anomalies(args.monitor_dir)
    if args.step:
        anomalies = [a for a in anomalies if a.step in args.step]
    if args.rank:
        anomalies = [a for a in anomalies if a.rank in args.rank]
    shown = anomalies[: args.top] if args.top and args.top > 0 else anomalies
    if args.json:
        print(json.dumps({"count": len(anomalies), "first": shown[0].to_dict() if shown else None,
                          "anomalies": [a.to_dict() for a in shown]}, indent=1))
        return 0
    if not anomalies:
        print(f"no anomalies under {args.monitor_dir}")
        return 0
    for i, a in enumerate(shown, 1):
        print(f"{i:4d}. {a.describe()}")
    if len(shown) < len(anomalies):
        print(f"... {len(anomalies) - len(shown)} more")
    first = anomalies[0]
    where = f"module '{first.module}'" if first.module else "the model"
    reach = f"; it reached {first.reached} tensors" if first.reached > 1 else ""
    print(f"first anomaly: step {first.step}, rank {first.rank}, {first.stage}, {first.kind} '{first.name}' "
          f"in {where}: {first.metric}={first.value:.6g} ({first.rule}{reach})")
    return 0
