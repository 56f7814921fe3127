"""The monitor report's mixture-of-experts section: per MoE layer, a heat map of expert load (experts down,
steps across) and the router entropy over steps, from each rank folder's ``moe_router.csv``.

Self-contained: ``moe_section(root)`` returns an HTML fragment of inline SVG (no script, nothing loaded,
within the page's Content-Security-Policy) or "" when the folder holds no router series. A heat-map cell is
the expert's tokens over the layer's mean at that step: red below the fair share (dark red: none, a starved
expert), white at it, blue above it; its tooltip gives step, expert and tokens. Long runs are shown in at
most ``MAX_COLUMNS`` columns (each the mean of consecutive steps).
"""

from __future__ import annotations

import csv
import html
import math
import re
from pathlib import Path

ROUTER_CSV = "moe_router.csv"
MAX_COLUMNS = 300
_RANK_DIR = re.compile(r"^rank(\d+)$")
_CELL_H, _LEFT, _TOP = 12, 70, 16
_STYLE = ("section.moe{flex:0 0 auto;max-height:50vh;overflow:auto;padding:6px 12px;border-bottom:1px solid #e3e6ea}"
          "section.moe h2{font-size:14px;margin:4px 0}section.moe h3{font-size:12px;margin:8px 0 2px;"
          "font-family:ui-monospace,Menlo,Consolas,monospace}section.moe .row{display:flex;gap:16px;flex-wrap:wrap}"
          "section.moe svg text{font:10px system-ui,sans-serif;fill:#6b7280}")


def router_series(root: Path) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """``{(rank, router): {step: {metric: value}}}`` from every rank folder's ``moe_router.csv``."""
    root = Path(root)
    dirs = [d for d in sorted(root.iterdir()) if d.is_dir() and _RANK_DIR.match(d.name)] if root.is_dir() else []
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for d in dirs or [root]:
        path = d / ROUTER_CSV
        if not path.is_file():
            continue
        m = _RANK_DIR.match(d.name)
        rank = m.group(1) if m else "0"
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                try:
                    step, value = int(row["step"]), float(row["value"])
                except (KeyError, TypeError, ValueError):
                    continue
                out.setdefault((rank, row.get("name") or ""), {}).setdefault(step, {})[row.get("metric") or ""] = value
    return out


def moe_section(root: Path) -> str:
    """The HTML fragment for a monitor output folder ("" without router series)."""
    series = router_series(root)
    if not series:
        return ""
    parts = [f"<style>{_STYLE}</style><section class=\"moe\"><h2>Mixture of experts: expert load and router entropy"
             "</h2>"]
    for (rank, layer), steps in sorted(series.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        parts.append(f"<h3>{html.escape(layer)} (rank {html.escape(rank)})</h3><div class=\"row\">")
        parts.append(_heat_map(steps))
        parts.append(_entropy_chart(steps))
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _columns(steps: dict[int, dict[str, float]]) -> list[tuple[int, int, dict[str, float]]]:
    """(first step, last step, mean metrics) per column, at most ``MAX_COLUMNS``."""
    ordered = sorted(steps)
    per = max(1, math.ceil(len(ordered) / MAX_COLUMNS))
    cols = []
    for i in range(0, len(ordered), per):
        chunk = ordered[i:i + per]
        keys = set().union(*(steps[s] for s in chunk))
        mean = {k: sum(steps[s].get(k, 0.0) for s in chunk) / len(chunk) for k in keys}
        cols.append((chunk[0], chunk[-1], mean))
    return cols


def _color(ratio: float) -> str:
    """Red below the fair share (1.0), white at it, blue above (saturated at 0 and at 2.5x)."""
    if ratio < 1.0:
        t = max(0.0, ratio)
        r, g, b = 178 + (255 - 178) * t, 24 + (255 - 24) * t, 43 + (255 - 43) * t
    else:
        t = min(1.0, (ratio - 1.0) / 1.5)
        r, g, b = 255 + (33 - 255) * t, 255 + (102 - 255) * t, 255 + (172 - 255) * t
    return f"#{int(r):02x}{int(g):02x}{int(b):02x}"


def _heat_map(steps: dict[int, dict[str, float]]) -> str:
    cols = _columns(steps)
    experts = sorted({int(k.split(".", 1)[1]) for _, _, m in cols for k in m if k.startswith("load.")})
    if not experts:
        return ""
    cell = max(3, min(12, 600 // len(cols)))  # a short run gets wider cells
    width, height = max(300, _LEFT + len(cols) * cell + 4), _TOP + len(experts) * _CELL_H + 14
    out = [f"<svg width=\"{width}\" height=\"{height}\" role=\"img\" aria-label=\"expert load heat map\">",
           f"<text x=\"{_LEFT}\" y=\"11\">expert load / mean (steps {cols[0][0]}..{cols[-1][1]})</text>"]
    for row, e in enumerate(experts):
        y = _TOP + row * _CELL_H
        out.append(f"<text x=\"2\" y=\"{y + _CELL_H - 3}\">expert {e}</text>")
        for c, (first, last, m) in enumerate(cols):
            loads = [v for k, v in m.items() if k.startswith("load.")]
            mean = sum(loads) / len(loads) if loads else 0.0
            v = m.get(f"load.{e}", 0.0)
            ratio = v / mean if mean > 0 else 1.0
            when = f"step {first}" if first == last else f"steps {first}-{last}"
            out.append(f"<rect x=\"{_LEFT + c * cell}\" y=\"{y}\" width=\"{cell}\" height=\"{_CELL_H - 1}\" "
                       f"fill=\"{_color(ratio)}\"><title>{when}, expert {e}: {v:.6g} tokens "
                       f"({ratio:.2f} x mean)</title></rect>")
    out.append("</svg>")
    return "".join(out)


def _entropy_chart(steps: dict[int, dict[str, float]]) -> str:
    points = [(s, m["entropy"]) for s, m in sorted(steps.items()) if "entropy" in m and math.isfinite(m["entropy"])]
    if not points:
        return ""
    experts = sum(1 for k in next(iter(steps.values())) if k.startswith("load."))
    top = max(math.log(experts) if experts > 1 else 0.0, max(v for _, v in points)) or 1.0
    w, h, pad = 320, 120, 28
    s0, s1 = points[0][0], points[-1][0]
    span = max(1, s1 - s0)

    def xy(s: int, v: float) -> str:
        return f"{pad + (s - s0) / span * (w - pad - 4):.1f},{h - 14 - v / top * (h - 30):.1f}"

    line = " ".join(xy(s, v) for s, v in points)
    ref = h - 14 - (math.log(experts) / top * (h - 30) if experts > 1 else 0)
    return "".join([
        f"<svg width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"router entropy\">",
        f"<text x=\"{pad}\" y=\"11\">router entropy (nats; dashed: ln {experts}, uniform)</text>",
        f"<line x1=\"{pad}\" x2=\"{w - 4}\" y1=\"{ref:.1f}\" y2=\"{ref:.1f}\" stroke=\"#9ca3af\" stroke-dasharray=\"3 3\"/>",
        f"<polyline fill=\"none\" stroke=\"#1d4ed8\" stroke-width=\"1.5\" points=\"{line}\"/>",
        f"<text x=\"{pad}\" y=\"{h - 2}\">step {s0}</text><text x=\"{w - 60}\" y=\"{h - 2}\">step {s1}</text>",
        f"<text x=\"0\" y=\"{h - 14}\">0</text><text x=\"0\" y=\"24\">{top:.2f}</text>",
        "</svg>",
    ])
