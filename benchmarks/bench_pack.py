"""Packing benchmark: 8 simulated ranks over the demo traces' real token counts (built with --seq-len 16384), one
micro-batch per step. Per T: packed rows (--pack-to T, the trainer's own Packer) side by side with a padded token
budget of T (--max-tokens-per-batch T) and one sample per micro-batch, on the same rank streams: fill (real tokens /
slots paid for), per-step max/mean tokens and attention cost (sum of squared sample lengths) across ranks, packing
time. Then the loader cost of packing on real decoded samples: Packer + collate_packed vs collate, per sample."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.bench_balance import imbalance, shard_lengths
from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

SEQ_LEN = 16384


class _Len:
    """What the Packer reads of a sample: its stream position and length."""

    def __init__(self, position: int, n: int):
        self.position, self.num_tokens, self.id = position, n, str(position)


def packed_steps(lengths: list[int], capacity: int, window: int) -> tuple[list[list[int]], float]:
    """A rank's steps as lists of sample lengths (one row each), and the seconds the Packer took."""
    from trainer.data.pack import Packer

    samples = [_Len(i, n) for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    packer = Packer(iter(samples), capacity=capacity, window=window)
    rows = []
    while (row := packer.next_row()) is not None:
        rows.append([s.num_tokens for s in row])
    return rows, time.perf_counter() - t0


def budget_steps(lengths: list[int], budget: int) -> list[list[int]]:
    """The trainer's MicroBatcher rule: samples in stream order while rows x longest fits the budget (0: one each)."""
    steps, group = [], []
    for n in lengths:
        if group and (not budget or max(group + [n]) * (len(group) + 1) > budget):
            steps.append(group)
            group = []
        group.append(n)
    if group:
        steps.append(group)
    return steps


def summarize(per_rank: list[list[list[int]]], slots) -> dict:
    """Per-step figures over ranks; an exhausted rank idles (0) until the busiest one is done, as in training."""
    n = max(len(s) for s in per_rank)
    tokens = np.array([[sum(g) for g in s] + [0] * (n - len(s)) for s in per_rank], dtype=np.float64)
    attn = np.array([[sum(x * x for x in g) for g in s] + [0] * (n - len(s)) for s in per_rank], dtype=np.float64)
    paid = sum(slots(g) for s in per_rank for g in s)
    return dict(
        steps=n,
        fill=round(float(tokens.sum() / paid), 4),
        step_max_over_mean_tokens=round(imbalance(tokens), 4),
        step_max_over_mean_attention=round(imbalance(attn), 4),
        worst_step_max_over_mean_tokens=round(float((tokens.max(0) / tokens.mean(0)).max()), 3),
    )


def loader_cost(ds: Path, n: int, capacity: int, window: int) -> dict:
    """ms per sample of Packer + collate_packed against collate of one sample per micro-batch, on decoded samples."""
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.pack import Packer, collate_packed
    from trainer.data.processors import load_image_processor_config
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream
    from trainer.data.vision import ImageSpec

    spec = ImageSpec.from_config(load_image_processor_config(str(ds / "processor")))
    samples = []
    for s in RankStream(list(resolve_data(str(ds)).shards), start=0, spec=spec):
        samples.append(s)
        if len(samples) >= n:
            break
    cs = CollateSpec(pad_id=0, image_token_id=151655, patch_size=spec.patch_size, merge_size=spec.merge_size)

    def best(fn) -> float:
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return min(runs) * 1000 / len(samples)

    def packed():
        packer = Packer(iter(samples), capacity=capacity, window=window)
        while (row := packer.next_row()) is not None:
            collate_packed([row], cs)

    def plain():
        for s in samples:
            collate([s], cs)

    pack_ms, plain_ms = best(packed), best(plain)
    return dict(
        samples=len(samples),
        pack_ms_per_sample=round(pack_ms, 4),
        collate_ms_per_sample=round(plain_ms, 4),
        added_ms_per_sample=round(pack_ms - plain_ms, 4),
        goal_ms=1.0,
    )


def run(quick: bool, n: int | None = None, world: int = 8, window: int = 64) -> list[dict]:
    from trainer.data.sources import ShardRef, plan_shards

    n = n or (64 if quick else 1000)
    inp = traces(n, width=160, height=100, max_images=25)  # token counts only, as in bench_balance
    ds = OUT / "pack"
    timed_build(inp, ds, samples_per_shard=4, workers=1 if quick else 2, seq_len=SEQ_LEN)
    shards = shard_lengths(ds)
    refs = tuple(ShardRef(url=str(i), name=str(i), num_samples=len(s), num_tokens=sum(s)) for i, s in enumerate(shards))
    plan = plan_shards(refs, world)
    ranks = [[L for i in plan.per_rank[r] for L in shards[i]] for r in range(world)]
    samples = sum(len(r) for r in ranks)
    rows = []
    for T in (16384, 32768):
        packed, seconds = zip(*(packed_steps(r, T, window) for r in ranks))
        rows.append(
            emit(
                "pack",
                metric="pack",
                pack_to=T,
                pack_window=window,
                ranks=world,
                samples=samples,
                **summarize(list(packed), lambda g, T=T: T),
                pack_ms_per_1000_samples=round(sum(seconds) * 1000 * 1000 / samples, 3),
                goal_fill=0.97 if T == 16384 else None,
                goal_max_over_mean=1.05 if T == 16384 else None,
            )
        )
        budget = [budget_steps(r, T) for r in ranks]
        rows.append(
            emit(
                "pack",
                metric="token_budget",
                max_tokens_per_batch=T,
                ranks=world,
                samples=samples,
                **summarize(budget, lambda g: max(g) * len(g)),
            )
        )
    micro = [budget_steps(r, 0) for r in ranks]
    rows.append(
        emit("pack", metric="micro_batch_1", ranks=world, samples=samples, **summarize(micro, lambda g: sum(g)))
    )
    rows.append(
        emit(
            "pack",
            metric="loader_cost",
            pack_to=16384,
            pack_window=window,
            **loader_cost(ds, 64 if quick else 500, 16384, window),
        )
    )
    return rows
