"""The run's datasets: --data (and --eval-data) specs -> each resolved (sources.py) and checked before anything is
loaded: videos the model can train, the model's family, one processor for a mixture, no empty dataset of a mixture,
eval sets that overlap training (a warning) -> RunData: the datasets, their shard plans over the ranks, the image
spec of their processor and the watch that stops the run if one changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, DataSpec
from trainer.data.decode import refuse_videos
from trainer.data.errors import DataError
from trainer.data.integrity import DatasetWatch
from trainer.data.pack import check_packing
from trainer.data.pins import data_pin, eval_pin
from trainer.data.processors import (
    check_processor,
    load_image_processor_config,
    load_processor_settings,
    load_video_processor_config,
    local_processor,
    processor_difference,
)
from trainer.data.sources import DataSource, ShardPlan, plan_shards, resolve_data
from trainer.data.vision import ImageSpec
from trainer.families import family_of_model, family_of_processor, packing_refusal, supported_models
from trainer.options import DataOptions
from vlmprep_schemas.terminal import for_terminal
from vlmprep_schemas.versions import is_rewrite


def plural(n: int, word: str) -> str:
    """`1 shard`, `2 shards`: what the start-up lines count."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def load_image_spec(options: DataOptions, processor: str | None) -> ImageSpec:
    """The pixel math of --processor, else of the first dataset's own processor (`processor`), checked first."""
    location = options.processor or processor
    if not location:
        raise ConfigError(
            f"--data {options.sources[0].path} has no manifest to find the processor: pass --processor DIR"
        )
    # No file linking out of a dataset's processor, no custom code in any (docs/untrusted-datasets.md).
    check_processor(location, user_named=bool(options.processor))
    try:
        return ImageSpec.from_config(
            load_image_processor_config(location),
            load_video_processor_config(location),
            load_processor_settings(location),
        )
    except ValueError as e:
        raise DataError(f"{location}: {e}") from None


def check_compatible(specs: tuple[DataSpec, ...], datasets: list[DataSource], processor: str) -> None:
    """Mixed datasets must come from one tokenizer vocabulary, model family and image processor."""
    for spec, ds in zip(specs[1:], datasets[1:]):
        diff = processor_difference(datasets[0], ds, processor)
        if diff:
            raise ConfigError(
                f"datasets {specs[0].name!r} ({specs[0].path}) and {spec.name!r} ({spec.path}) were "
                f"built with incompatible processors ({'; '.join(diff)}): a mixture needs one "
                "tokenizer vocabulary, model family and image processor; rebuild one of them with the "
                "other's --processor"
            )


def refuse_empty(specs: tuple[DataSpec, ...], datasets: list[DataSource]) -> None:
    """A dataset of a mixture with no samples could never get its weight's share (it would train at 0.0 in silence)."""
    total = sum(d.weight for d in specs)
    for spec, ds in zip(specs, datasets):
        if ds.counted and sum(s.num_samples for s in ds.shards) == 0:
            raise ConfigError(
                f"dataset {spec.name!r} ({spec.path}) holds 0 samples, so the mixture cannot give it "
                f"its weight {spec.weight / total:.3g} of the trained tokens: drop it from --data, or "
                "rebuild it (`vlmprep stats` shows why its records were rejected)"
            )


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
    world: int = 1  # the ranks the shards are planned over
    eval_datasets: tuple[DataSource, ...] = ()  # the eval sets, resolved once with the training data

    def versions(self) -> tuple[int | None, ...]:
        """The version each dataset is read at (None: shards named without a dataset, a pattern or pipe:)."""
        return tuple(ds.version.number if ds.version else None for ds in self.datasets)


def open_data(options: DataOptions, *, model_type: str, packing: bool, world: int, pins: dict | None = None) -> RunData:
    """The options' datasets (train, mixture and eval) -> RunData: each resolved once (local dir, pattern, URL; a
    dataset's version: `DIR@vN`, `DIR@TAG`, plain DIR the latest), its shards planned over `world` ranks, the image
    spec of the processor, and the watch that stops the run if a dataset changes. `pins`: RUN/run.json's record of the
    versions a resumed run read (pins.recorded_pins): those are read again, checked unchanged. Refuses (DataError /
    ConfigError) videos a model of `model_type` cannot train, data of another family, packing (`packing`) for a model
    that cannot pack, a mixture whose datasets do not fit together or are empty; eval sets that overlap training
    become warnings."""
    specs = options.sources
    datasets = [resolve_data(d.path, pinned=data_pin(pins, i, d)) for i, d in enumerate(specs)]
    for d, ds in zip(specs, datasets):
        refuse_videos(ds.manifest, str(d.path), model_type)
    warnings, held_sets = [], []
    for i, d in enumerate(options.eval_sources):
        held = resolve_data(d.path, option="--eval-data", pinned=eval_pin(pins, i, d))
        refuse_videos(held.manifest, f"--eval-data {d.path}", model_type)
        refuse_other_family(held.manifest, f"--eval-data {d.path}", model_type)
        warnings += eval_overlap(d, held, specs, datasets)
        held_sets.append(held)
    image = load_image_spec(options, datasets[0].processor)
    if len(specs) > 1:  # first: a mixture at odds with itself is the fault, whatever the model
        check_compatible(specs, datasets, options.processor)
    for d, ds in zip(specs, datasets):
        refuse_other_family(ds.manifest, f"--data {d.path}", model_type)
    if packing and packing_refusal(model_type):  # before the run dir is touched
        raise ConfigError(packing_refusal(model_type))
    if len(specs) > 1:
        refuse_empty(specs, datasets)
    label = options.data if isinstance(options.data, str) else ",".join(f"{d.name}={d.path}" for d in specs)
    return RunData(
        specs,
        datasets,
        [plan_shards(d.shards, world) for d in datasets],
        image,
        label,
        options.processor or datasets[0].processor or "",
        tuple(warnings),
        DatasetWatch(datasets),
        world,
        tuple(held_sets),
    )


