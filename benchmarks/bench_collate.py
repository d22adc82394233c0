"""Collate benchmark: time to collate 1,024 decoded samples into one padded batch (seed reference 16.2 ms), and,
apart, the widening to int64 plus labels/attention mask that `Batch.to(device)` does on the training device
(measured here on the CPU, the worst case). Then small micro-batches (1, 4, 16 samples: VLM runs' usual
micro_batch_size), where collate copies row by row, against the B x L mask fill it uses past 32 rows, in the same
run."""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks.emit import emit


def samples(n: int, seed: int = 0):
    from trainer.data.decode import DecodedSample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(64, 1024))
        out.append(
            DecodedSample(
                key=f"{i:010d}",
                id=f"s{i}",
                input_ids=rng.integers(0, 151000, L, dtype=np.int32),
                loss_mask=(rng.random(L) < 0.4).astype(np.uint8),
                mm_token_type_ids=np.zeros(L, np.uint8),
                position_ids=np.broadcast_to(np.arange(L, dtype=np.int32), (3, L)).copy(),
                image_grid_thw=np.zeros((0, 3), np.int32),
                images=[],
                image_index=[],
                position=i,
            )
        )
    return out


def run(quick: bool) -> list[dict]:
    import torch

    from trainer.data.collate import CollateSpec, collate, keep_freed_buffers

    torch.set_num_threads(1)
    keep_freed_buffers()  # as the trainer does at start
    batch = samples(1024)
    spec = CollateSpec(pad_id=151643, image_token_id=151655, patch_size=14, merge_size=2)
    collate(batch, spec)  # warm-up
    times = []
    for _ in range(3 if quick else 20):
        t0 = time.perf_counter()
        out = collate(batch, spec)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    widen = []
    for _ in range(3 if quick else 20):
        t0 = time.perf_counter()
        dev = out.to("cpu")
        dev.labels, dev.attention_mask  # noqa: B018 - made where the model uses them
        widen.append(time.perf_counter() - t0)
    return [
        *small_batches(spec, quick),
        emit(
            "collate",
            samples=1024,
            tokens=int(sum(s.num_tokens for s in batch)),
            padded_shape=list(out.input_ids.shape),
            host_bytes=sum(
                t.nbytes for t in (out.input_ids, out.loss_mask, out.lengths, out.position_ids, out.mm_token_type_ids)
            ),
            median_ms=round(ms, 3),
            goal_ms=10,
            seed_reference_ms=16.2,
            widen_on_cpu_median_ms=round(statistics.median(widen) * 1e3, 3),
        ),
    ]


def small_batches(spec, quick: bool) -> list[dict]:
    """us per micro-batch of B short samples (64-1024 tokens), row copies against the mask fill, alternated."""
    import trainer.data.collate as C

    rows, was = [], C._ROW_COPY_MAX
    pool = samples(64 if quick else 512, seed=1)
    try:
        for B in (1, 4, 16):
            groups = [pool[i : i + B] for i in range(0, len(pool) - B + 1, B)]
            best = {}
            for _ in range(3 if quick else 7):
                for name, limit in (("rows", was), ("mask", 0)):
                    C._ROW_COPY_MAX = limit
                    t0 = time.perf_counter()
                    for g in groups:
                        C.collate(g, spec)
                    us = (time.perf_counter() - t0) * 1e6 / len(groups)
                    best[name] = min(best.get(name, us), us)
            rows.append(
                emit(
                    "collate",
                    metric="small_batches",
                    batch=B,
                    rows_us=round(best["rows"], 1),
                    mask_us=round(best["mask"], 1),
                    speedup=round(best["mask"] / best["rows"], 2),
                )
            )
    finally:
        C._ROW_COPY_MAX = was
    return rows
