"""Anomaly rules on synthetic series, ordering across ranks, the anomaly files and the ``anomalies`` command."""

from __future__ import annotations

import csv
import json
import math
import random

import torch

from msprobe_core.cli import main as cli_main
from msprobe_core.monitor.anomaly import Anomaly, order_key
from msprobe_core.monitor.detector import AnomalyDetector
from msprobe_core.monitor.anomaly_store import CSV_FIELDS, AnomalyFileWriter, load_anomalies
from msprobe_core.monitor.config import load_monitor_config
from msprobe_core.monitor.records import MetricRow
from msprobe_core.monitor.shard_stats import combine_partials, partials_to_ops, shard_partials
from msprobe_core.monitor.stats import StatsEngine

OPS = ("norm", "mean", "nans")


def detector(threshold=0.5, **args):
    cfg = load_monitor_config({"ops": list(OPS), "alert": {"rules": [
        {"rule_name": "AnomalyTurbulence", "args": {"threshold": threshold, **args}}]}})
    return AnomalyDetector(cfg.alert, cfg.ops)


def row(norm, mean=0.0, nans=0.0, kind="grad", name="w", numel=100, call_id=0):
    return MetricRow(kind, name, name.rpartition(".")[0], None, call_id, numel, [norm, mean, nans])


def feed(det, series, **kw):
    found = []
    for step, value in enumerate(series):
        found += det.check(0, step, [row(value, **kw)])
    return found


def test_warmup_trends_and_noise_do_not_alert():
    rng = random.Random(0)
    assert feed(detector(), [1, 100, 1, 100, 1]) == []  # still warming up (5 steps)
    assert feed(detector(), [1e-9 * (t + 1) for t in range(60)]) == []  # Adam's v filling up: linear ramp
    assert feed(detector(), [1.08 ** t for t in range(60)]) == []  # steady 8 % growth per step
    assert feed(detector(), [1 + 0.2 * rng.random() for _ in range(200)]) == []  # +-10 % noise
    d = detector()
    noisy_means = []
    for step in range(200):  # the mean of a zero-centred gradient: sign noise, never material
        noisy_means += d.check(0, step, [row(1.0, mean=rng.gauss(0, 1e-3))])
    assert noisy_means == []


def test_spike_alerts_once_with_baseline():
    series = [1.0 + 0.01 * (t % 3) for t in range(10)] + [50.0] * 5
    found = feed(detector(), series)
    assert len(found) == 1
    a = found[0]
    assert (a.step, a.metric, a.rule) == (10, "norm", "AnomalyTurbulence")
    assert 0.99 < a.baseline < 1.03 and a.value == 50.0
    assert feed(detector(threshold=100), series) == []  # below (1 + threshold) x baseline


def test_nan_reported_when_series_turns_bad_and_again_after_recovery():
    d = detector()
    out = []
    for step, (norm, nans) in enumerate([(1, 0), (math.nan, 3), (math.nan, 3), (1, 0), (math.inf, 0)]):
        out += d.check(0, step, [row(norm, nans=nans)])
    assert [(a.step, a.metric, a.value) for a in out] == [(1, "nans", 3.0), (4, "norm", math.inf)]
    assert all(a.rule == "AnomalyNan" for a in out)


def test_alias_rows_and_disabled_alerts_are_not_judged():
    d = detector()
    alias = MetricRow("actv", "b.input", "b", 0, 1, 10, [math.nan, 0.0, 1.0], alias=True)
    assert d.check(0, 0, [alias]) == []
    off = AnomalyDetector(load_monitor_config({"ops": list(OPS)}).alert, OPS)
    assert off.check(0, 0, [row(math.nan, nans=1)]) == []


def _anomaly(rank, step, stage, call_id, micro=None, pp=0, name="x"):
    return Anomaly(rank=rank, step=step, micro_step=micro, stage=stage, call_id=call_id, kind="actv", name=name,
                   module=name, metric="norm", value=1.0, baseline=0.5, rule="AnomalyTurbulence", pp_stage=pp)


