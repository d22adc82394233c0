"""Megatron-Energon adapter: the sample type and loader that DIR/.nv-meta/dataset.yaml (written by the build,
vlmprep/clients/energon_meta.py) names. Raw tar members -> vlmprep's reader -> VlmprepSample; energon's own
decoder is never applied, so nothing is unpickled, and a member outside the format is refused. VlmprepTaskEncoder
batches VlmprepSamples with vlmprep's Collator: the dict an HF model takes.
"""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
from megatron.energon import DefaultTaskEncoder, Sample, StandardWebdatasetFactory, stateless
from megatron.energon.edataclass import edataclass
from megatron.energon.flavors import BaseWebdatasetFactory

from vlmprep.clients.collate import Collator
from vlmprep.clients.energon_meta import write_energon_meta
from vlmprep.shards.dataset import MANIFEST_NAME, NV_META, write_bytes_atomic
from vlmprep.shards.manifest import ShardFormatError, dataset_path, load_manifest, open_dataset
from vlmprep.shards.reader import sample_from_members
from vlmprep.shards.versions import manifest_number
from vlmprep_schemas.boundary import is_plain_path
from vlmprep_schemas.tar_members import sample_version
from vlmprep_schemas.versions import split_ref

_SPLIT = re.compile(r"^split\.v([0-9]{6,})\.json$")  # a version's split config, written by prepare(DIR@vN)


@edataclass
class VlmprepSample(Sample):
    """One vlmprep sample: numpy arrays as stored, `images` uint8 HxWx3 per occurrence in token order, `videos`
    uint8 frames x H x W x 3 per video in token order."""

    id: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L], 1 = trained
    mm_token_type_ids: np.ndarray  # uint8 [L], 1 = image placeholder
    position_ids: np.ndarray  # int32 [3, L]
    image_grid_thw: np.ndarray  # int32 [N, 3], one row per occurrence
    image_index: np.ndarray  # int64 [N], occurrence -> stored image imgNNN
    images: list  # N x uint8 HxWx3
    video_grid_thw: np.ndarray  # int32 [V, 3], one row per video (empty before format v3)
    second_per_grid_ts: np.ndarray  # float32 [V], seconds per temporal patch (empty before format v3)
    videos: list  # V x uint8 frames x H x W x 3, the stored (sampled, resized) frames
    meta: dict


_FIELDS = tuple(
    f.name for f in dataclasses.fields(VlmprepSample) if f.name not in {f.name for f in dataclasses.fields(Sample)}
)


def sample_loader(raw: dict) -> dict:
    """energon's raw sample (member name -> bytes, plus `__key__`, `__shard__`, ...) -> VlmprepSample fields."""
    members = {k: v for k, v in raw.items() if not k.startswith("__")}
    d = sample_from_members(
        members, key=raw["__key__"], where=str(raw.get("__shard__", "?")), version=sample_version(members)
    ).to_dict()
    d.setdefault("video_grid_thw", np.zeros((0, 3), np.int32))  # format v1/v2 store no video arrays
    d.setdefault("second_per_grid_ts", np.zeros(0, np.float32))
    return {name: d[name] for name in _FIELDS}


def part_filter(part: str) -> bool:
    """Every member reaches sample_loader, so one outside the format is refused there, loudly, not dropped."""
    return True


class VlmprepWebdataset(StandardWebdatasetFactory):
    """The dataset factory dataset.yaml names: energon's standard webdataset with vlmprep's loader and no decoder."""

    # No `from __future__ import annotations` here: energon reads this signature's annotations as objects.
    def __init__(self, path, *, sample_type: type[VlmprepSample] = VlmprepSample, **kwargs):
        kwargs.pop("decoder", None)  # the task encoder's decoder (webdataset-style, may unpickle): never used here
        super().__init__(
            path, sample_type=sample_type, sample_loader=sample_loader, part_filter=part_filter, decoder=None, **kwargs
        )
        check_indexed_shards(self.path, [s.name for s in self.shards], kwargs.get("split_config"))


