"""The run's training data: --data specs -> resolved datasets checked to share one processor (RunData) -> each
rank's shard plan and indexed sources -> its StepLoader and the run's length in steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config import ConfigError, DataSpec, TrainConfig, cache_limit_bytes
from trainer.data.batches import StepLoader
from trainer.data.cache import ShardCache, remote_shards
from trainer.data.collate import CollateSpec
from trainer.data.decode import refuse_videos, trains_videos
from trainer.data.errors import DataError
from trainer.data.integrity import RECORD, DatasetWatch, ShardCheck, checked_indexes
from trainer.data.order import RankSource
from trainer.data.processors import (
    check_processor,
    load_image_processor_config,
    load_video_processor_config,
    local_processor,
    processor_difference,
)
from trainer.data.sources import REMOTE_OR_PIPE, DataSource, ShardPlan, plan_shards, resolve_data
from trainer.data.steps import predict_steps, steps_per_epoch
from trainer.data.streams import EpochSchedule, ShardSequence
from trainer.data.vision import ImageSpec, host_pixels
from trainer.families import Family, family_of_model, family_of_processor, packing_refusal, supported_models
from trainer.metrics import plural
from trainer.model import image_token_id, model_family, model_type_of, pad_token_id, video_token_id
from trainer.options import Batching


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


def refuse_empty(specs: tuple[DataSpec, ...], datasets: list[DataSource]) -> None:
    """A dataset of a mixture with no samples could never get its weight's share (it would train at 0.0 in silence)."""
    total = sum(d.weight for d in specs)
    for spec, ds in zip(specs, datasets):
        if ds.counted and sum(s.num_samples for s in ds.shards) == 0:
            raise ConfigError(f"dataset {spec.name!r} ({spec.path}) holds 0 samples, so the mixture cannot give it "
                              f"its weight {spec.weight / total:.3g} of the trained tokens: drop it from --data, or "
                              "rebuild it (`vlmprep stats` shows why its records were rejected)")


def rank_sources(specs: tuple[DataSpec, ...], datasets: list[DataSource], plans: list[ShardPlan], *, rank: int,
                 world: int, cache: Path, check: ShardCheck | None = None) -> tuple[list[RankSource], int]:
    """Each source's shards as this rank reads them, with their sample indexes (trainer/data/index.py: the build's
    dataset index or sidecars, remote ones fetched into `cache`), and how many shards had none (indexed from their
    tars). Local shards are checked against their manifest's sha256 first (by `check`; none: stats only); where
    every rank reads every shard (fewer shards than ranks), rank r hashes shards r, r + world, ... Remote shards are
    checked by the shard cache as it fetches them."""
    check = check or ShardCheck(None, enabled=False)
    total = sum(d.weight for d in specs)
    out, derived = [], 0
    for spec, ds, plan in zip(specs, datasets, plans):
        shards = ds.shards if plan.stride else tuple(ds.shards[i] for i in plan.per_rank[rank])
        hashed = {s.url for k, s in enumerate(shards) if not plan.stride or k % world == rank}
        # the manifest's sha256 of the rank's own shards (ShardRef.sha256), not a dict of the dataset's
        indexes = checked_indexes(shards, ds, cache=cache, check=check, want=lambda s, hashed=hashed:
                                  s.sha256 if s.url in hashed else None)
        derived += 0 if ds.index is not None else sum(s.index is None for s in shards)
        out.append(RankSource(spec.name, spec.weight / total, spec.on_end, shards, indexes,
                              (rank, world) if plan.stride else (0, 1), -1 if plan.stride else rank))
    return out, derived


def fit_span(cfg: TrainConfig, data: "RunData", world: int) -> TrainConfig:
    """Under --shard-cache-limit, the sample shuffle of remote data mixes blocks of shards that fit the cache: each
    rank's share of the limit (the node's limit over its LOCAL_WORLD_SIZE ranks) holds, per dataset, the block being
    read and the next one being fetched. Returns cfg with that --shuffle-span when it was 0 (written to config.toml
    and compared on resume); refuses a limit below one shard per dataset, or a span given that cannot fit."""
    remote = any(s.url.startswith(REMOTE_OR_PIPE) for d in data.datasets for s in d.shards)
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


