"""The run's training data: --data specs -> resolved datasets checked to share one processor (RunData) -> each
rank's shard plan and indexed sources -> its StepLoader and the run's length in steps.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.cache import ShardCache, remote_shards
from trainer.collate import CollateSpec
from trainer.config import ConfigError, DataSpec, TrainConfig, cache_limit_bytes
from trainer.data import StepLoader, steps_per_epoch
from trainer.decode import refuse_videos
from trainer.index import index_shards
from trainer.model import model_type_of
from trainer.order import RankSource, Schedule, rank_steps, schedule
from trainer.shards import (
    REMOTE,
    DataError,
    DataSource,
    ShardPlan,
    check_processor,
    load_image_processor_config,
    load_video_processor_config,
    plan_shards,
    processor_difference,
    resolve_data,
)
from trainer.vision import ImageSpec


def _load_image_spec(cfg: TrainConfig, processor: str | None) -> ImageSpec:
    location = cfg.processor or processor
    if not location:
        raise ConfigError(f"--data {cfg.sources[0].path} has no manifest to find the processor: pass --processor DIR")
    # No file linking out of a dataset's processor, no custom code in any (docs/untrusted-datasets.md).
    check_processor(location, user_named=bool(cfg.processor))
    try:
        return ImageSpec.from_config(load_image_processor_config(location), load_video_processor_config(location))
    except ValueError as e:
        raise DataError(f"{location}: {e}") from None


def check_compatible(specs: tuple[DataSpec, ...], datasets: list[DataSource], processor: str) -> None:
    """Mixed datasets must come from one tokenizer vocabulary, model family and image processor."""
    for spec, ds in zip(specs[1:], datasets[1:]):
        diff = processor_difference(datasets[0], ds, processor)
        if diff:
            raise ConfigError(f"datasets {specs[0].name!r} ({specs[0].path}) and {spec.name!r} ({spec.path}) were "
                              f"built with incompatible processors ({'; '.join(diff)}): a mixture needs one "
                              "tokenizer vocabulary, model family and image processor; rebuild one of them with the "
                              "other's --processor")


def rank_sources(specs: tuple[DataSpec, ...], datasets: list[DataSource], plans: list[ShardPlan], *, rank: int,
                 world: int, cache: Path) -> tuple[list[RankSource], int]:
    """Each source's shards as this rank reads them, with their sample indexes (trainer/index.py: the build's
    sidecars, remote ones fetched into `cache`), and how many shards had none (indexed from their tars)."""
    total = sum(d.weight for d in specs)
    out, derived = [], 0
    for spec, ds, plan in zip(specs, datasets, plans):
        shards = ds.shards if plan.stride else tuple(ds.shards[i] for i in plan.per_rank[rank])
        indexes, n = index_shards(shards, cache)
        derived += n
        out.append(RankSource(spec.name, spec.weight / total, spec.on_end, shards, indexes,
                              (rank, world) if plan.stride else (0, 1), -1 if plan.stride else rank))
    return out, derived


def fit_span(cfg: TrainConfig, data: "RunData", world: int) -> TrainConfig:
    """Under --shard-cache-limit, the sample shuffle of remote data mixes blocks of shards that fit the cache: each
    rank's share of the limit (the node's limit over its LOCAL_WORLD_SIZE ranks) holds, per dataset, the block being
    read and the next one being fetched. Returns cfg with that --shuffle-span when it was 0 (written to config.toml
    and compared on resume); refuses a limit below one shard per dataset, or a span given that cannot fit."""
    remote = any(s.url.startswith(("pipe:",) + REMOTE) for d in data.datasets for s in d.shards)
    if not cfg.shard_cache_limit or not remote or not (cfg.shuffle or len(data.specs) > 1):
        return cfg
    limit = cache_limit_bytes(cfg.shard_cache_limit) // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    biggest = max(s.num_bytes or 0 for d in data.datasets for s in d.shards)
    n = len(data.specs)
    if n * biggest > limit:
        raise ConfigError(f"--shard-cache-limit {cfg.shard_cache_limit} leaves each rank {limit} bytes, less than one "
                          f"shard per dataset ({n} x {biggest} bytes, the largest shard): raise it")
    if not cfg.shuffle:
        return cfg
    fits = max(limit // (2 * n * biggest), 1)
    if cfg.shuffle_span and cfg.shuffle_span * n * biggest > limit:
        raise ConfigError(f"--shuffle-span {cfg.shuffle_span} mixes up to {cfg.shuffle_span} shards per dataset at "
                          f"once ({n} x {cfg.shuffle_span} x {biggest} bytes), more than --shard-cache-limit "
                          f"{cfg.shard_cache_limit} leaves each rank ({limit} bytes): pass --shuffle-span {fits} or "
                          "raise the limit")
    if cfg.shuffle_span:
        return cfg
    most = max(len(p.per_rank[0]) if p.stride else max(len(r) for r in p.per_rank) for p in data.plans)
    return dataclasses.replace(cfg, shuffle_span=fits if fits < most else 0)


def predict_steps(cfg: TrainConfig, sources: list[RankSource], device: torch.device) -> tuple[list[int], Schedule]:
    """Steps of each epoch, by running the batcher / packer over the stored token counts in schedule order; the
    busiest rank sets an epoch's length (the others pad). Also returns epoch 0's schedule, for the loader."""
    mine, first = [], None
    for epoch in range(cfg.epochs):
        order = schedule(sources, seed=cfg.seed, epoch=epoch, shuffle=cfg.shuffle, shuffle_shards=cfg.shuffle_shards,
                         span=cfg.shuffle_span)
        first = order if epoch == 0 else first
        lengths = order.tokens(sources)
        mine.append(rank_steps(lengths, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_batch,
                               grad_accum=cfg.grad_accum, pack_to=cfg.pack_to, pack_window=cfg.pack_window))
    steps = torch.tensor(mine, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return [int(x) for x in steps.tolist()], first


@dataclass(frozen=True)
class RunData:
    """The run's datasets, resolved: their specs, shard lists and rank plans, and the image processor they share."""

    specs: tuple[DataSpec, ...]
    datasets: list[DataSource]
    plans: list[ShardPlan]
    image: ImageSpec
    label: str  # how run.json and messages name the data