def refuse_other_family(manifest: dict | None, where: str, model_type: str) -> None:
    """A model of a family the trainer does not train, or a dataset rendered for another family, is one line naming
    both, before anything is loaded. The family the manifest records (vlmprep's processor.family) decides where it
    is there: Qwen3-VL and Qwen3.5 data share a processor class; a dataset built before it was recorded is judged by
    its processor class."""
    family = family_of_model(model_type)
    if not model_type:  # no readable config.json: the model's own check says so (model_identity)
        return
    if family is None:
        raise ConfigError(f"model type {model_type!r} is not one this trainer trains (it trains {supported_models()})")
    saved = (manifest or {}).get("processor") or {}
    rendered, recorded = str(saved.get("class") or ""), saved.get("family")
    if isinstance(recorded, str) and recorded:
        name, mismatch = recorded, recorded != family.name
    else:
        other = family_of_processor(rendered)
        name, mismatch = other.name if other else "another family", rendered not in ("", *family.processor_classes)
    if mismatch:
        raise ConfigError(
            f"{where} was rendered with {rendered} ({name}), but the model is {family.name} ({model_type}): "
            "rebuild the data with this model's processor, or train the model of its family"
        )


def _shard_keys(ds: DataSource) -> dict[str, str]:
    """Each shard's identity -> its URL: the manifest's sha256 (a copy of a dataset is the same data), else the
    resolved path or URL."""
    sha = {s.get("name"): s.get("sha256") for s in (ds.manifest or {}).get("shards", []) if isinstance(s, dict)}
    return {
        sha.get(s.name)
        or (os.path.realpath(s.url) if "://" not in s.url and not s.url.startswith("pipe:") else s.url): s.url
        for s in ds.shards
    }


def eval_overlap(
    spec: DataSpec, held: DataSource, specs: tuple[DataSpec, ...], datasets: list[DataSource]
) -> list[str]:
    """A warning when an eval set shares shards with the training data: its loss is then no held-out loss. Not
    refused: the training data as eval data is a fair check of fit (docs/trainer.md)."""
    trained = {k for ds in datasets for k in _shard_keys(ds)}
    mine = _shard_keys(held)
    shared = [k for k in mine if k in trained]
    if not shared:
        return []
    which = ", ".join(d.path for d, ds in zip(specs, datasets) if set(_shard_keys(ds)) & set(shared))
    return [
        f"--eval-data {spec.path} shares {len(shared)} of its {len(mine)} shards with the training data ({which}): "
        "its eval loss is measured on trained samples, not held out; build the eval set from records kept out "
        "of the training data"
    ]


def log_plans(data: RunData) -> None:
    """Prints the run's warnings and each dataset's per-rank shard split to stderr (rank 0, at start)."""
    world = data.world
    for w in data.warnings:
        print(for_terminal(f"trainer: warning: {w}"), file=sys.stderr)  # a manifest's values in it: escaped
    for d, ds, p in zip(data.specs, data.datasets, data.plans):
        counts = ", ".join(
            f"rank {r}: {plural(len(s), 'shard')}" + (f" {plural(t, 'token')}" if ds.counted else "")
            for r, (s, t) in enumerate(zip(p.per_rank, p.rank_tokens))
        )
        if p.stride:
            counts = f"fewer shards than ranks: every rank reads all shards and decodes one sample in {world}"
        print(
            f"trainer: {f'{d.name}: ' if d.name else ''}{plural(len(ds.shards), 'shard')} over "
            f"{plural(world, 'rank')} ({counts}); "
            f"max/mean imbalance {p.imbalance:.3f}; remainder policy 'pad': ranks that run out first take empty "
            "micro-batches until all ranks are done, so no sample is dropped",
            file=sys.stderr,
        )


