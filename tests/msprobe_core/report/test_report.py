"""report: one self-contained HTML page for a dump, a compare output or a monitor output.

Fast tests check the data each view gets and the page's self-containment; the browser tests (slow) open the
pages in a real headless Chromium (Debian's ``chromium`` package driven by Playwright's Python package) and
keep a screenshot of each view in ``$MSPROBE_TEST_ARTIFACTS`` (default: pytest's temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from compare_fixtures import DumpBuilder, mlp_run
from msprobe_core.dumpdir.rank_dump import load_rank_dump
from msprobe_core.errors import DumpInputError
from msprobe_core.report import build
from msprobe_core.report import cli as report_cli
from msprobe_core.report.compare_data import compare_data
from msprobe_core.report.dump_data import rank_tree
from msprobe_core.report.monitor_data import monitor_data

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_HINT = ("install Debian's Chromium and the Playwright driver: `apt-get install -y chromium` and "
                "`.venv/bin/pip install -c requirements/constraints.txt playwright==1.65.2` (never "
                "`playwright install`: the tests use /usr/bin/chromium)")
LOAD_BUDGET_MS = 3000


# ---------------------------------------------------------------------------------------------- inputs
def _nan_dump(root: Path) -> Path:
    """A mix dump whose Bad module makes NaN, with a module named only in construct.json."""
    b = DumpBuilder(task="statistics", level="mix")
    x = np.array([[1.0, -2.0], [3.0, 4.0]], np.float32)
    lin = b.forward("Module.0.Linear.forward.0", [x], [x], params={"weight": np.eye(2, dtype=np.float32)})
    b.forward("Functional.linear.0.forward", [x, np.eye(2, dtype=np.float32)], [x], parent=lin)
    with np.errstate(invalid="ignore"):
        y = np.sqrt(x)
    bad = b.forward("Module.1.Bad.forward.0", [x], [y])
    b.forward("Torch.sqrt.0.forward", [x], [y], parent=bad,
              stack=["File /work/train.py, line 18, in <module>, \n out = model(x)",
                     "File /work/train.py, line 7, in forward, \n return torch.sqrt(x)"])
    b.forward("Tensor.add.0.forward", [y, 1.0], [y + 1], parent="Module.2.Head.forward.0")
    b.construct["Module.2.Head.forward.0"] = None
    b.forward("Tensor.sum.0.forward", [y], [np.array(np.nan, np.float32)])
    return b.write(root / "step0" / "rank0")


@pytest.fixture
def nan_dump(tmp_path):
    return _nan_dump(tmp_path / "dump")


@pytest.fixture
def compare_dir(tmp_path):
    mlp_run(tmp_path / "golden/step0/rank0", task="statistics", level="mix")
    mlp_run(tmp_path / "target/step0/rank0", task="statistics", level="mix", perturb=2)
    from msprobe_core.compare import compare_dumps, write_outputs

    out = tmp_path / "cmp"
    write_outputs(compare_dumps(tmp_path / "target", tmp_path / "golden"), out)
    return out


MONITOR_CONFIG = {"xy_distribution": True, "wg_distribution": True, "ops": ["min", "max", "norm", "nans"],
                  "format": ["csv", "tensorboard"], "alert": {"rules": [{"rule_name": "AnomalyTurbulence",
                                                                         "args": {"threshold": 0.5}}], "dump": True}}


@pytest.fixture(scope="module")
def monitor_dir(tmp_path_factory):
    """A real TrainerMon run (CSV and TensorBoard) whose weight turns NaN at step 6."""
    import torch

    from msprobe_core.pytorch import TrainerMon

    root = tmp_path_factory.mktemp("monitor")
    config = root / "monitor.json"
    config.write_text(json.dumps(MONITOR_CONFIG))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainerMon(str(config), output_dir=str(root / "out"))
    mon.set_monitor(model, 1, opt)
    for step in range(8):
        if step == 6:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        model(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.close()
    return root / "out"


def _write_big_dump(rank_dir: Path, records: int = 100_000, per_module: int = 100) -> None:
    """A mix dump of ``records`` records: modules of ``per_module - 1`` linear calls each (text written directly)."""
    rank_dir.mkdir(parents=True)
    tensor = ('{{"type":"torch.Tensor","dtype":"torch.float32","shape":[8,64],"Max":{mx},"Min":-{mx},'
              '"Mean":0.001,"Norm":{nm},"requires_grad":true}}')
    data, construct, stack = [], [], []
    module = None
    for i in range(records):
        t = tensor.format(mx=1 + i * 1e-5, nm=12.5 + i * 1e-4)
        if i % per_module == 0:
            module = f"Module.layers.{i // per_module}.Block.forward.0"
            name, parent, frame = module, None, f"File train.py, line {i % 50}, in step,\\n x = layer(x)"
            body = f'{{"input_args":[{t}],"input_kwargs":{{}},"output":[{t}],"parameters":{{}}}}'
        else:
            name, parent, frame = f"Functional.linear.{i}.forward", module, "File model.py, line 7, in forward,\\n y = F.linear(x, w)"
            body = f'{{"input_args":[{t},{t}],"input_kwargs":{{}},"output":[{t}]}}'
        data.append(f'"{name}":{body}')
        construct.append(f'"{name}":' + (f'"{parent}"' if parent else "null"))
        stack.append(f'"{name}":["{frame}"]')
    (rank_dir / "dump.json").write_text('{"task":"statistics","level":"mix","framework":"pytorch",'
                                        '"dump_data_dir":null,"data":{' + ",\n".join(data) + "}}")
    (rank_dir / "construct.json").write_text("{" + ",\n".join(construct) + "}")
    (rank_dir / "stack.json").write_text("{" + ",\n".join(stack) + "}")


def _page_data(html_path: Path) -> dict:
    text = html_path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', text, re.S)
    return json.loads(m.group(1))


# ---------------------------------------------------------------------------------------------- fast tests
def test_detect_each_kind(nan_dump, compare_dir, monitor_dir, tmp_path):
    assert build.detect(nan_dump.parents[1]) == "dump"
    assert build.detect(nan_dump) == "dump"
    assert build.detect(compare_dir) == "compare"
    assert build.detect(monitor_dir) == "monitor"
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpInputError, match="not a dump, a compare output"):
        build.detect(tmp_path / "empty")


def test_dump_tree_data(nan_dump):
    tree = rank_tree(load_rank_dump(nan_dump), "step0/rank0")
    names = tree["names"]
    idx = names.index
    assert tree["parent"][idx("Torch.sqrt.0.forward")] == idx("Module.1.Bad.forward.0")
    assert tree["parent"][idx("Module.1.Bad.forward.0")] == -1
    # a module construct.json names without a record of its own still holds its calls
    assert tree["parent"][idx("Tensor.add.0.forward")] == idx("Module.2.Head.forward.0")
    assert tree["leaves"][idx("Module.2.Head.forward.0")] == []
    assert idx("Torch.sqrt.0.forward") in tree["nan"] and idx("Functional.linear.0.forward") not in tree["nan"]
    out = tree["leaves"][idx("Torch.sqrt.0.forward")][1]
    assert out[0] == "output.0" and out[1] == "float32" and out[2] == "2x2" and out[3] == "NaN"
    assert tree["stacks"][tree["stack"][idx("Torch.sqrt.0.forward")]][-1].endswith("return torch.sqrt(x)")


def test_page_is_self_contained_and_data_cannot_close_its_script(tmp_path):
    b = DumpBuilder(task="statistics", level="L1")
    b.forward("Torch.x</script><script>alert(1)</script>.0.forward", [np.ones(2, np.float32)], [np.ones(2, np.float32)])
    b.write(tmp_path / "rank0")
    out = build.build_report(tmp_path / "rank0", tmp_path / "r.html")
    text = out.read_text(encoding="utf-8")
    assert text.count("<script") == 2 and "alert(1)</script>" not in text
    assert "Content-Security-Policy" in text and "default-src 'none'" in text
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', text), "the page must load nothing"
    assert _page_data(out)["data"]["units"][0]["names"] == ["Torch.x</script><script>alert(1)</script>.0.forward"]


def test_report_cli_refuses_to_overwrite_without_force(nan_dump, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    out = tmp_path / "r.html"
    assert report_cli.run(parser.parse_args([str(nan_dump), "-o", str(out)])) == 0
    assert f"report: {out.resolve()}" in capsys.readouterr().out
    with pytest.raises(build.ReportOutputError, match="already exists"):
        report_cli.run(parser.parse_args([str(nan_dump), "-o", str(out)]))
    assert report_cli.run(parser.parse_args([str(nan_dump), "-o", str(out), "--force"])) == 0


def test_compare_data_trees_verdicts_and_divergence(compare_dir):
    data = compare_data(compare_dir)
    [pair] = data["pairs"]
    assert data["first_pair"] == 0
    div = pair["divergence"]
    t_names = pair["target"]["names"]
    assert div["record"] == t_names[div["t"]] and div["record"].startswith("Functional.linear.2.forward")
    assert pair["t_verdict"][div["t"]] == 2 and pair["t_match"][div["t"]] == div["g"]
    assert pair["golden"]["names"][div["g"]] == div["record"]
    assert pair["t_verdict"][t_names.index("Functional.linear.0.forward")] == 0
    assert pair["target"]["parent"][div["t"]] == t_names.index("Module.layers.2.Layer.forward.0")
    assert any(r[1] == "error" for r in pair["rows"][f"t{div['t']}"])


def test_compare_cli_report_flag_prints_where_the_report_is(tmp_path, capsys):
    from msprobe_core.cli import main

    mlp_run(tmp_path / "g/step0/rank0", task="statistics")
    mlp_run(tmp_path / "t/step0/rank0", task="statistics", perturb=1)
    assert main(["compare", "-t", str(tmp_path / "t"), "-g", str(tmp_path / "g"), "-o", str(tmp_path / "o"),
                 "--report", "-q"]) == 1
    assert f"report: {tmp_path / 'o' / 'compare_report.html'}" in capsys.readouterr().out
    assert _page_data(tmp_path / "o" / "compare_report.html")["kind"] == "compare"


def test_monitor_data_from_csv_and_from_tensorboard_alone(monitor_dir, tmp_path):
    data = monitor_data(monitor_dir)
    charts = {(c["name"], c["metric"]): c for c in data["charts"]}
    norm = charts[("0.output", "actv_norm")]["series"]["0"]
    assert [s for s, _ in norm] == list(range(8))
    assert charts[("0.weight", "grad_nans")]["series"]["0"][6][1] > 0
    first = data["anomalies"][0]
    assert (first["step"], first["kind"], first["name"], first["metric"]) == (6, "actv", "0.output", "nans")
    assert data["charts"][first["chart"]]["name"] == "0.output"
    tb_only = tmp_path / "tb"
    shutil.copytree(monitor_dir, tb_only, ignore=shutil.ignore_patterns("*.csv"))
    tb = {(c["name"], c["metric"]): c for c in monitor_data(tb_only)["charts"]}
    assert set(tb) == set(charts)
    tb_norm = tb[("0.output", "actv_norm")]["series"]["0"]
    assert [s for s, _ in tb_norm] == list(range(8))
    assert np.allclose([float(v) for _, v in tb_norm], [float(v) for _, v in norm], rtol=1e-5, equal_nan=True)


def test_nan_report_highlights_the_origin(nan_dump, tmp_path):
    from msprobe_core.nan_analyze import analyze

    out = build.nan_report(analyze(nan_dump.parents[1]), tmp_path / "nan.html")
    data = _page_data(out)["data"]
    names = data["units"][0]["names"]
    assert names[data["highlight"]["node"]] == "Torch.sqrt.0.forward"
    assert "Torch.sqrt.0.forward" in data["banner"]["text"]


# ---------------------------------------------------------------------------------------------- browser
@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    path = Path(os.environ.get("MSPROBE_TEST_ARTIFACTS") or tmp_path_factory.getbasetemp() / "report_screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"browser tests need {CHROMIUM}, which is missing: {INSTALL_HINT}", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"browser tests need the playwright package: {INSTALL_HINT}", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Opened:
    """A report open in a fresh page, with every console error and page error it raised."""

    def __init__(self, browser, path: Path):
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=60_000)

    def screenshot(self, artifacts: Path, name: str, capsys) -> Path:
        path = artifacts / name
        self.page.screenshot(path=str(path))
        with capsys.disabled():
            print(f"\nscreenshot: {path}")
        return path

    def check_clean(self) -> None:
        assert self.errors == []
        assert all(u.startswith("file:") for u in self.requests), self.requests

    def in_view(self, selector: str) -> bool:
        return self.page.evaluate("""sel => { const e = document.querySelector(sel); if (!e) return false;
            const r = e.getBoundingClientRect();
            return r.height > 0 && r.top >= 0 && r.bottom <= window.innerHeight && r.left >= 0 && r.right <= window.innerWidth; }""",
                                  selector)


@pytest.mark.slow
def test_browser_dump_report_search_finds_a_node_and_shows_its_stack(browser, nan_dump, tmp_path, artifacts, capsys):
    out = build.build_report(nan_dump.parents[1], tmp_path / "dump.html")
    view = Opened(browser, out)
    view.page.fill("#search", "sqrt")
    view.page.wait_for_selector(".results li[data-i]")
    view.page.press("#search", "Enter")
    selected = view.page.locator(".row.sel .name")
    assert selected.inner_text() == "Torch.sqrt.0.forward"
    assert view.in_view(".row.sel")
    detail = view.page.locator(".detail").inner_text()
    assert "Parent chain" in detail and "Module.1.Bad.forward.0" in detail and "return torch.sqrt(x)" in detail
    assert "NaN" in detail
    view.screenshot(artifacts, "dump_report.png", capsys)
    view.check_clean()


@pytest.mark.slow
def test_browser_compare_report_shows_first_divergence_on_open(browser, compare_dir, artifacts, capsys):
    out = build.compare_report(compare_dir)
    view = Opened(browser, out)
    div = compare_data(compare_dir)["pairs"][0]["divergence"]["record"]
    marked = view.page.locator(".pane .row.mark.sel .name")
    assert marked.count() == 2 and marked.first.inner_text() == div  # target and golden side
    assert view.in_view(".pane .row.mark.sel")
    assert div in view.page.locator("#banner").inner_text()
    assert "error" in view.page.locator(".detail").inner_text()
    view.screenshot(artifacts, "compare_report.png", capsys)
    view.check_clean()


@pytest.mark.slow
def test_browser_monitor_report_charts_and_first_anomaly(browser, monitor_dir, tmp_path, artifacts, capsys):
    out = build.build_report(monitor_dir, tmp_path / "monitor.html")
    view = Opened(browser, out)
    assert view.page.locator(".chart svg polyline").count() > 0
    banner = view.page.locator("#banner").inner_text()
    assert "First anomaly" in banner and "'0.output'" in banner and "nans" in banner
    view.page.locator("#banner .link").first.click()
    assert view.in_view(".chart.focus")
    assert view.page.locator(".chart.focus svg circle.anomaly").count() >= 1
    view.screenshot(artifacts, "monitor_report.png", capsys)
    view.check_clean()


@pytest.fixture(scope="module")
def fault_monitor_dir(tmp_path_factory):
    """The TinyGPT of ``benchmarks/alert_models.py``, 24 steps, blocks.0.fc1.weight x50 at step 16, with the
    on-anomaly capture: what a user's monitor output looks like after a real fault (late in the run, as
    faults are: the heat map colours each series by its distance to the run's median)."""
    import torch

    from alert_models import MONITOR_CONFIG, Fault, build, run
    from msprobe_core.pytorch import TrainerMon

    root = tmp_path_factory.mktemp("fault") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    w = build("tiny_gpt")
    cfg = dict(MONITOR_CONFIG, param_distribution=False, format="csv", on_anomaly={"dump": {}},
               alert=dict(MONITOR_CONFIG["alert"], dump=True))
    mon = TrainerMon(cfg, output_dir=root)
    mon.set_monitor(w.model, w.grad_acc, w.optimizer)
    run(w, 24, Fault("weight_x50", 16))
    mon.close()
    torch.set_num_threads(threads)
    return root