@dataclass(frozen=True)
class RunData:
    """The run's datasets, resolved: their specs, shard lists and rank plans, and the image processor they share."""

    specs: tuple[DataSpec, ...]
    datasets: list[DataSource]
    plans: list[ShardPlan]
    image: ImageSpec
    label: str  # how run.json and messages name the data
    processor: str = ""  # where the processor the shards were rendered with is (--processor, else the dataset's)
    warnings: tuple[str, ...] = ()  # printed by rank 0 with the start-up lines
    watch: DatasetWatch | None = None  # the local datasets' manifests, checked every step


def open_data(cfg: TrainConfig, world: int) -> RunData:
    """The config's datasets (train, mixture and eval) -> RunData: each resolved (local dir, pattern, URL), its
    shards planned over `world` ranks, the image spec of the processor, and the watch that stops the run if a dataset
    changes. Refuses (DataError / ConfigError) videos a model cannot train, a mixture whose datasets do not fit
    together or are empty; eval sets that overlap training become warnings."""
    specs = cfg.sources
    datasets = [resolve_data(d.path) for d in specs]
    model_type = model_type_of(model=cfg.model, tiny_random=cfg.tiny_random)
    for d, ds in zip(specs, datasets):
        refuse_videos(ds.manifest, str(d.path), model_type)
    warnings = []
    for d in cfg.eval_sources:
        held = resolve_data(d.path, option="--eval-data")
        refuse_videos(held.manifest, f"--eval-data {d.path}", model_type)
        warnings += eval_overlap(d, held, specs, datasets)
    image = _load_image_spec(cfg, datasets[0].processor)
    if len(specs) > 1:  # first: a mixture at odds with itself is the fault, whatever the model
        check_compatible(specs, datasets, cfg.processor)
    for d, ds in zip(specs, datasets):
        refuse_other_family(ds.manifest, str(d.path), model_type)
    if cfg.pack_to and packing_refusal(model_type):  # before the run dir is touched
        raise ConfigError(packing_refusal(model_type))
    if len(specs) > 1:
        refuse_empty(specs, datasets)
    label = cfg.data if isinstance(cfg.data, str) else ",".join(f"{d.name}={d.path}" for d in specs)
    return RunData(specs, datasets, [plan_shards(d.shards, world) for d in datasets], image, label,
                   cfg.processor or datasets[0].processor or "", tuple(warnings), DatasetWatch(datasets))


def refuse_other_family(manifest: dict | None, where: str, model_type: str) -> None:
    """A model of a family the trainer does not train, or a dataset rendered with another family's processor, is one
    line naming both, before anything is loaded."""
    family = family_of_model(model_type)
    if not model_type:  # no readable config.json: the model's own check says so (model_identity)
        return
    if family is None:
        raise ConfigError(f"model type {model_type!r} is not one this trainer trains (it trains {supported_models()})")
    rendered = str(((manifest or {}).get("processor") or {}).get("class") or "")
    if rendered and rendered not in family.processor_classes:
        other = family_of_processor(rendered)
        raise ConfigError(f"--data {where} was rendered with {rendered} ({other.name if other else 'another family'}), "
                          f"but the model is {family.name} ({model_type}, trained from "
                          f"{' or '.join(family.processor_classes)} datasets): rebuild the data with this model's "
                          "processor, or train the model of its family")


def _shard_keys(ds: DataSource) -> dict[str, str]:
    """Each shard's identity -> its URL: the manifest's sha256 (a copy of a dataset is the same data), else the
    resolved path or URL."""
    sha = {s.get("name"): s.get("sha256") for s in (ds.manifest or {}).get("shards", []) if isinstance(s, dict)}
    return {sha.get(s.name) or (os.path.realpath(s.url) if "://" not in s.url and not s.url.startswith("pipe:")
                                else s.url): s.url for s in ds.shards}


