"""The data path of a run, chained top to bottom (the stages are the modules of trainer/data/, README.md):

--data specs -> RunData (datasets.py: resolved, checked, planned over the ranks)
  -> ReadPlan (read_plan: this rank's way of reading: scheduled or in sequence, its shard cache dir and limit,
     the shuffle span that fits it, its sha256 checks)
  -> the rank's sources with their sample indexes (rank_sources: index.py, integrity.py)
  -> the run's length in steps (steps.py) and the rank's streams (streams.py, through cache.py for remote or
     not yet hashed shards)
  -> its StepLoader (batches.py); and a StepLoader per eval set (eval_loaders)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import ConfigError, DataSpec, cache_limit_bytes
from trainer.data.batches import StepLoader
from trainer.data.cache import ShardCache, remote_shards
from trainer.data.collate import CollateSpec
from trainer.data.datasets import RunData, plural
from trainer.data.decode import trains_videos
from trainer.data.integrity import RECORD, ShardCheck, check_local_shards, checked_indexes
from trainer.data.order import RankSource, Schedule
from trainer.data.pack import check_packing
from trainer.data.processors import processor_difference
from trainer.data.sources import REMOTE_OR_PIPE, DataSource, ShardPlan, plan_shards, resolve_data
from trainer.data.steps import predict_steps, steps_per_epoch
from trainer.data.streams import EpochSchedule, ShardSequence, Streams
from trainer.options import Batching, DataOptions, RunLength


@dataclass(frozen=True)
class ReadPlan:
    """How this rank reads the run's data, decided once at start-up (read_plan) and followed by its loaders."""

    rank: int
    scheduled: bool  # by the epoch schedule (sample shuffle or a mixture), else the shards in sequence
    remote: bool  # some shard is a URL or a pipe
    cache_dir: Path  # this rank's shard cache dir (--shard-cache, else RUN/shard-cache): fetched shards, indexes
    cache_limit: int  # this rank's bytes of --shard-cache-limit (the node's over LOCAL_WORLD_SIZE); 0: none
    shuffle_span: int  # --shuffle-span, fitted to the cache limit where it was 0 (fit_span)
    check: ShardCheck  # the rank's sha256 checks of the shards it reads (eval sets too), recorded in cache_dir


def read_plan(options: DataOptions, data: RunData, *, rank: int) -> ReadPlan:
    """This rank's way of reading `data`: scheduled or in sequence, whether any shard is remote, its shard cache dir
    and share of --shard-cache-limit, the shuffle span that fits that share (fit_span; the run writes it into
    config.toml, where a resume compares it), and its ShardCheck (the record of what it hashed, in its cache dir)."""
    remote = any(s.url.startswith(REMOTE_OR_PIPE) for d in data.datasets for s in d.shards)
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1) if options.shard_cache_limit else 1
    limit = cache_limit_bytes(options.shard_cache_limit) // local_ranks
    cache_dir = Path(options.shard_cache or Path(options.out) / "shard-cache") / f"rank-{rank:05d}"
    return ReadPlan(
        rank,
        options.scheduled,
        remote,
        cache_dir,
        limit,
        fit_span(options, data, remote=remote, limit=limit),
        ShardCheck(cache_dir / RECORD, enabled=options.verify_shards),
    )


