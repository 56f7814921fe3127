"""``python -m msprobe_core report DUMP_OR_COMPARE_OR_MONITOR_DIR -o report.html``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

EPILOG = """\
The folder may be:
  a dump (dump_path, a step folder or a rank folder): the module tree from construct.json with each node's
      statistics, API calls under their module, search by name, a node's stack on click;
  a compare output (holding compare_summary.json): both runs' trees side by side coloured by result, the
      first divergence highlighted and scrolled to on open, with its metrics and stack;
  a monitor output (MONITOR_OUTPUT_DIR with rank*/ CSV or TensorBoard files and anomalies.json): the run at a
      glance (a heat map, modules down and steps across, each cell how far the module's norms are from their
      recent median, alerts marked), then each alert with its origin's and its neighbours' charts and the
      folder of its on-anomaly capture, then every series behind a search box (drawn when opened).
The page is one file with everything inline: open it in any browser, offline. Large trees expand lazily.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the report options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("path", metavar="DUMP_OR_COMPARE_OR_MONITOR_DIR", help="what to show")
    parser.add_argument("-o", "--output", default="report.html", metavar="REPORT_HTML",
                        help="the HTML file to write (default report.html)")
    parser.add_argument("--force", action="store_true", help="replace REPORT_HTML if it exists")


def run(args: argparse.Namespace) -> int:
    """Write the report and print where it is."""
    from msprobe_core.report.build import build_report

    t0 = time.perf_counter()
    out = build_report(Path(args.path), Path(args.output), overwrite=args.force)
    size = out.stat().st_size / 1e6
    print(f"report: {out.resolve()} ({size:.1f} MB, {time.perf_counter() - t0:.1f} s)")
    return 0