def eval_overlap(spec: DataSpec, held: DataSource, specs: tuple[DataSpec, ...],
                 datasets: list[DataSource]) -> list[str]:
    """A warning when an eval set shares shards with the training data: its loss is then no held-out loss. Not
    refused: the training data as eval data is a fair check of fit (docs/trainer.md)."""
    trained = {k for ds in datasets for k in _shard_keys(ds)}
    mine = _shard_keys(held)
    shared = [k for k in mine if k in trained]
    if not shared:
        return []
    which = ", ".join(d.path for d, ds in zip(specs, datasets) if set(_shard_keys(ds)) & set(shared))
    return [f"--eval-data {spec.path} shares {len(shared)} of its {len(mine)} shards with the training data ({which}): "
            "its eval loss is measured on trained samples, not held out; build the eval set from records kept out "
            "of the training data"]


def log_plans(data: RunData, world: int) -> None:
    """Prints the run's warnings and each dataset's per-rank shard split to stderr (rank 0, at start)."""
    for w in data.warnings:
        print(f"trainer: warning: {w}", file=sys.stderr)
    for d, ds, p in zip(data.specs, data.datasets, data.plans):
        counts = ", ".join(f"rank {r}: {plural(len(s), 'shard')}" + (f" {plural(t, 'token')}" if ds.counted else "")
                           for r, (s, t) in enumerate(zip(p.per_rank, p.rank_tokens)))
        if p.stride:
            counts = f"fewer shards than ranks: every rank reads all shards and decodes one sample in {world}"
        print(f"trainer: {f'{d.name}: ' if d.name else ''}{plural(len(ds.shards), 'shard')} over "
              f"{plural(world, 'rank')} ({counts}); "
              f"max/mean imbalance {p.imbalance:.3f}; remainder policy 'pad': ranks that run out first take empty "
              "micro-batches until all ranks are done, so no sample is dropped", file=sys.stderr)


def shard_check(cfg: TrainConfig, out: Path, rank: int) -> ShardCheck:
    """This rank's sha256 checks of the shards it reads, remembered in its shard cache dir (integrity.py)."""
    return ShardCheck(Path(cfg.shard_cache or out / "shard-cache") / f"rank-{rank:05d}" / RECORD,
                      enabled=cfg.verify_shards)