def open_data(cfg: TrainConfig, world: int) -> RunData:
    specs = cfg.sources
    datasets = [resolve_data(d.path) for d in specs]
    model_type = model_type_of(model=cfg.model, tiny_random=cfg.tiny_random)
    for d, ds in zip(specs, datasets):
        refuse_videos(ds.manifest, str(d.path), model_type)
    for d in cfg.eval_sources:
        refuse_videos(resolve_data(d.path).manifest, f"--eval-data {d.path}", model_type)
    image = _load_image_spec(cfg, datasets[0].processor)
    if len(specs) > 1:
        check_compatible(specs, datasets, cfg.processor)
    label = cfg.data if isinstance(cfg.data, str) else ",".join(f"{d.name}={d.path}" for d in specs)
    return RunData(specs, datasets, [plan_shards(d.shards, world) for d in datasets], image, label)


def log_plans(data: RunData, world: int) -> None:
    for d, ds, p in zip(data.specs, data.datasets, data.plans):
        counts = ", ".join(f"rank {r}: {len(s)} shards {t} {'tokens' if ds.counted else 'shards'}"
                           for r, (s, t) in enumerate(zip(p.per_rank, p.rank_tokens)))
        if p.stride:
            counts = f"fewer shards than ranks: every rank reads all shards and decodes one sample in {world}"
        print(f"trainer: {f'{d.name}: ' if d.name else ''}{len(ds.shards)} shards over {world} ranks ({counts}); "
              f"max/mean imbalance {p.imbalance:.3f}; remainder policy 'pad': ranks that run out first take empty "
              "micro-batches until all ranks are done, so no sample is dropped", file=sys.stderr)


