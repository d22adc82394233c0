"""Human summaries of a built dataset, from its manifest: used by `build` and `stats`."""
from __future__ import annotations

from pathlib import Path


def format_build_summary(manifest: dict, out: Path) -> str:
    t = manifest["totals"]
    lines = [
        f"built {out}: {t['samples']} samples in {len(manifest['shards'])} shards "
        f"({manifest['image_format']} images, format v{manifest['format_version']})",
        f"  records read      {t['records']}",
        f"  tokens            {t['tokens']} ({t['trainable_tokens']} trained, "
        f"{t['trainable_tokens'] / max(t['tokens'], 1):.1%})",
        f"  images            {t['images']} ({t['image_tokens']} image tokens)",
        f"  truncated samples {t['truncated_samples']} ({t['dropped_images']} images dropped by the cut)",
        f"  unrendered tool-call turns {t['unrendered_tool_call_turns']}",
        f"  rejected          {t['rejected']}" + (" -> rejects.jsonl" if t["rejected"] else ""),
    ]
    for reason, n in manifest["rejects"].items():
        lines.append(f"    {reason:<36} {n}")
    return "\n".join(lines)