def make_loader(cfg: TrainConfig, data: RunData, *, rank: int, world: int, device: torch.device,
                collate_spec: CollateSpec, out: Path, check: ShardCheck) -> tuple[StepLoader, int | None, int]:
    """The rank's step loader, the run's total steps (None: until the data ends) and the LR schedule's length.
    The epoch schedule (order.py) reads samples by random access: sample shuffle, mixtures. Without them the
    shards stream in sequence as before (any URL, no copy); local shards are indexed anyway so the step count of a
    token budget or packing run is known up front."""
    scheduled = cfg.shuffle or len(data.specs) > 1
    local = not any(s.url.startswith(REMOTE_OR_PIPE) for d in data.datasets for s in d.shards)
    sources, index_s, derived, cache = None, 0.0, 0, None
    root = Path(cfg.shard_cache or out / "shard-cache") / f"rank-{rank:05d}"
    if scheduled or local:
        t0 = time.perf_counter()
        # A scheduled run reads its local shards through the shard cache's gate, which hashes each one ahead of the
        # readers: step 1 waits for its own shards' hashes, not the rank's whole share's.
        check.deferring = scheduled
        try:
            sources, derived = rank_sources(data.specs, data.datasets, data.plans, rank=rank, world=world,
                                            cache=root, check=check)
        finally:
            check.deferring = False
        index_s = time.perf_counter() - t0
    check.save()  # what this rank hashed (eval sets too): a resume does not hash it again
    if scheduled and (remote_shards(sources) or check.deferred):
        limit = cache_limit_bytes(cfg.shard_cache_limit) // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
        cache = ShardCache(sources, root, limit=limit, prefetch=cfg.shard_prefetch, check=check)
    plan = data.plans[0]
    predicted, first = predict_steps(cfg, sources, device) if sources is not None else (None, None)
    if predicted is None:
        per_epoch = steps_per_epoch(list(plan.rank_samples), Batching.of(cfg))
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
        if check.deferred:
            print(f"trainer: {len(check.deferred)} local shard(s) on rank 0 not yet hashed by this run dir are checked "
                  "against the manifest's sha256 as the run first reaches them (ahead of the readers, in read "
                  "order; a mismatch stops the run naming the shard), not all before step 1", file=sys.stderr)
        if cache is not None and remote_shards(sources):
            print(f"trainer: remote shards stream through {root.parent} ("
                  + (f"at most {cfg.shard_cache_limit} per node, " if cfg.shard_cache_limit else "no size limit, ")
                  + f"{cfg.shard_prefetch} shards fetched ahead, each checked against the manifest's sha256)",
                  file=sys.stderr)
    if scheduled:
        streams = EpochSchedule(sources, spec=data.image, seed=cfg.seed, shuffle=cfg.shuffle,
                                shuffle_shards=cfg.shuffle_shards, shuffle_span=cfg.shuffle_span, first=first,
                                cache=cache)
    else:
        signatures = {s.url: ix.signature for src in sources or [] for s, ix in zip(src.shards, src.indexes)}
        streams = ShardSequence([data.datasets[0].shards[i] for i in plan.per_rank[rank]], spec=data.image,
                                seed=cfg.seed, shuffle_shards=cfg.shuffle_shards,
                                stride=(rank, world) if plan.stride else (0, 1), signatures=signatures)
    loader = StepLoader(streams, collate_spec=collate_spec, batching=Batching.of(cfg), num_workers=cfg.num_workers,
                        prefetch_factor=cfg.prefetch_factor)
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
    if cfg.max_steps:  # the run's length is --max-steps, whatever an epoch holds
        per = f"; predicted steps per epoch: {predicted[0]}" if predicted else ""
        print(f"trainer: run length: {plural(cfg.max_steps, 'step')} (--max-steps){per}", file=sys.stderr)
    elif predicted is not None:
        print(f"trainer: predicted steps per epoch: {', '.join(map(str, predicted))} (total {sum(predicted)})",
              file=sys.stderr)


def processor_dir(cfg: TrainConfig, data: RunData, family: Family | None, owner: contextlib.ExitStack) -> str | None:
    """The processor as a local dir, where the run loads it (a tiny model's vocabulary, a host family's placeholder
    image): the dataset's own or --processor, a URL's copied into a temp dir for the run; None where not needed."""
    model_type = family.model_types[0] if family else model_type_of(model=cfg.model, tiny_random=cfg.tiny_random)
    needed = family is not None or getattr(family_of_model(model_type), "pixels", "") == "processor"
    if not needed or not data.processor:
        return None
    tmp = Path(owner.enter_context(tempfile.TemporaryDirectory(prefix="vlmprep-processor-")))
    return local_processor(data.processor, tmp)


def collate_spec_of(net: torch.nn.Module, data: RunData, processor: str | None) -> CollateSpec:
    """What collate needs from the model and the processor: pad and placeholder ids, patch and merge size, whether
    the run trains video, and for a family whose pixels the host makes, its pixel maker and placeholder tokens."""
    spec, family = data.image, model_family(net)
    base = CollateSpec(pad_id=pad_token_id(net), image_token_id=image_token_id(net),
                       patch_size=spec.patch_size, merge_size=spec.merge_size, video_token_id=video_token_id(net),
                       videos=trains_videos(data.datasets, str(net.config.model_type)))
    if family.pixels != "processor":
        return base
    if processor is None:
        raise ConfigError(f"{family.name} needs its processor to make pixel inputs: pass --processor DIR")
    host, placeholder, size = host_pixels(family, processor, spec, image_token_id(net))
    return dataclasses.replace(base, host=host, placeholder=placeholder, placeholder_size=size)
