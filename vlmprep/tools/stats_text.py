"""The statistics dict (stats.py compute_stats) -> the text `vlmprep stats` prints: the dataset's totals, a row per
input file, the distributions, histograms and warnings (stats_report.py lays out the same as an HTML page).
"""

from __future__ import annotations

from vlmprep.shards.summary import LOST_TURNS_NOTE, dropped_by_cut, plural
from vlmprep.tools.distributions import DISTRIBUTIONS, PERCENTILES
from vlmprep.tools.stats import MAX_INPUT_ROWS
from vlmprep_schemas.terminal import for_terminal

HIST_WIDTH = 40
# a row per input file: the text and HTML tables' columns, but the last (trained tokens)
INPUT_COLUMNS = ("file", "records", "samples", "rejected", "turns trained", "coverage", "truncated", "images", "tokens")


def _table(rows: list[list[str]], *, left: int = 1) -> list[str]:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right-aligned."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(cell.ljust(w) if c < left else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def shown_inputs(inputs: list[dict], limit: int) -> tuple[list[dict], str]:
    """All input files in input order, or past `limit` the `limit` with the lowest turn coverage, and a note saying
    so (a build may read thousands of files)."""
    if len(inputs) <= limit:
        return inputs, ""
    return (
        sorted(inputs, key=lambda i: (i["coverage"], i["name"]))[:limit],
        f"{limit} of {len(inputs)}, lowest turn coverage first; --json lists all",
    )


def _input_lines(st: dict) -> list[str]:
    inputs = st["inputs"]
    if inputs is None:
        return [
            "per input file     unavailable: this dataset was built before vlmprep recorded per-input counts "
            "(rebuild to see them)"
        ]
    shown, note = shown_inputs(inputs, MAX_INPUT_ROWS)
    head = f"per input file{f' ({note})' if note else ''}:"
    rows = [[*INPUT_COLUMNS, "trained"]]
    for i in shown:
        rows.append(
            [
                for_terminal(i["name"]),  # escaped before the columns are measured
                str(i["records"]),
                str(i["samples"]),
                str(i["rejected"]),
                f"{i['trained_assistant_turns']} of {i['input_assistant_turns']}",
                f"{i['coverage']:.1%}" if i["input_assistant_turns"] else "-",
                str(i["truncated_samples"]),
                str(i["images"]),
                str(i["tokens"]),
                str(i["trainable_tokens"]),
            ]
        )
    return [head] + _table(rows)


def _distribution_lines(st: dict) -> list[str]:
    rows = [["distribution", "min", *(f"p{q}" for q in PERCENTILES), "max", "mean"]]
    for key, label in DISTRIBUTIONS.items():
        d = st[key]
        rows.append([label, str(d["min"]), *(str(d[f"p{q}"]) for q in PERCENTILES), str(d["max"]), f"{d['mean']:.1f}"])
    lines = ["distributions:"] + _table(rows)
    sizes = st["image_sizes"]
    if sizes["top"]:
        shown = ", ".join(f"{s['size']} {s['count']}" for s in sizes["top"])
        more = sizes["distinct"] - len(sizes["top"])
        lines.append(f"image sizes ({sizes['kind']} WxH, images): {shown}" + (f", {more} other sizes" if more else ""))
    return lines


def _histogram_lines(title: str, hist: list[dict]) -> list[str]:
    if not hist:
        return []
    lines = [f"{title} histogram:"]
    top = max(b["count"] for b in hist)
    w = len(str(hist[-1]["hi"]))
    for b in hist:
        bar = "#" * (round(HIST_WIDTH * b["count"] / top) if b["count"] else 0)
        lines.append(f"  [{b['lo']:>{w}}, {b['hi']:>{w}})  {bar:<{HIST_WIDTH}}  {b['count']}")
    return lines


