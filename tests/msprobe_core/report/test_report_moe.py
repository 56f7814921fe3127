"""The monitor report's mixture-of-experts section (heat map of expert load, router entropy) from the
router series the monitor writes."""

from __future__ import annotations

import re

from msprobe_core.monitor.moe.router_writer import RouterWriter
from msprobe_core.monitor.moe.routers import RouterStep
from msprobe_core.report.build import build_report


def test_heat_map_per_layer_experts_down_steps_across_and_entropy(tmp_path):
    mon = tmp_path / "mon"
    rank = mon / "rank0"
    writer = RouterWriter(rank, ("csv",), 6)
    for step in range(1, 21):
        starved = step >= 10
        load = (20.0, 20.0, 20.0, 0.0 if starved else 20.0, 20.0, 20.0, 20.0, 20.0 if starved else 0.0 + 20.0)
        writer.write(step, [RouterStep("model.layers.0.mlp.gate", load, 80, 2.0 - 0.01 * step, None, 0.2, 0.0),
                            RouterStep("model.layers.1.mlp.gate", (40.0,) * 4, 80, 1.3, 3.0, 0.1, 0.0)], None)
    writer.close()
    (rank / "grad_1-1.csv").write_text("name,step,norm\nw,1,1.0\n")  # the monitor's own series
    page = build_report(mon, tmp_path / "r.html").read_text()
    section = page[page.index("<section class=\"moe\">"):page.index("</section>")]
    assert section.count("<h3>") == 2 and "model.layers.0.mlp.gate (rank 0)" in section
    cells = re.findall(r"<rect [^>]*fill=\"(#[0-9a-f]{6})\"><title>step (\d+), expert (\d+): ([\d.]+) tokens", section)
    assert len(cells) == 20 * 8 + 20 * 4  # every expert of every step, experts down and steps across
    starved = {int(s): fill for fill, s, e, _ in cells[:160] if e == "3"}
    assert starved[12] == "#b2182b" and starved[5] == "#ffffff"  # none: dark red; the fair share: white
    assert section.count("<polyline") == 2 and "router entropy" in section
    assert page.index("<section class=\"moe\">") < page.index("id=\"report-data\"")