def check_indexed_shards(path, names: list[str], split: str | None = None) -> None:
    """energon reads the shards its index (.nv-meta/) names, and joins an absolute or `../` name as given. A local
    dataset: each must be a shard its manifest lists (load_manifest checks those stay inside it), or, read through a
    version's split config (`split.v000003.json`, written by prepare), that version's record; a remote one (no
    manifest read here): each a plain relative name. Else one line."""
    try:
        d = path.local_path() if hasattr(path, "local_path") else Path(path)
    except ValueError:  # an msc:// dataset
        d = None
    listed = {s.name for s in load_manifest(d).shards} if d is not None else None
    version = _SPLIT.match(split or "")
    if listed is not None and version:
        listed |= {s.name for s in open_dataset(f"{d}@v{int(version.group(1))}")[1].shards}
    stray = [n for n in names if (n not in listed if listed is not None else not is_plain_path(n))]
    if stray:
        raise ShardFormatError(
            f"{path}/{NV_META}: the energon index names shard {stray[0]!r}, which "
            + (f"{d / MANIFEST_NAME} does not list" if d is not None else "is not a plain name")
            + "; refusing to read it: index the dataset again with "
            "vlmprep.clients.energon.prepare(DIR)"
        )


class VlmprepTaskEncoder(DefaultTaskEncoder):
    """A task encoder whose `batch` is vlmprep's Collator: `get_train_dataset(DIR, batch_size=B, task_encoder=
    VlmprepTaskEncoder(DIR, trained_logits=True), ...)` yields the dict an HF model takes (`model(**batch).loss`),
    not lists of arrays. Keywords go to `Collator` (trained_logits: logits only where the next token is trained)."""

    decoder = None  # samples come from vlmprep's reader; energon's webdataset decoder (may unpickle) is never used

    def __init__(self, path: str | Path, **collator_kwargs):
        super().__init__()
        self.collator = Collator(path, **collator_kwargs)

    @stateless  # the same samples give the same batch: nothing to save in a loader checkpoint
    def batch(self, samples: list[VlmprepSample]) -> dict:
        """Energon samples -> the HF batch dict that vlmprep's Collator makes of them."""
        return self.collator([{name: getattr(s, name) for name in _FIELDS} for s in samples])


def split_config(d: str | Path) -> str:
    """The energon split config that reads version `d` (DIR@vN or DIR@TAG) of a dataset: `split.v00000N.json`
    (written by prepare(d)); plain DIR: `split.yaml`, the latest. Pass it as get_train_dataset's `split_config`."""
    _, ref = split_ref(str(d))
    return "split.yaml" if ref is None else f"split.v{manifest_number(open_dataset(d)[1]):06d}.json"


def prepare(d: str | Path, *, workers: int = 1) -> int:
    """What `energon prepare DIR --split-ratio 1,0,0 --skip-dataset-yaml` does: index the manifest's shards, all in
    the train split (split.yaml), after writing vlmprep's own DIR/.nv-meta/dataset.yaml (energon imports the class
    that file names: a dataset from elsewhere may name any). A version, `DIR@vN` or `DIR@TAG`: its shards are indexed
    with the latest's, and its own split config, split_config(d), lists them (split.yaml still the latest's). Returns
    the sample count of what `d` names (the manifest's, when the shards are intact)."""
    base, ref = split_ref(str(d))
    base = Path(base)
    latest = load_manifest(base)  # every shard name checked to stay inside the dataset
    manifest = open_dataset(d)[1] if ref is not None else latest
    dataset_path(base, NV_META)  # energon writes its index there: not through a symlink out of the dataset
    write_energon_meta(base)
    names = [s.name for s in latest.shards]
    extra = [s.name for s in manifest.shards if s.name not in set(names)]
    BaseWebdatasetFactory.prepare_dataset(
        base,
        names + extra,
        split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)],
        shuffle_seed=None,
        workers=workers,
    )
    counts = json.loads((base / NV_META / ".info.json").read_text())["shard_counts"]
    if ref is not None:
        _write_split(base, f"split.v{manifest_number(manifest):06d}.json", [s.name for s in manifest.shards])
        if extra:  # energon's split.yaml lists every shard indexed: the latest's alone, as plain DIR reads it
            _write_split(base, "split.yaml", names)
    return sum(counts[s.name] for s in manifest.shards)


def _write_split(d: Path, name: str, shards: list[str]) -> None:
    """An energon split config (.nv-meta/NAME): these shards, all in the train split."""
    split = {"split_parts": {"train": shards, "val": [], "test": []}, "exclude": []}
    write_bytes_atomic(d / NV_META / name, json.dumps(split, indent=1).encode())  # JSON reads as YAML too
