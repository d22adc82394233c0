"""Dataset report: the numbers of `vlmprep stats` (stats.compute_stats) -> one self-contained HTML page: the summary,
the warnings, each input file's coverage, and the distributions as inline SVG histograms (no script, no network).
"""

from __future__ import annotations

import html
from pathlib import Path

from vlmprep.shards.dataset import write_text_atomic
from vlmprep.tools.distributions import DISTRIBUTIONS, PERCENTILES
from vlmprep.tools.report import page
from vlmprep.tools.stats_tables import write_reject_table, write_sample_table
from vlmprep.tools.stats_text import INPUT_COLUMNS, shown_inputs, summary_lines

BAR = "#3b6fd4"  # histogram bars: tests look for this colour in the screenshot
LOW = "#d9534f"  # a coverage under the dataset's --min-turn-coverage
OK = "#5cb85c"
CHART_W, CHART_H, PAD = 440, 170, 34
MAX_INPUT_ROWS = 1000  # input files listed in the page

_CSS = f"""
body{{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:20px;color:#1d1d1f}}
h1{{font-size:20px;margin:0 0 8px}}
h2{{font-size:16px;margin:24px 0 6px;border-top:2px solid #ccc;padding-top:10px}}
pre{{font-size:12px;background:#f7f7f7;border:1px solid #ddd;padding:8px;overflow-x:auto}}
table{{border-collapse:collapse;font-size:12.5px;margin:8px 0}}
th,td{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
th{{background:#f0f0f0}}
td.l,th.l{{text-align:left}}
ul.warn li{{color:#b00;margin:3px 0}}
.charts{{display:flex;flex-wrap:wrap;gap:18px}}
figure{{margin:0}}
figcaption{{font-size:13px;font-weight:bold;margin-bottom:2px}}
svg text{{font-size:10px;fill:#333}}
.bar{{fill:{BAR}}}
"""


def _e(s) -> str:
    return html.escape(str(s), quote=True)


def histogram_svg(hist: list[dict], *, label: str) -> str:
    """Bars of [lo, hi) bins scaled to the largest count; axis ends and the top count labelled; a hover per bar."""
    if not hist:
        return (
            f'<svg width="{CHART_W}" height="40" role="img" aria-label="{_e(label)}: no values">'
            '<text x="4" y="20">no values</text></svg>'
        )
    top = max(b["count"] for b in hist)
    w, h = CHART_W - 2 * PAD, CHART_H - 2 * PAD
    bw = w / len(hist)
    bars = []
    for i, b in enumerate(hist):
        bh = h * b["count"] / top
        x, y = PAD + i * bw, PAD + h - bh
        bars.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{max(bw - 1, 1):.1f}" height="{bh:.1f}">'
            f"<title>[{b['lo']}, {b['hi']}): {b['count']}</title></rect>"
        )
    axis = (
        f'<line x1="{PAD}" y1="{PAD + h}" x2="{PAD + w}" y2="{PAD + h}" stroke="#555"/>'
        f'<text x="{PAD}" y="{PAD + h + 14}">{hist[0]["lo"]}</text>'
        f'<text x="{PAD + w}" y="{PAD + h + 14}" text-anchor="end">{hist[-1]["hi"]}</text>'
        f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end">{top}</text>'
        f'<text x="{PAD - 4}" y="{PAD + h}" text-anchor="end">0</text>'
    )
    return (
        f'<svg class="hist" width="{CHART_W}" height="{CHART_H}" role="img" aria-label="{_e(label)}" '
        f'data-bins="{len(hist)}">{axis}{"".join(bars)}</svg>'
    )


def _head(cells) -> str:
    return "<tr>" + "".join(f"<th{' class=l' if i == 0 else ''}>{h}</th>" for i, h in enumerate(cells)) + "</tr>"


def _coverage_bar(cov: float, floor: float) -> str:
    colour = LOW if cov < floor else OK
    return (
        f'<svg width="80" height="10"><rect width="80" height="10" fill="#eee"/>'
        f'<rect width="{80 * cov:.1f}" height="10" fill="{colour}"/></svg> {cov:.1%}'
    )


