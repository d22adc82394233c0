"""Balance benchmark: 8 simulated ranks over the demo traces' real token counts. Tokens per step, max/mean
across ranks, for the trainer's token-balanced shard plan (+ token-budget micro-batches) vs a sample-count
split; both run the same number of steps, as the trainer does."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np

from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces


def shard_lengths(ds: Path) -> list[list[int]]:
    manifest = json.loads((ds / "manifest.json").read_text())
    out = []
    for s in manifest["shards"]:
        with tarfile.open(ds / s["name"]) as tf:
            out.append([json.loads(tf.extractfile(m).read())["num_tokens"] for m in tf if m.name.endswith(".json")])
    return out


def steps_tokens(rank_lengths: list[list[int]], *, micro: int = 0, budget: int = 0, accum: int = 1) -> np.ndarray:
    """Per-step padded tokens of each rank: count batching (micro samples) or token budget (rows x longest),
    `accum` micro-batches per optimizer step (gradient accumulation)."""
    per_rank = []
    for lengths in rank_lengths:
        steps, group = [], []
        for L in lengths:
            full = (max(group + [L]) * (len(group) + 1) > budget) if budget else len(group) >= micro
            if group and full:
                steps.append(max(group) * len(group))
                group = []
            group.append(L)
        if group:
            steps.append(max(group) * len(group))
        steps += [0] * (-len(steps) % accum)
        per_rank.append([sum(steps[i : i + accum]) for i in range(0, len(steps), accum)])
    n = max(len(s) for s in per_rank)
    return np.array([s + [0] * (n - len(s)) for s in per_rank], dtype=np.float64)  # exhausted ranks idle


def imbalance(tokens: np.ndarray) -> float:
    """Mean over steps of max/mean across ranks: the fraction of time the slowest rank makes the others wait."""
    mean = tokens.mean(axis=0)
    ok = mean > 0
    return float((tokens.max(axis=0)[ok] / mean[ok]).mean())


def run(quick: bool, n: int | None = None, world: int = 8) -> list[dict]:
    from trainer.data.sources import ShardRef, plan_shards

    n = n or (64 if quick else 1000)
    inp = traces(n, width=160, height=100, max_images=25)  # token counts only: small screenshots, same structure
    ds = OUT / "balance"
    timed_build(inp, ds, samples_per_shard=4, workers=1 if quick else 2)
    shards = shard_lengths(ds)
    refs = tuple(ShardRef(url=str(i), name=str(i), num_samples=len(s), num_tokens=sum(s)) for i, s in enumerate(shards))
    plan = plan_shards(refs, world)
    balanced = [[L for i in plan.per_rank[r] for L in shards[i]] for r in range(world)]
    flat = [L for s in shards for L in s]
    chunk = -(-len(flat) // world)
    by_count = [flat[r * chunk : (r + 1) * chunk] for r in range(world)]
    budget = 2 * max(flat)
    rows = []
    for name, ranks in (("sample_count_split", by_count), ("token_balanced_shards", balanced)):
        totals = [sum(r) for r in ranks]
        rows.append(
            emit(
                "balance",
                plan=name,
                ranks=world,
                samples=len(flat),
                epoch_tokens_max_over_mean=round(max(totals) / (sum(totals) / world), 4),
                step_max_over_mean_micro1=round(imbalance(steps_tokens(ranks, micro=1)), 4),
                step_max_over_mean_budget=round(imbalance(steps_tokens(ranks, budget=budget)), 4),
                step_max_over_mean_budget_accum8=round(imbalance(steps_tokens(ranks, budget=budget, accum=8)), 4),
                token_budget=budget,
                goal=1.05,
            )
        )
    return rows
