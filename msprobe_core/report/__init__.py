"""One self-contained HTML page for a dump, a compare output or a monitor output.

``python -m msprobe_core report PATH -o report.html``; from Python::

    from msprobe_core.report import build_report
    build_report("dump_path", "report.html")

Modules: ``dump_data`` (a rank folder as compact tree columns), ``compare_data`` (compare_summary.json and
the result CSVs), ``monitor_data`` (CSV or TensorBoard scalars and anomalies.json), ``monitor_glance`` (the monitor's heat map
and each alert's related series), ``html`` (the page),
``build`` (what a folder holds; the reports of ``compare --report`` and ``nan_analyze --report``), ``cli``;
``assets/`` holds the viewer's script and style, inlined into every page.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_report", "compare_report", "nan_report", "detect"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from msprobe_core.report import build
        return getattr(build, name)
    raise AttributeError(name)