def _inputs_table(st: dict) -> str:
    inputs = st["inputs"]
    if inputs is None:
        return (
            "<p>Per input file: unavailable (this dataset was built before vlmprep recorded per-input counts; "
            "rebuild to see them).</p>"
        )
    head = (*INPUT_COLUMNS, "trained tokens")
    shown, note = shown_inputs(inputs, MAX_INPUT_ROWS)
    rows = ([f"<p>{_e(note)}</p>"] if note else []) + [f'<table class="inputs">{_head(head)}']
    for i in shown:
        rejects = ", ".join(f"{r} {c}" for r, c in i["rejects"].items())
        cells = [
            f'<td class="l" title="{_e(i["path"])}">{_e(i["name"])}</td>',
            f"<td>{i['records']}</td>",
            f"<td>{i['samples']}</td>",
            f'<td title="{_e(rejects)}">{i["rejected"]}</td>',
            f"<td>{i['trained_assistant_turns']} of {i['input_assistant_turns']}</td>",
            f'<td class="l">{_coverage_bar(i["coverage"], st["min_turn_coverage"])}</td>'
            if i["input_assistant_turns"]
            else "<td>-</td>",
            f"<td>{i['truncated_samples']}</td>",
            f"<td>{i['images']}</td>",
            f"<td>{i['tokens']}</td>",
            f"<td>{i['trainable_tokens']}</td>",
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "".join(rows) + "</table>"


def _percentiles_table(st: dict) -> str:
    head = ["distribution", "min", *(f"p{q}" for q in PERCENTILES), "max", "mean"]
    rows = [f'<table class="percentiles">{_head(head)}']
    for key, label in DISTRIBUTIONS.items():
        d = st[key]
        cells = [d[k] for k in ("min", *(f"p{q}" for q in PERCENTILES), "max")] + [f"{d['mean']:.1f}"]
        rows.append(f'<tr><td class="l">{label}</td>' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "".join(rows) + "</table>"


def render_stats_report(st: dict) -> str:
    """The statistics dict -> one self-contained HTML page (summary, warnings, histograms)."""
    title = f"vlmprep stats {st['dir']}"
    summary = "\n".join(summary_lines(st))
    body = [f"<h1>{_e(title)}</h1>"]
    warnings = st["mismatches"] + st["warnings"]
    if warnings:
        body.append('<h2>Warnings</h2><ul class="warn">' + "".join(f"<li>{_e(w)}</li>" for w in warnings) + "</ul>")
    body += [
        f"<h2>Summary</h2><pre>{_e(summary)}</pre>",
        "<h2>Per input file</h2>",
        _inputs_table(st),
        "<h2>Distributions</h2>",
        _percentiles_table(st),
        '<div class="charts">',
    ]
    for key, label in DISTRIBUTIONS.items():
        body.append(
            f"<figure><figcaption>{label}</figcaption>{histogram_svg(st[key]['histogram'], label=label)}</figure>"
        )
    body.append("</div>")
    sizes = st["image_sizes"]
    if sizes["top"]:
        rows = "".join(f'<tr><td class="l">{_e(s["size"])}</td><td>{s["count"]}</td></tr>' for s in sizes["top"])
        more = sizes["distinct"] - len(sizes["top"])
        body.append(
            f"<h2>Image sizes ({sizes['kind']} WxH)</h2><table><tr><th class=l>size</th><th>images</th></tr>"
            f"{rows}</table>" + (f"<p>{more} other sizes</p>" if more else "")
        )
    if st["rejects"]:
        rows = "".join(f'<tr><td class="l">{_e(r)}</td><td>{c}</td></tr>' for r, c in st["rejects"].items())
        body.append(f"<h2>Rejects by reason</h2><table><tr><th class=l>reason</th><th>count</th></tr>{rows}</table>")
    return page(title, "".join(body), css=_CSS)


def write_stats_report(path: Path, st: dict) -> None:
    """Writes the stats HTML report to `path` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_stats_report(st))


def write_outputs(
    root: Path, st: dict, rows: dict | None, *, html: str | None, samples: str | None, rejects: str | None, since
) -> list[str]:
    """`vlmprep stats`' files besides its report: the HTML report (--html), the per-sample (--samples, from `rows`)
    and per-reject (--rejects) Parquet tables; -> a 'wrote FILE' line for each."""
    written = []
    if html:
        write_stats_report(Path(html), st)
        written.append(f"wrote {html}")
    if samples:
        written.append(f"wrote {samples} ({write_sample_table(rows, Path(samples))} samples)")
    if rejects:
        written.append(f"wrote {rejects} ({write_reject_table(root, Path(rejects), since)} rejects)")
    return written