def test_order_key_follows_data_flow_across_ranks_and_stages():
    items = [
        _anomaly(0, 3, "optimizer", 1),
        _anomaly(1, 3, "gradient", 9),
        _anomaly(0, 3, "backward", 7, micro=0),
        _anomaly(0, 3, "forward", 8, micro=1),
        _anomaly(1, 3, "forward", 2, micro=0),
        _anomaly(0, 3, "forward", 2, micro=0),
        _anomaly(0, 3, "param", 50),
        _anomaly(0, 2, "optimizer", 99),
        _anomaly(0, 3, "backward", 1, micro=0, pp=1),  # backward runs from the last pipeline stage
    ]
    ordered = sorted(items, key=order_key)
    assert [(a.step, a.stage, a.micro_step, a.rank, a.pp_stage) for a in ordered] == [
        (2, "optimizer", None, 0, 0), (3, "param", None, 0, 0), (3, "forward", 0, 0, 0), (3, "forward", 0, 1, 0),
        (3, "backward", 0, 0, 1), (3, "backward", 0, 0, 0), (3, "forward", 1, 0, 0), (3, "gradient", None, 1, 0),
        (3, "optimizer", None, 0, 0)]


def test_anomaly_files_and_command_line(tmp_path, capsys):
    AnomalyFileWriter(tmp_path / "rank0").add([_anomaly(0, 4, "forward", 5, micro=0, name="layers.1.mlp")])
    w1 = AnomalyFileWriter(tmp_path / "rank1")
    w1.add([_anomaly(1, 4, "forward", 3, micro=0, name="layers.0.attn")])
    nan = Anomaly(rank=1, step=5, micro_step=None, stage="param", call_id=0, kind="param", name="w", module="",
                  metric="norm", value=math.nan, baseline=None, rule="AnomalyNan")
    w1.add([nan])
    raw = json.loads((tmp_path / "rank1" / "anomalies.json").read_text())
    assert len(raw) == 2 and raw[1]["value"] == "nan"
    with open(tmp_path / "rank1" / "anomalies.csv", newline="", encoding="utf-8") as f:
        table = list(csv.reader(f))  # the same records for a spreadsheet: one row per event, None empty
    assert tuple(table[0]) == CSV_FIELDS and len(table) == 3
    second = dict(zip(table[0], table[2]))
    assert (second["name"], second["value"], second["baseline"], second["capture"]) == ("w", "nan", "", "")
    loaded = load_anomalies(tmp_path)
    assert [a.name for a in loaded] == ["layers.0.attn", "layers.1.mlp", "w"] and math.isnan(loaded[2].value)

    assert cli_main(["anomalies", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.index("layers.0.attn") < out.index("layers.1.mlp")
    assert "first anomaly: step 4, rank 1, forward, actv 'layers.0.attn' in module 'layers.0.attn'" in out
    assert cli_main(["anomalies", str(tmp_path), "--json", "-k", "1", "--rank", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["count"] == 1 and data["first"]["name"] == "layers.1.mlp"
    assert cli_main(["anomalies", str(tmp_path / "nowhere")]) == 2
    assert "not a monitor output" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["anomalies", str(tmp_path / "empty")]) == 0
    assert "no anomalies" in capsys.readouterr().out


def test_lazy_nan_count_is_exact_and_shard_combine_matches_full_tensor():
    ops = ("min", "max", "norm", "mean", "zeros", "nans")
    engine = StatsEngine(ops, 1e-8)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    a[::7] = 0.0
    b = torch.randn(30, 4, generator=g)
    b[1, 2] = math.nan
    b[2, 0] = math.nan
    c = torch.full((5,), math.inf)
    got = engine.compute([a, b, c])
    assert got[:, ops.index("nans")].tolist() == [0.0, 2.0, 0.0]
    ref = [[t.min().item(), t.max().item(), t.norm().item(), t.mean().item(), (t.abs() <= 1e-8).float().mean().item()]
           for t in (a,)]
    assert torch.allclose(got[0, :5], torch.tensor(ref[0]), rtol=1e-5)

    full = torch.randn(257, 3, generator=g)
    full[10, 1] = 0.0
    shards = [full.flatten()[:400], full.flatten()[400:], torch.empty(0)]  # the last rank holds nothing
    combined = combine_partials([shard_partials(engine, [s]) for s in shards])
    stats = partials_to_ops(combined, ops)[0]
    want = engine.compute([full])[0]
    assert torch.allclose(stats, want, rtol=1e-5, atol=1e-7), (stats, want)
    nan_shards = [torch.tensor([1.0, math.nan]), torch.tensor([2.0])]
    nan_stats = partials_to_ops(combine_partials([shard_partials(engine, [s]) for s in nan_shards]), ops)[0]
    assert nan_stats[ops.index("nans")] == 1 and math.isnan(nan_stats[0]) and math.isnan(nan_stats[3])