def make_loader(cfg: TrainConfig, data: RunData, *, rank: int, world: int, device: torch.device,
                collate_spec: CollateSpec, out: Path) -> tuple[StepLoader, int | None, int]:
    """The rank's step loader, the run's total steps (None: until the data ends) and the LR schedule's length.
    The epoch schedule (trainer/order.py) reads samples by random access: sample shuffle, mixtures. Without them the
    shards stream in sequence as before (any URL, no copy); local shards are indexed anyway so the step count of a
    token budget or packing run is known up front."""
    scheduled = cfg.shuffle or len(data.specs) > 1
    local = not any(s.url.startswith(("pipe:",) + REMOTE) for d in data.datasets for s in d.shards)
    sources, index_s, derived, cache = None, 0.0, 0, None
    root = Path(cfg.shard_cache or out / "shard-cache") / f"rank-{rank:05d}"
    if scheduled or local:
        t0 = time.perf_counter()
        sources, derived = rank_sources(data.specs, data.datasets, data.plans, rank=rank, world=world, cache=root)
        index_s = time.perf_counter() - t0
    if scheduled and remote_shards(sources):
        limit = cache_limit_bytes(cfg.shard_cache_limit) // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
        cache = ShardCache(sources, root, limit=limit, prefetch=cfg.shard_prefetch)
    plan = data.plans[0]
    predicted, first = predict_steps(cfg, sources, device) if sources is not None else (None, None)
    if predicted is None:
        per_epoch = steps_per_epoch(list(plan.rank_samples), micro_batch_size=cfg.micro_batch_size,
                                    max_tokens=cfg.max_tokens_per_batch, grad_accum=cfg.grad_accum, pack_to=cfg.pack_to)
        predicted = [per_epoch] * cfg.epochs if per_epoch is not None else None
    total = cfg.max_steps or (sum(predicted) if predicted is not None else None)
    schedule_len = cfg.schedule_steps or total
    if schedule_len is None:
        raise ConfigError("the number of steps is not known up front (token budget or packing over streamed "
                          "http(s)/pipe: shards without the sample shuffle): pass --max-steps or --schedule-steps")
    if rank == 0:
        _log_order(cfg, data.specs, sources, predicted, index_s)
        if derived:
            print(f"trainer: note: {derived} shard(s) on rank 0 have no sample index (an older vlmprep built them): "
                  "indexed from every tar header and sample meta, as before; rebuild with this vlmprep for a "
                  "start-up that does not grow with the sample count", file=sys.stderr)
        if cache is not None:
            print(f"trainer: remote shards stream through {root.parent} ("
                  + (f"at most {cfg.shard_cache_limit} per node, " if cfg.shard_cache_limit else "no size limit, ")
                  + f"{cfg.shard_prefetch} shards fetched ahead, each checked against the manifest's sha256)",
                  file=sys.stderr)
    loader = StepLoader([data.datasets[0].shards[i] for i in plan.per_rank[rank]], spec=data.image,
                        collate_spec=collate_spec, seed=cfg.seed, shuffle=cfg.shuffle_shards,
                        micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_batch,
                        grad_accum=cfg.grad_accum, num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                        stride=(rank, world) if plan.stride else (0, 1), pack_to=cfg.pack_to,
                        pack_window=cfg.pack_window, sources=sources if scheduled else None,
                        sample_shuffle=cfg.shuffle, shuffle_span=cfg.shuffle_span,
                        first_schedule=first if scheduled else None, cache=cache)
    return loader, total, schedule_len


def _log_order(cfg: TrainConfig, specs, sources: list[RankSource] | None, predicted: list[int] | None,
               index_s: float) -> None:
    """Start-up lines: how samples are ordered, the mixture, the predicted length (rank 0's view)."""
    if cfg.shuffle:
        span = f"blocks of {cfg.shuffle_span} shards" if cfg.shuffle_span else "all of a rank's shards at once"
        order = f"sample shuffle on (seed {cfg.seed}, a new permutation each epoch over {span})"
    else:
        order = ("no sample shuffle: shards in sequence" + (", their order shuffled per epoch" if cfg.shuffle_shards
                                                          else ", in manifest order"))
    idx = f"; {sum(len(s.indexes) for s in sources)} shards indexed in {index_s:.1f}s" if sources else ""
    print(f"trainer: data order: {order}{idx}", file=sys.stderr)
    if len(specs) > 1 and sources:
        total = sum(d.weight for d in specs)
        parts = [f"{d.name} weight {d.weight / total:.3f} on_end={d.on_end} ({sum(ix.num_samples for ix in s.indexes)} "
                 f"samples, {sum(int(ix.trained.sum()) for ix in s.indexes)} trained tokens on rank 0)"
                 for d, s in zip(specs, sources)]
        print("trainer: mixture by share of trained tokens: " + "; ".join(parts) + "; an epoch ends when every "
              "dataset has been read through once", file=sys.stderr)
    if predicted is not None:
        print(f"trainer: predicted steps per epoch: {', '.join(map(str, predicted))} (total {sum(predicted)})",
              file=sys.stderr)
