"""Stats: a built dataset dir -> counts recomputed from the shards' arrays and meta, checked against the
manifest, with reject counts by reason; formatted as a plain-text summary (or JSON by the CLI).
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from vlmprep.shards.dataset import REJECTS_NAME
from vlmprep.shards.reader import iter_rejects, iter_shard, load_manifest, shard_paths
from vlmprep.shards.summary import dropped_by_cut, plural

HIST_BINS = 10
HIST_WIDTH = 40


def _pct(x: np.ndarray, q: float) -> int:
    # Nearest rank: always a length that some sample really has.
    return int(np.percentile(x, q, method="inverted_cdf")) if len(x) else 0


def _histogram(x: np.ndarray, bins: int = HIST_BINS) -> list[dict]:
    """Equal-width integer bins [lo, hi) over min..max."""
    if not len(x):
        return []
    lo, hi = int(x.min()), int(x.max())
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = np.bincount((x - lo) // width, minlength=bins)
    n = int(np.flatnonzero(counts).max()) + 1
    return [{"lo": lo + i * width, "hi": lo + (i + 1) * width, "count": int(counts[i])} for i in range(n)]


def compute_stats(root: Path) -> dict:
    root = Path(root)
    manifest = load_manifest(root)
    tokens, trained, image_tokens, images = [], [], [], []
    truncated = dropped = 0
    videos = video_frames = video_tokens = dropped_videos = 0
    split: list[bool] = []
    for path in shard_paths(root, manifest):
        for ts in iter_shard(path, version=manifest["format_version"]):
            meta = ts.meta()
            mask, types = ts.array("loss_mask"), ts.array("mm_token_type_ids")
            tokens.append(len(mask))
            trained.append(int(mask.sum()))
            image_tokens.append(int((types == 1).sum()))
            video_tokens += int((types == 2).sum())
            videos += int(meta.get("num_videos", 0))
            video_frames += sum(int(v["frames"]) for v in meta.get("videos", ()))
            dropped_videos += int(meta.get("dropped_videos", 0))
            images.append(len(ts.array("image_grid_thw").reshape(-1, 3)))
            truncated += bool(meta.get("truncated"))
            split.append(meta.get("split") is not None)
            dropped += int(meta.get("dropped_images", 0))
    tok, img = np.array(tokens, dtype=np.int64), np.array(images, dtype=np.int64)
    n = len(tok)
    rejects = {k: int(v) for k, v in sorted(manifest.get("rejects", {}).items())}
    st = {
        "dir": str(root),
        "format_version": manifest["format_version"],
        "image_format": manifest.get("image_format"),
        "processor": (manifest.get("processor") or {}).get("spec"),
        "seq_len": (manifest.get("config") or {}).get("seq_len"),
        "shards": len(manifest.get("shards", [])),
        "records": int(manifest.get("totals", {}).get("records", n + sum(rejects.values()))),
        "unread_bytes": int(manifest.get("totals", {}).get("unread_bytes", 0)),
        "samples": n,
        "tokens": int(tok.sum()),
        "trainable_tokens": int(sum(trained)),
        "trainable_ratio": sum(trained) / max(int(tok.sum()), 1),
        "image_tokens": int(sum(image_tokens)),
        "images": int(img.sum()),
        "text_only_samples": int((img == 0).sum()),
        "images_per_sample": {"mean": float(img.mean()) if n else 0.0, "p50": _pct(img, 50), "p90": _pct(img, 90),
                              "max": int(img.max()) if n else 0},
        "tokens_per_sample": {"mean": float(tok.mean()) if n else 0.0, "min": int(tok.min()) if n else 0,
                              "p50": _pct(tok, 50), "p90": _pct(tok, 90), "p99": _pct(tok, 99),
                              "max": int(tok.max()) if n else 0},
        "tokens_histogram": _histogram(tok),
        "truncated_samples": truncated,
        "dropped_images": dropped,
        "videos": videos,
        "video_frames": video_frames,
        "video_tokens": video_tokens,
        "dropped_videos": dropped_videos,
        "rejected": sum(rejects.values()),
        "rejects": rejects,
        "split_samples": int(sum(split)),
        "turns": manifest.get("turns"),  # per-record accounting, only the build can know it (input turns)
    }
    st["mismatches"] = _mismatches(root, manifest, st)
    return st


def _mismatches(root: Path, manifest: dict, st: dict) -> list[str]:
    """Where the manifest disagrees with what the shards (or rejects.jsonl) actually hold."""
    out = []
    totals = manifest.get("totals", {})
    for key in ("samples", "tokens", "trainable_tokens", "image_tokens", "images", "truncated_samples",
                "dropped_images", "rejected", "videos", "video_tokens", "dropped_videos"):
        if key in totals and totals[key] != st[key]:
            out.append(f"manifest totals.{key}={totals[key]} but the {'rejects' if key == 'rejected' else 'shards'} "
                       f"give {st[key]}")
    p = root / REJECTS_NAME
    if p.is_file():
        counted = collections.Counter(str(r.get("reason")) for r in iter_rejects(p))
        if dict(sorted(counted.items())) != st["rejects"]:
            out.append(f"rejects.jsonl counts {dict(sorted(counted.items()))} differ from the manifest {st['rejects']}")
    return out


def format_stats(st: dict) -> str:
    n, t = st["samples"], st["tokens"]
    ips, tps = st["images_per_sample"], st["tokens_per_sample"]
    lines = [
        f"dataset {st['dir']}: {plural(n, 'sample')} in {plural(st['shards'], 'shard')} "
        f"(format v{st['format_version']}, {st['image_format']} images, {st['processor']}, seq_len {st['seq_len']})",
        f"records            {st['records']} read, {n} samples, {st['rejected']} rejected"
        + (f" | unread input {st['unread_bytes']} bytes after file faults" if st["unread_bytes"] else ""),
        f"tokens             {t} | trained {st['trainable_tokens']} ({st['trainable_ratio']:.1%}) | "
        f"image {st['image_tokens']} ({st['image_tokens'] / max(t, 1):.1%})",
        f"images             {st['images']} | per sample mean {ips['mean']:.2f}, p50 {ips['p50']}, p90 {ips['p90']}, "
        f"max {ips['max']} | text-only samples {st['text_only_samples']}",
        f"tokens per sample  mean {tps['mean']:.1f} | p50 {tps['p50']} | p90 {tps['p90']} | p99 {tps['p99']} | "
        f"max {tps['max']}",
        *([f"videos             {st['videos']} | frames {st['video_frames']} | video tokens {st['video_tokens']} "
           f"({st['video_tokens'] / max(t, 1):.1%})"] if st["videos"] or st["dropped_videos"] else []),
        f"truncated          {plural(st['truncated_samples'], 'sample')} ({st['truncated_samples'] / max(n, 1):.1%}), "
        + dropped_by_cut(st["dropped_images"], st["dropped_videos"]),
        f"rejected           {st['rejected']}" + (" by reason:" if st["rejects"] else ""),
    ]
    lines += [f"  {reason:<40} {count}" for reason, count in st["rejects"].items()]
    turns = st.get("turns")
    if turns:
        lost = ", ".join(f"{k} {v}" for k, v in turns["lost"].items() if v) or "none"
        lines += [f"assistant turns    {turns['trained_assistant_turns']} of {turns['input_assistant_turns']} trained "
                  f"(coverage {turns['coverage']:.1%}) | lost: {lost}",
                  f"agent traces       {st['split_samples']} split samples | {turns['images_removed_by_history']} "
                  f"images removed by --keep-images | {turns['context_tokens_repeated']} context tokens repeated"]
    hist = st["tokens_histogram"]
    if hist:
        lines.append("tokens per sample histogram:")
        top = max(b["count"] for b in hist)
        w = len(str(hist[-1]["hi"]))
        for b in hist:
            bar = "#" * (round(HIST_WIDTH * b["count"] / top) if b["count"] else 0)
            lines.append(f"  [{b['lo']:>{w}}, {b['hi']:>{w}})  {bar:<{HIST_WIDTH}}  {b['count']}")
    lines += [f"WARNING: {m}" for m in st["mismatches"]]
    return "\n".join(lines)

