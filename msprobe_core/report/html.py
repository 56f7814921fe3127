"""The report page: one HTML file with the viewer's script and style inline and the data as JSON.

The page loads nothing from anywhere (its Content-Security-Policy forbids it), so it opens by
double-click, offline, from any folder. The data sits in a ``<script type="application/json">`` element
(every ``<`` escaped, so no content can close it) and is parsed once by the viewer.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).with_name("assets")
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def render(kind: str, title: str, data: Any, section: str = "") -> str:
    """The whole page for a ``dump``, ``compare`` or ``monitor`` view of ``data``; ``section``: a static HTML
    fragment shown above the view (the monitor's mixture-of-experts section)."""
    payload = json.dumps({"kind": kind, "title": title, "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
                          "data": data}, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    payload = payload.replace("<", "\\u003c")
    script = _asset("report.js").replace("</", "<\\/")
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>{html.escape(title)}</title><style>{_asset('report.css')}</style></head>\n<body>",
        "<div id=\"error\"></div>\n", section,
        f"<script type=\"application/json\" id=\"report-data\">{payload}</script>\n",
        f"<script>{script}</script>\n</body></html>\n",
    ])
