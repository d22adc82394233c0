"""HTML report: inspected SampleViews (+ reject entries) -> one self-contained page (inline CSS, data-URI
thumbnails, no script, no network) with the terminal view's colouring, a legend and per-token hover; a video is one
block with a strip of its stored frames, each labelled with its time in the source.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import numpy as np

from vlmprep import __version__
from vlmprep.shards.dataset import write_text_atomic
from vlmprep.tools.view import SampleView, Segment, fact_lines, message_line

THUMB_PX = 256
FRAME_THUMB_PX = 128  # video frames: a strip of many
TRAINED_BG = "#8fe08f"  # tests look for this colour in the screenshot
_UNIT_MAX = 4  # the longest UTF-8 character spans 4 byte-level tokens

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:20px;color:#1d1d1f;background:#fff}
h1{font-size:20px;margin:0 0 8px}
h2{font-size:16px;margin:28px 0 6px;border-top:2px solid #ccc;padding-top:10px}
h2 small{font-weight:normal;color:#555}
.legend{margin:8px 0 16px;font-size:13px}
.legend span{display:inline-block;margin-right:14px;padding:1px 6px;border-radius:3px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f0f0f0}
td.l{text-align:left}
.conv{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;line-height:1.55;
  white-space:pre-wrap;overflow-wrap:anywhere;border:1px solid #ddd;background:#fcfcfc;padding:8px}
.role{font-family:system-ui,sans-serif;font-weight:bold;color:#1f4fb5;margin-top:6px}
summary.role{cursor:pointer}
summary.role small{font-weight:normal;color:#555}
.tr{background:%(green)s;color:#000}
.ms{color:#808080}
.sp{color:#8a2be2;font-weight:bold}
.im{display:inline-block;vertical-align:top;background:#d6e6ff;color:#0b4a8b;font-weight:bold;
  border:1px solid #7aa7e0;border-radius:4px;padding:2px 4px;margin:2px 0}
.im img{display:block;margin-top:3px;max-width:%(thumb)dpx;border:1px solid #999}
.vid{display:block;max-width:100%%}
.strip{display:flex;gap:4px;overflow-x:auto;margin-top:3px}
.fr{flex:none;text-align:center;font-weight:normal;font-size:11px}
.fr img{display:block;max-width:%(frame)dpx;border:1px solid #999}
.k:hover,.im:hover{outline:1px solid #d00}
ul.facts{font-size:13px;margin:6px 0}
.warn{color:#b00;font-weight:bold}
""" % {"green": TRAINED_BG, "thumb": THUMB_PX, "frame": FRAME_THUMB_PX}


def _e(s: str) -> str:
    return html.escape(s, quote=True)


def _thumbnail(pixels: np.ndarray, px: int = THUMB_PX) -> str:
    from PIL import Image

    im = Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), "RGB")
    im.thumbnail((px, px))
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _token_title(i0: int, i1: int, ids, pieces: list[str], mask: int, type_id: int) -> str:
    if i1 - i0 == 1:
        return f"#{i0} id {int(ids[i0])} piece {pieces[0]!r} mask {mask} type {type_id}"
    return (
        f"#{i0}-{i1 - 1} ids {' '.join(str(int(x)) for x in ids[i0:i1])} pieces {pieces!r} mask {mask} type {type_id}"
    )


def _text_tokens(seg: Segment, v: SampleView, pieces: dict[int, str]) -> str:
    """One hoverable span per token; a character split over several tokens becomes one span for all of them."""
    s, tv = v.sample, v.tokenizer_view
    ids = s.input_ids
    out = []
    i = seg.start
    while i < seg.end:
        j = i + 1
        text = pieces[i]
        if "\ufffd" in text:
            for k in range(i + 2, min(i + _UNIT_MAX, seg.end) + 1):
                t = tv.decode(ids[i:k])
                if "\ufffd" not in t:
                    j, text = k, t
                    break
        cls = "k sp" if seg.kind == "special" else "k"
        title = _token_title(
            i, j, ids, [pieces[x] for x in range(i, j)], int(s.loss_mask[i]), int(s.mm_token_type_ids[i])
        )
        out.append(f'<span class="{cls}" title="{_e(title)}">{_e(text)}</span>')
        i = j
    return "".join(out)


def _image(seg: Segment, v: SampleView) -> str:
    s = v.sample
    title = (
        f"#{seg.start}-{seg.end - 1} id {int(s.input_ids[seg.start])} x {seg.end - seg.start} "
        f"mask {int(s.loss_mask[seg.start])} type {int(s.mm_token_type_ids[seg.start])}"
    )
    thumb = ""
    if seg.image is not None and seg.image < len(s.images):
        thumb = f'<img src="{_thumbnail(s.images[seg.image]())}" alt="image {seg.image + 1}">'
    return f'<span class="im" title="{_e(title)}">{_e(seg.text)}{thumb}</span>'


def _video(seg: Segment, v: SampleView) -> str:
    """The video's marker, then one labelled thumbnail per stored frame; the hover names its placeholder runs and
    the text between them (Qwen3-VL's timestamps), which the block stands for."""
    s, tv = v.sample, v.tokenizer_view
    runs = ", ".join(f"#{a}-{b - 1}" for a, b in seg.runs)
    between = [tv.decode(s.input_ids[b:a]) for (_, b), (a, _) in zip(seg.runs, seg.runs[1:])]
    title = (
        f"#{seg.start}-{seg.end - 1} id {int(s.input_ids[seg.runs[0][0]])} mask {int(s.loss_mask[seg.start])} "
        f"type 2; placeholder runs {runs}" + (f"; text between them {between!r}" if between else "")
    )
    strip = ""
    if seg.video is not None and seg.video < len(s.videos):
        video = s.videos[seg.video]
        frames = []
        for f, (load, t) in enumerate(zip(video.frames, video.timestamps)):
            label = f"{t:.2f} s"
            frames.append(
                f'<span class="fr" title="{_e(f"frame {f + 1}: source frame {video.frame_indices[f]}")}">'
                f'<img src="{_thumbnail(load(), FRAME_THUMB_PX)}" '
                f'alt="{_e(f"video {seg.video + 1} frame {f + 1} at {label}")}">{_e(label)}</span>'
            )
        strip = f'<span class="strip">{"".join(frames)}</span>'
    return f'<span class="im vid" title="{_e(title)}">{_e(seg.text)}{strip}</span>'