def _storage_lines(st: dict) -> list[str]:
    """How the images are stored: per storage the stored images (each once a sample), their bytes, and those bytes
    over their sources' where the build recorded the source bytes of every one."""
    parts = []
    for storage, c in st.get("image_storage", {}).items():
        ratio = (
            f", {c['bytes'] / c['source_bytes']:.2f}x their source" if c["source_bytes"] and not c["unknown"] else ""
        )
        parts.append(f"{storage} {c['images']} ({_mb(c['bytes'])}{ratio})")
    return [f"image storage      {' | '.join(parts)}"] if parts else []


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _since(st: dict) -> str:
    """` (what v3..v5 added since v2)` for `stats --since`; empty otherwise."""
    m, n = st.get("since"), st.get("version")
    return "" if not m else f" (what v{m + 1}{'' if m + 1 == n else f'..v{n}'} added since v{m})"


def summary_lines(st: dict) -> list[str]:
    """The dataset's totals: the head of format_stats (and of the HTML report)."""
    n, t = st["samples"], st["tokens"]
    ips = st["images_per_sample"]
    lines = [
        f"dataset {st['dir']}{_since(st)}: {plural(n, 'sample')} in {plural(st['shards'], 'shard')} "
        f"(format v{st['format_version']}, {st['image_format']} images, {st['processor']}, seq_len {st['seq_len']})",
        f"records            {st['records']} read, {n} samples, {st['rejected_records']} rejected"
        + (f" | unread input {st['unread_bytes']} bytes after file faults" if st["unread_bytes"] else ""),
        f"tokens             {t} | trained {st['trainable_tokens']} ({st['trainable_ratio']:.1%}) | "
        f"image {st['image_tokens']} ({st['image_tokens'] / max(t, 1):.1%})",
        f"images             {st['images']} | per sample mean {ips['mean']:.2f}, p50 {ips['p50']}, p90 {ips['p90']}, "
        f"max {ips['max']} | text-only samples {st['text_only_samples']}",
        *_storage_lines(st),
        *(
            [
                f"videos             {st['videos']} | frames {st['video_frames']} | video tokens {st['video_tokens']} "
                f"({st['video_tokens'] / max(t, 1):.1%})"
            ]
            if st["videos"] or st["dropped_videos"]
            else []
        ),
        f"truncated          {plural(st['truncated_samples'], 'sample')} ({st['truncated_samples'] / max(n, 1):.1%}), "
        + dropped_by_cut(st["dropped_images"], st["dropped_videos"]),
        f"rejected           {st['rejected_records']} of {plural(st['records'], 'record')}"
        + (" by reason:" if st["rejects"] else ""),
    ]
    lines += [f"  {reason:<40} {count}" + LOST_TURNS_NOTE.get(reason, "") for reason, count in st["rejects"].items()]
    turns = st.get("turns")
    if turns:
        lost = ", ".join(f"{k} {v}" for k, v in turns["lost"].items() if v) or "none"
        lines += [
            f"assistant turns    {turns['trained_assistant_turns']} of {turns['input_assistant_turns']} trained "
            f"(coverage {turns['coverage']:.1%}) | lost: {lost}",
            f"agent traces       {st['split_samples']} split samples | {turns['images_removed_by_history']} "
            f"images removed by --keep-images | {turns['context_tokens_repeated']} context tokens repeated",
        ]
    return lines


def format_stats(st: dict) -> str:
    """The statistics dict -> the text `vlmprep stats` prints (summary, distributions, histograms, warnings)."""
    lines = summary_lines(st)
    lines += _input_lines(st)
    lines += _distribution_lines(st)
    lines += _histogram_lines("tokens per sample", st["tokens_per_sample"]["histogram"])
    lines += _histogram_lines("tokens per image", st["tokens_per_image"]["histogram"])
    lines += [f"WARNING: {m}" for m in st["mismatches"] + st["warnings"]]
    return "\n".join(map(for_terminal, lines))  # each line one line, whatever a name or reason in it holds