def fit_span(options: DataOptions, data: RunData, *, remote: bool, limit: int) -> int:
    """Under --shard-cache-limit, the sample shuffle of remote data mixes blocks of shards that fit the cache: each
    rank's share of the limit (`limit`) holds, per dataset, the block being read and the next one being fetched.
    Returns that --shuffle-span where it was 0 (else the span given); refuses a limit below one shard per dataset, or
    a span given that cannot fit."""
    if not options.shard_cache_limit or not remote or not options.scheduled:
        return options.shuffle_span
    biggest = max(s.num_bytes or 0 for d in data.datasets for s in d.shards)
    n = len(data.specs)
    if n * biggest > limit:
        raise ConfigError(
            f"--shard-cache-limit {options.shard_cache_limit} leaves each rank {limit} bytes, less than "
            f"one shard per dataset ({n} x {biggest} bytes, the largest shard): raise it"
        )
    if not options.shuffle:
        return options.shuffle_span
    fits = max(limit // (2 * n * biggest), 1)
    span = options.shuffle_span
    if span and span * n * biggest > limit:
        raise ConfigError(
            f"--shuffle-span {span} mixes up to {span} shards per dataset at once ({n} x {span} x "
            f"{biggest} bytes), more than --shard-cache-limit {options.shard_cache_limit} leaves each "
            f"rank ({limit} bytes): pass --shuffle-span {fits} or raise the limit"
        )
    if span:
        return span
    most = max(len(p.per_rank[0]) if p.stride else max(len(r) for r in p.per_rank) for p in data.plans)
    return fits if fits < most else 0


def rank_sources(
    specs: tuple[DataSpec, ...],
    datasets: list[DataSource],
    plans: list[ShardPlan],
    *,
    rank: int,
    world: int,
    cache: Path,
    check: ShardCheck | None = None,
    defer: bool = False,
) -> tuple[list[RankSource], int]:
    """Each source's shards as this rank reads them, with their sample indexes (index.py: the build's dataset index
    or sidecars, remote ones fetched into `cache`), and how many shards had none (indexed from their tars). Local
    shards are checked against their manifest's sha256 first (by `check`; none: stats only; `defer`: listed in
    check.deferred for the shard cache to hash ahead of the readers instead); where every rank reads every shard
    (fewer shards than ranks), rank r hashes shards r, r + world, ... Remote shards are checked by the shard cache as
    it fetches them."""
    check = check or ShardCheck(None, enabled=False)
    total = sum(d.weight for d in specs)
    out, derived = [], 0
    for spec, ds, plan in zip(specs, datasets, plans):
        shards = ds.shards if plan.stride else tuple(ds.shards[i] for i in plan.per_rank[rank])
        hashed = {s.url for k, s in enumerate(shards) if not plan.stride or k % world == rank}
        # the manifest's sha256 of the rank's own shards (ShardRef.sha256), not a dict of the dataset's
        indexes = checked_indexes(
            shards,
            ds,
            cache=cache,
            check=check,
            defer=defer,
            want=lambda s, hashed=hashed: s.sha256 if s.url in hashed else None,
        )
        derived += 0 if ds.index is not None else sum(s.index is None for s in shards)
        out.append(
            RankSource(
                spec.name,
                spec.weight / total,
                spec.on_end,
                shards,
                indexes,
                (rank, world) if plan.stride else (0, 1),
                -1 if plan.stride else rank,
            )
        )
    return out, derived


@dataclass
class _RankPart:
    """This rank's sources as make_loader found them: indexed (None: streamed in sequence, unindexed), the shard
    cache they are read through, and what rank 0 says of them at start."""

    sources: list[RankSource] | None
    cache: ShardCache | None = None
    derived: int = 0  # shards without a sample index, indexed from their tars
    index_s: float = 0.0  # seconds the indexing took


def make_loader(
    read: tuple[Streams, list[int] | None],
    options: DataOptions,
    collate_spec: CollateSpec,
    *,
    batching: Batching,
    length: RunLength,
) -> tuple[StepLoader, int | None, int]:
    """The rank's step loader over `read` (data_streams' streams and predicted steps), the run's total steps (None:
    until the data ends) and the LR schedule's length. The epoch schedule (order.py) reads samples by random access:
    sample shuffle, mixtures. Without them the shards stream in sequence as before (any URL, no copy); local shards
    are indexed anyway so the step count of a token budget or packing run is known up front."""
    streams, predicted = read
    total = length.max_steps or (sum(predicted) if predicted is not None else None)
    schedule_len = length.schedule_steps or total
    if schedule_len is None:
        raise ConfigError(
            "the number of steps is not known up front (token budget or packing over streamed "
            "http(s)/pipe: shards without the sample shuffle): pass --max-steps or --schedule-steps"
        )
    loader = StepLoader(
        streams,
        collate_spec=collate_spec,
        batching=batching,
        num_workers=options.num_workers,
        prefetch_factor=options.prefetch_factor,
    )
    return loader, total, schedule_len


def data_streams(
    options: DataOptions,
    plan: ReadPlan,
    data: RunData,
    *,
    batching: Batching,
    length: RunLength,
    device: torch.device,
    epoch: int = 0,
    announce: bool = True,
) -> tuple[Streams, list[int] | None]:
    """The rank's streams over `data` from `epoch` on, and the predicted steps of epochs `epoch` .. --epochs - 1 (at
    least `epoch`'s; None where not known up front). Rank 0 says how it reads (`announce`: at the run's start); a
    --follow run calls it again for each epoch read at another version."""
    assert options.shuffle_span == plan.shuffle_span, "data_streams reads the options read_plan fitted"
    part = _index_rank(plan, data)
    if plan.scheduled and (remote_shards(part.sources) or plan.check.deferred):
        part.cache = ShardCache(
            part.sources, plan.cache_dir, limit=plan.cache_limit, prefetch=options.shard_prefetch, check=plan.check
        )
    epochs = range(epoch, max(length.epochs, epoch + 1))
    if part.sources is not None:
        predicted, first = predict_steps(
            part.sources, options, batching, specs=data.specs, epochs=epochs, device=device
        )
    else:
        per_epoch = steps_per_epoch(list(data.plans[0].rank_samples), batching)
        predicted, first = ([per_epoch] * len(epochs) if per_epoch is not None else None), None
    if plan.rank == 0 and announce:
        _log_start(options, plan, data.specs, part, predicted, max_steps=length.max_steps)
    return _streams(options, plan, data, part, first, epoch), predicted


def _index_rank(plan: ReadPlan, data: RunData) -> _RankPart:
    """The rank's sources with their sample indexes, where it reads by the schedule or its shards are local; the
    record of what it hashed (eval sets too) saved, so a resume does not hash it again."""
    part = _RankPart(None)
    if plan.scheduled or not plan.remote:
        t0 = time.perf_counter()
        # A scheduled run reads its local shards through the shard cache's gate, which hashes each one ahead of the
        # readers: step 1 waits for its own shards' hashes, not the rank's whole share's.
        part.sources, part.derived = rank_sources(
            data.specs,
            data.datasets,
            data.plans,
            rank=plan.rank,
            world=data.world,
            cache=plan.cache_dir,
            check=plan.check,
            defer=plan.scheduled,
        )
        part.index_s = time.perf_counter() - t0
    plan.check.save()
    return part


def _streams(
    options: DataOptions, plan: ReadPlan, data: RunData, part: _RankPart, first: Schedule | None, epoch: int
) -> Streams:
    """The rank's read path: the epoch schedule over its indexed sources (`epoch`'s schedule `first`, when the step
    prediction made it), or its shards of the one dataset in sequence."""
    order = dict(spec=data.image, seed=options.seed, shuffle_shards=options.shuffle_shards)  # both read paths'
    if plan.scheduled:
        return EpochSchedule(
            part.sources,
            **order,
            shuffle=options.shuffle,
            shuffle_span=options.shuffle_span,
            first=(epoch, first) if first is not None else None,
            cache=part.cache,
        )
    shards = data.plans[0]
    signatures = {s.url: ix.signature for src in part.sources or [] for s, ix in zip(src.shards, src.indexes)}
    return ShardSequence(
        [data.datasets[0].shards[i] for i in shards.per_rank[plan.rank]],
        **order,
        stride=(plan.rank, data.world) if shards.stride else (0, 1),
        signatures=signatures,
    )


def _log_start(
    options: DataOptions,
    plan: ReadPlan,
    specs: tuple[DataSpec, ...],
    part: _RankPart,
    predicted: list[int] | None,
    *,
    max_steps: int,
) -> None:
    """Rank 0's start-up lines about its data: the order, the mixture and the run's length, and where its shards'
    indexes, hashes and copies come from."""
    _log_order(options, specs, part.sources, predicted, part.index_s, max_steps=max_steps)
    if part.derived:
        print(
            f"trainer: note: {part.derived} shard(s) on rank 0 have no sample index (an older vlmprep built them): "
            "indexed from every tar header and sample meta, as before; rebuild with this vlmprep for a "
            "start-up that does not grow with the sample count",
            file=sys.stderr,
        )
    if plan.check.deferred:
        print(
            f"trainer: {len(plan.check.deferred)} local shard(s) on rank 0 not yet hashed by this run dir are "
            "checked against the manifest's sha256 as the run first reaches them (ahead of the readers, in read "
            "order; a mismatch stops the run naming the shard), not all before step 1",
            file=sys.stderr,
        )
    if part.cache is not None and remote_shards(part.sources):
        limit = options.shard_cache_limit
        print(
            f"trainer: remote shards stream through {plan.cache_dir.parent} ("
            + (f"at most {limit} per node, " if limit else "no size limit, ")
            + f"{options.shard_prefetch} shards fetched ahead, each checked against the manifest's sha256)",
            file=sys.stderr,
        )


def _log_order(
    options: DataOptions,
    specs: tuple[DataSpec, ...],
    sources: list[RankSource] | None,
    predicted: list[int] | None,
    index_s: float,
    *,
    max_steps: int,
) -> None:
    """Start-up lines: how samples are ordered, the mixture, the predicted length (rank 0's view)."""
    if options.shuffle:
        span = f"blocks of {options.shuffle_span} shards" if options.shuffle_span else "all of a rank's shards at once"
        order = f"sample shuffle on (seed {options.seed}, a new permutation each epoch over {span})"
    else:
        order = "no sample shuffle: shards in sequence" + (
            ", their order shuffled per epoch" if options.shuffle_shards else ", in manifest order"
        )
    idx = f"; {sum(len(s.indexes) for s in sources)} shards indexed in {index_s:.1f}s" if sources else ""
    print(f"trainer: data order: {order}{idx}", file=sys.stderr)
    if len(specs) > 1 and sources:
        total = sum(d.weight for d in specs)
        parts = [
            f"{d.name} weight {d.weight / total:.3f} on_end={d.on_end} ({sum(ix.num_samples for ix in s.indexes)} "
            f"samples, {sum(int(ix.trained.sum()) for ix in s.indexes)} trained tokens on rank 0)"
            for d, s in zip(specs, sources)
        ]
        print(
            "trainer: mixture by share of trained tokens: " + "; ".join(parts) + "; an epoch ends when every "
            "dataset has been read through once",
            file=sys.stderr,
        )
    if max_steps:  # the run's length is --max-steps, whatever an epoch holds
        per = f"; predicted steps per epoch: {predicted[0]}" if predicted else ""
        print(f"trainer: run length: {plural(max_steps, 'step')} (--max-steps){per}", file=sys.stderr)
    elif predicted is not None:
        print(
            f"trainer: predicted steps per epoch: {', '.join(map(str, predicted))} (total {sum(predicted)})",
            file=sys.stderr,
        )


@dataclass
class EvalSet:
    """One held-out dataset: its name ('' for a single unnamed set) and this rank's loader over it."""

    name: str  # '' for a single unnamed eval set
    loader: StepLoader  # this rank's part, started afresh at every eval


def eval_loaders(
    options: DataOptions,
    plan: ReadPlan,
    data: RunData,
    *,
    batching: Batching,
    collate_spec: CollateSpec,
    model_type: str,
    eval_every: int,
) -> list[EvalSet]:
    """This rank's loader per eval set: whole shards planned over the ranks as for training (with fewer shards
    than ranks, every rank strides over all samples), read in manifest order, batched exactly as training. A set
    that holds videos runs the video pass in every micro-batch (the placeholder video where it has none), whether
    or not training does: the ranks' vision all-gathers then pair up in eval as in training."""
    out, spec, train_data, rank, world = [], data.image, data.datasets[0], plan.rank, data.world
    for i, d in enumerate(options.eval_sources):
        # the version open_data resolved, once for the run (a RunData made without them: resolved here)
        ds = data.eval_datasets[i] if i < len(data.eval_datasets) else resolve_data(d.path, option="--eval-data")
        if ds.processor and train_data.processor:  # a loss under another tokenizer or pixel math means nothing
            diff = processor_difference(train_data, ds, options.processor)
            if diff:
                raise ConfigError(
                    f"--eval-data {d.path} was built with another processor than --data "
                    f"({'; '.join(diff)}): rebuild it with the training data's --processor"
                )
        if batching.pack_to:
            check_packing(
                pack_to=batching.pack_to, pack_window=batching.pack_window, manifest=ds.manifest, model_type=model_type
            )
        videos = trains_videos([ds], model_type)  # from the manifest: the same on every rank
        if videos and spec.video is None:
            raise ConfigError(
                f"--eval-data {d.path} holds videos, but the training data's processor saved no video "
                "processor to make their pixel_values_videos: pass --processor with one"
            )
        shards_plan = plan_shards(ds.shards, world)
        shards = [ds.shards[i] for i in shards_plan.per_rank[rank]]
        signatures = check_local_shards(shards, ds, plan.check)  # sha256 before reading
        streams = ShardSequence(
            shards,
            spec=spec,
            seed=options.seed,
            shuffle_shards=False,
            stride=(rank, world) if shards_plan.stride else (0, 1),
            signatures=signatures,
        )
        loader = StepLoader(
            streams,
            collate_spec=dataclasses.replace(collate_spec, videos=videos),
            batching=batching,
            num_workers=options.num_workers,
            prefetch_factor=options.prefetch_factor,
        )
        out.append(EvalSet(d.name, loader))
        if rank == 0:
            print(
                f"trainer: eval set {d.name or d.path}: {plural(len(ds.shards), 'shard')} over "
                f"{plural(world, 'rank')}"
                f"{' (fewer shards than ranks: each rank strides over all samples)' if shards_plan.stride else ''}; "
                + (f"every {eval_every} steps and at the end" if eval_every else "at the end"),
                file=sys.stderr,
            )
    return out