def _sample_section(n: int, v: SampleView) -> str:
    s = v.sample
    text_idx = np.flatnonzero(np.asarray(s.mm_token_type_ids) == 0)
    pieces = dict(zip(text_idx.tolist(), v.tokenizer_view.pieces(np.asarray(s.input_ids)[text_idx])))
    parts = [
        f'<section class="sample" id="s-{_e(s.key)}" data-key="{_e(s.key)}">',
        f"<h2>{n}. sample {_e(s.key)} <small>id {_e(s.id)} ({_e(s.where)})</small></h2>",
        '<div class="conv">',
    ]
    for m in v.messages:
        # The system prompt (and the tool list templates print into it) is collapsed: the first screen of a sample
        # shows the conversation, and the prompt is one click away.
        folded = m.role == "system" and not m.num_trained
        if folded:
            parts.append(
                f'<details class="msg" data-role="{_e(m.role)}"><summary class="role">'
                f"{_e(message_line(m))} <small>{m.num_tokens} tokens: the system prompt and any tool list, "
                "click to show</small></summary>"
            )
        else:
            parts.append(f'<div class="msg" data-role="{_e(m.role)}"><div class="role">{_e(message_line(m))}</div>')
        for trained, segs in m.runs:
            inner = "".join(
                _image(seg, v)
                if seg.kind == "image"
                else _video(seg, v)
                if seg.kind == "video"
                else _text_tokens(seg, v, pieces)
                for seg in segs
            )
            parts.append(f'<span class="{"tr" if trained else "ms"}">{inner}</span>')
        parts.append("</details>" if folded else "</div>")
    parts.append('</div><ul class="facts">')
    for line in fact_lines(v):
        cls = ' class="warn"' if line.startswith("WARNING") else ""
        parts.append(f"<li{cls}>{_e(line)}</li>")
    parts.append("</ul></section>")
    return "".join(parts)


def _summary_table(samples: list[SampleView]) -> str:
    head = (
        "#",
        "sample",
        "id",
        "where",
        "source",
        "tokens",
        "trained",
        "trained %",
        "image tokens",
        "images",
        "truncated",
        "dropped images",
    )
    rows = ['<table class="summary"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for n, v in enumerate(samples, 1):
        s = v.sample
        cells = [
            str(n),
            f'<a href="#s-{_e(s.key)}">{_e(s.key)}</a>',
            _e(s.id),
            _e(s.where),
            _e(f"{s.source[0]}:{s.source[1]}"),
            str(v.num_tokens),
            str(v.num_trained),
            f"{v.num_trained / max(v.num_tokens, 1):.1%}",
            str(v.num_image_tokens),
            str(v.num_images),
            "yes" if s.truncated else "no",
            str(s.dropped_images),
        ]
        rows.append(
            "<tr>"
            + "".join(f'<td class="l">{c}</td>' if j in (1, 2, 3, 4) else f"<td>{c}</td>" for j, c in enumerate(cells))
            + "</tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _rejects_table(rejects: list[dict]) -> str:
    rows = [
        '<h2>Rejected records</h2><table class="rejects"><tr><th>source</th><th>id</th><th>reason</th>'
        "<th>message</th></tr>"
    ]
    for r in rejects:
        src = r.get("source") or {}
        rows.append(
            "<tr>"
            + "".join(
                f'<td class="l">{_e(str(c))}</td>'
                for c in (f"{src.get('file')}:{src.get('line')}", r.get("id"), r.get("reason"), r.get("message"))
            )
            + "</tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def render_report(samples: list[SampleView], rejects: list[dict], *, title: str) -> str:
    """Sample views and rejects -> one self-contained HTML page (tokens coloured by mask and type, hover details)."""
    legend = (
        '<div class="legend"><span class="tr key">trained (loss_mask 1)</span>'
        '<span class="ms key">masked (0)</span><span class="sp key">&lt;|special|&gt; token</span>'
        '<span class="im key">[image k: HxW patches -&gt; N tokens]</span>'
        + (
            '<span class="im key">[video k: F of N frames at R fps, t = ... s | TxHxW patches -&gt; M tokens]</span>'
            if any(v.sample.videos for v in samples)
            else ""
        )
        + "hover a token for index, id, piece, mask and type id</div>"
    )
    body = [f"<h1>{_e(title)}</h1>", legend]
    if samples:
        body.append(_summary_table(samples))
    if rejects:
        body.append(_rejects_table(rejects))
    body += [_sample_section(n, v) for n, v in enumerate(samples, 1)]
    return page(title, "".join(body))


def page(title: str, body: str, css: str = _CSS) -> str:
    """One self-contained HTML page: inline CSS, no script; the CSP makes "no network" a property of the page, not
    just of how it was written."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f'<meta name="generator" content="vlmprep {__version__}"><title>{_e(title)}</title>'
        f"<style>{css}</style></head><body>{body}</body></html>\n"
    )


def write_report(path: Path, samples: list[SampleView], rejects: list[dict], *, title: str) -> None:
    """Writes the HTML report to `path` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_report(samples, rejects, title=title))
