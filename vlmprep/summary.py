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
        *_turn_lines(manifest.get("turns")),
        *_reasoning_lines(t, manifest.get("config", {})),
        f"  rejected          {t['rejected']}" + (" -> rejects.jsonl" if t["rejected"] else ""),
    ]
    for reason, n in manifest["rejects"].items():
        lines.append(f"    {reason:<36} {n}")
    return "\n".join(lines)


def _turn_lines(turns: dict | None) -> list[str]:
    if not turns:
        return []
    lost = ", ".join(f"{k} {v}" for k, v in turns["lost"].items() if v) or "none"
    return [f"  assistant turns   {turns['trained_assistant_turns']} of {turns['input_assistant_turns']} trained "
            f"(coverage {turns['coverage']:.1%}; lost: {lost})",
            f"  history policy    {turns['images_removed_by_history']} images removed; split context "
            f"{turns['context_tokens_repeated']} tokens repeated"]


def _reasoning_lines(t: dict, config: dict) -> list[str]:
    if not t.get("reasoning_turns"):
        return []
    return [f"  reasoning turns   {t['reasoning_turns']} (--reasoning {config.get('reasoning', 'train')}; "
            f"{t.get('reasoning_turns_dropped', 0)} dropped by it, {t.get('reasoning_turns_not_rendered', 0)} "
            "left out by the template)"]


def format_plan_summary(plan: dict, out: Path) -> str:
    sizes = [c["bytes"] for c in plan["cuts"]]
    mean = sum(sizes) / max(len(sizes), 1)
    return (f"planned {out}: {plan['records']} records in {plan['tasks']} tasks "
            f"(largest task {max(sizes, default=0) / max(mean, 1):.2f}x the mean input bytes)\n"
            f"  run each: vlmprep build --out {out} --task-index I   (I = 0..{plan['tasks'] - 1})\n"
            f"  then:     vlmprep merge {out}")


def format_task_summary(task: dict, out: Path) -> str:
    t = task["totals"]
    return (f"task {task['task']} of {out}: {t['records']} records -> {t['samples']} samples in "
            f"{len(task['shards'])} shards, {t['rejected']} rejected")