def test_monitor_glance_heat_map_rows_follow_the_data_and_alerts_bring_their_neighbours(fault_monitor_dir):
    data = monitor_data(fault_monitor_dir)
    g, first = data["glance"], data["anomalies"][0]
    assert g["modules"][:3] == ["tok", "pos", "blocks.0.ln1"]  # forward order, not alphabetical
    assert len(g["cells"]) == len(g["modules"]) and all(len(r) == len(g["columns"]) == 24 for r in g["cells"])
    assert g["modules"][first["row"]] == "blocks.0.fc1" and first["column"] == 16
    row = g["cells"][first["row"]]
    # x50 (ln 50 = 3.9) from the fault on, which lasts (the weight stays large); quiet before it
    assert min(row[16:]) > 3.0 and max(row[:16]) < 1.0, row
    related = [data["charts"][k]["name"] for k in first["related"]]
    assert related == ["blocks.0.ln2.output", "blocks.0.fc1.output", "blocks.0.act.output", "blocks.0.fc2.output"]
    assert first["capture"].endswith("captures/step16_blocks.0.fc1/step17/rank0")


@pytest.mark.slow
def test_browser_monitor_report_shows_heat_map_and_first_alert_without_scrolling(browser, fault_monitor_dir, tmp_path,
                                                                                  artifacts, capsys):
    out = build.build_report(fault_monitor_dir, tmp_path / "glance.html")
    view = Opened(browser, out)
    assert view.in_view("#heatmap") and view.in_view("#alerts .alert")  # on screen as the page opens
    alert = view.page.locator("#alerts .alert").first
    assert "blocks.0.fc1.output" in alert.inner_text() and "captures/step16_blocks.0.fc1" in alert.inner_text()
    assert alert.locator(".chart svg polyline").count() == 4 and alert.locator(".chart.origin circle.anomaly").count() == 1
    assert view.page.locator("#all-series .chart").count() == 0  # the full list is built only when opened
    view.page.fill("#search", "fc1.output")
    assert view.page.locator("#all-series .chart:not(.hidden)").count() >= 2
    view.screenshot(artifacts, "monitor_glance.png", capsys)
    view.check_clean()


@pytest.mark.slow
def test_browser_100k_record_dump_opens_under_3_seconds(browser, tmp_path, artifacts, capsys):
    _write_big_dump(tmp_path / "big" / "step0" / "rank0")
    out = build.build_report(tmp_path / "big", tmp_path / "big.html")
    view = Opened(browser, out)
    ready_ms = view.page.evaluate("window.__reportReadyMs")
    with capsys.disabled():
        print(f"\n100,000-record dump ({out.stat().st_size / 1e6:.1f} MB page): ready {ready_ms:.0f} ms after navigation")
    assert ready_ms < LOAD_BUDGET_MS
    assert view.page.evaluate("document.querySelectorAll('li').length") <= 1001, "the tree must expand lazily"
    view.page.fill("#search", "functional.linear.99998.")
    view.page.press("#search", "Enter")
    assert view.page.locator(".row.sel .name").inner_text() == "Functional.linear.99998.forward"
    assert view.in_view(".row.sel")
    view.screenshot(artifacts, "dump_100k.png", capsys)
    view.check_clean()
