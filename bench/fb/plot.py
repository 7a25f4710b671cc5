"""The headline as a picture: per link and scenario, ferry ÷ QEMU for total time, guest downtime
and bytes on the link, on a log axis with the goal of each marked. Plain SVG written here: the
page needs one chart, not a plotting library on every machine that runs the bench."""
import math
from html import escape

# (metric, label, colour) in the order the bars of a row are drawn.
BARS = [("total_ms", "total time", "#3b6ea8"), ("serial_downtime_ms", "guest downtime", "#d08a2c"),
        ("wire_bytes", "bytes on the link", "#5a9a5a")]
LO, HI = 0.005, 2.0  # the axis: ferry ÷ QEMU
LEFT, WIDTH, BAR, GAP, TOP = 300, 480, 9, 10, 40


def x_of(ratio):
    """Where `ratio` falls on the log axis (clamped to its ends)."""
    r = min(max(ratio, LO), HI)
    return LEFT + WIDTH * (math.log10(r) - math.log10(LO)) / (math.log10(HI) - math.log10(LO))


def rows_of(cells, ratio):
    """[(label, [(metric, ratio or None)])] for each (link, scenario) with both peers, the
    metrics in `BARS`' order."""
    rows = []
    for (link, scenario), entries in cells.items():
        ferry = next((e for e in entries if e["peer"] == "ferry"), None)
        qemu = next((e for e in entries if e["peer"] == "qemu-best"), None)
        if ferry and qemu:
            rows.append((f"{link} · {scenario}", [(m, ratio(ferry, qemu, m)) for m, _, _ in BARS]))
    return rows


def svg(rows, goal):
    """The chart for `rows` (see `rows_of`), the goal of each metric drawn as its tick."""
    height = TOP + len(rows) * (3 * BAR + GAP) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 150}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{LEFT}" y="16" font-size="13">ferry ÷ QEMU at its best (medians; log axis; '
           'left of a tick: at the goal)</text>']
    for tick in (0.01, 0.1, 0.5, 0.7, 1.0, 2.0):
        x = x_of(tick)
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 8}" x2="{x:.1f}" y2="{height - 30}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{height - 16}" text-anchor="middle">{tick:g}</text>')
    y = TOP
    for label, bars in rows:
        out.append(f'<text x="{LEFT - 8}" y="{y + 2 * BAR}" text-anchor="end">{escape(label)}</text>')
        for (metric, value), (_, _, colour) in zip(bars, BARS):
            if value is not None:
                x = x_of(value)
                out.append(f'<rect x="{LEFT}" y="{y}" width="{x - LEFT:.1f}" height="{BAR - 1}" fill="{colour}"/>')
                out.append(f'<text x="{x + 3:.1f}" y="{y + BAR - 1}" font-size="9">{value:.2g}</text>')
            g = x_of(goal[metric])
            out.append(f'<line x1="{g:.1f}" y1="{y}" x2="{g:.1f}" y2="{y + BAR - 1}" stroke="#000" stroke-width="2"/>')
            y += BAR
        y += GAP
    for i, (_, name, colour) in enumerate(BARS):
        lx = LEFT + WIDTH + 20
        out.append(f'<rect x="{lx}" y="{TOP + i * 16}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{lx + 14}" y="{TOP + i * 16 + 9}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