def processor_dir(data: RunData, owner: contextlib.ExitStack, *, model_type: str, tiny: bool) -> str | None:
    """The processor as a local dir, where the run loads it (a tiny model's vocabulary, `tiny`; a host family's
    placeholder image): the dataset's own or --processor, a URL's copied into a temp dir that `owner` removes at the
    end of the run; None where not needed."""
    needed = tiny or getattr(family_of_model(model_type), "pixels", "patchify") != "patchify"
    if not needed or not data.processor:
        return None
    tmp = Path(owner.enter_context(tempfile.TemporaryDirectory(prefix="vlmprep-processor-")))
    return local_processor(data.processor, tmp)


def reopen(data: RunData, pins: list[dict | None], *, model_type: str, pack_to: int) -> RunData:
    """`data` with each dataset that `pins` names a version of (pins.DatasetVersion.entry, or {version, sha256}) read
    at that version instead: a --follow run's newer version at an epoch boundary, or the version a resumed epoch was
    read at. Each is checked as a start-up checks it, and to be the same data as the version it replaces (one shard
    list extends the other, the same processor, no videos that were not there); its shards are planned over the
    ranks anew and the watch moves to its record."""
    datasets = list(data.datasets)
    for i, (spec, pin) in enumerate(zip(data.specs, pins)):
        old = datasets[i]
        if pin is None or old.version is None or pin["version"] == old.version.number:
            continue
        new = resolve_data(old.base, pinned={**pin, "name": spec.name}, option=_option(spec))
        refuse_other_family(new.manifest, str(spec.path), model_type)
        if pack_to:  # every version's seq_len must fit a row
            check_packing(pack_to=pack_to, pack_window=1, manifest=new.manifest, model_type=model_type)
        _refuse_other_data(spec, old, new)
        datasets[i] = new
    return dataclasses.replace(
        data,
        datasets=datasets,
        plans=[plan_shards(d.shards, data.world) for d in datasets],
        watch=DatasetWatch(datasets),
    )


def _option(spec: DataSpec) -> str:
    return f"--data {spec.name}:" if spec.name else "--data"


def rebuilt(a: DataSource, b: DataSource) -> bool:
    """Whether version b (later than a) may have replaced shards of a: b's record removed samples (vlmprep watch
    --on-change rebuild), or versions between them could have."""
    removed = ((b.manifest or {}).get("version") or {}).get("removed")
    return bool(removed) or b.version.number > a.version.number + 1


def replaced_samples(old: DataSource, new: DataSource) -> tuple[int, int]:
    """(samples new adds, samples of old it no longer holds): a rebuild's rewrites (shard-vN-r-*) hold kept samples."""
    before = {s.name for s in old.shards}
    added = sum(s.num_samples or 0 for s in new.shards if s.name not in before and not is_rewrite(s.name))
    held = sum(s.num_samples or 0 for s in old.shards)
    return added, held + added - sum(s.num_samples or 0 for s in new.shards)


def _listing(ds: DataSource) -> list:
    return [[s.name, s.num_bytes, s.sha256] for s in ds.shards]


def _refuse_other_data(spec: DataSpec, old: DataSource, new: DataSource) -> None:
    """Two versions of one dataset: the shard list of the earlier one is the start of the later one's (an append only
    adds shards), with the same processor and, where the run reads no videos, none added. A later version that
    replaced the samples of rebuilt inputs (its record's version.removed; or versions between the two, which the run
    did not read) lists the earlier one's shards it keeps in their order, each rewritten one at its place."""
    a, b = sorted((old, new), key=lambda d: d.version.number)
    where = f"{_option(spec)} {old.base}"
    la, lb = _listing(a), _listing(b)
    if rebuilt(a, b):
        names = {x[0] for x in lb}
        la = [x for x in la if x[0] in names]
        kept = {x[0] for x in la}
        lb = [y for y in lb if y[0] in kept]
    if lb[: len(la)] != la:
        raise DataError(
            f"{where}: version {b.version.number} ({b.version.record}) does not start with the shards of version "
            f"{a.version.number} (an append only adds shards): it is another dataset's record, or one that lies; "
            "the run stops rather than switch to other data"
        )
    fingerprint = [((d.manifest or {}).get("processor") or {}).get("fingerprint") for d in (a, b)]
    if fingerprint[0] != fingerprint[1]:
        raise DataError(
            f"{where}: version {b.version.number} was rendered with another processor than version "
            f"{a.version.number} (fingerprint {str(fingerprint[0])[:12]} vs {str(fingerprint[1])[:12]}); the run "
            "stops rather than train on samples of another tokenizer or pixel math"
        )
    videos = [((d.manifest or {}).get("totals") or {}).get("videos", 0) for d in (old, new)]
    if videos[1] and not videos[0]:
        raise DataError(
            f"{where}: version {new.version.number} holds {videos[1]} videos, version {old.version.number} none: "
            "the run was set up without a video pass; start a run on the new version"
        )
