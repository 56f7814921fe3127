"""Recipe: train a small GPT with a fault, let the monitor alert and capture evidence, and photograph its report.

The TinyGPT of ``benchmarks/alert_models.py`` (2 layers, hidden 64, AdamW) trains ``--steps`` steps on CPU
under ``TrainerMon`` with the default-style config (activations, weight gradients and Adam moments on,
weights off, ``AnomalyTurbulence`` threshold 0.5) and ``on_anomaly.dump``. At ``--fault-step`` the weight
``blocks.0.fc1.weight`` is multiplied by 50: the monitor alerts at that step at ``blocks.0.fc1`` and dumps
the next step of that module. Then ``python -m msprobe_core report`` writes the page, and headless Chromium
(Debian's ``chromium``, driven by the ``playwright`` package) takes the README's screenshot of it.

    python recipes/monitor_report_screenshot.py [--output-dir report_demo] [--png docs/monitor_report.png]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CHROMIUM = "/usr/bin/chromium"
MONITOR_CONFIG = {
    "xy_distribution": True, "wg_distribution": True, "mv_distribution": True, "param_distribution": False,
    "ops": ["min", "max", "norm", "mean", "zeros", "nans"], "format": ["csv"],
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
    "on_anomaly": {"dump": {"task": "statistics", "level": "L1", "steps": 1, "max_captures": 3}},
}


def train(out: Path, steps: int, fault_step: int) -> list:
    """Train the TinyGPT with the fault under the monitor; returns its anomalies."""
    import torch

    from alert_models import Fault, build, run
    from msprobe_core.pytorch import TrainerMon

    torch.set_num_threads(1)
    w = build("tiny_gpt")
    mon = TrainerMon(MONITOR_CONFIG, output_dir=out)
    mon.set_monitor(w.model, w.grad_acc, w.optimizer)
    run(w, steps, Fault("weight_x50", fault_step))
    mon.close()
    return mon.anomalies


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 900) -> None:
    """The page as it opens, ``width`` x ``height``, in headless Chromium."""
    from playwright.sync_api import sync_playwright

    png.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            view = browser.new_page(viewport={"width": width, "height": height})
            view.goto(page.resolve().as_uri())
            view.wait_for_selector("body[data-ready='1']")
            view.screenshot(path=str(png))
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="report_demo", help="the monitor output (replaced) and report.html")
    p.add_argument("--png", default=str(ROOT / "docs" / "monitor_report.png"), help="where the screenshot goes")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fault-step", type=int, default=20)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from msprobe_core.report import build_report

    out = Path(args.output_dir)
    shutil.rmtree(out / "monitor", ignore_errors=True)
    anomalies = train(out / "monitor", args.steps, args.fault_step)
    for a in anomalies:
        print(a.describe())
    page = build_report(out / "monitor", out / "report.html", overwrite=True)
    screenshot(page, Path(args.png))
    print(f"report: {page}\nscreenshot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
