"""Megatron-Energon adapter: the sample type and loader that DIR/.nv-meta/dataset.yaml (written by the build,
vlmprep/clients/energon_meta.py) names. Raw tar members -> vlmprep's reader -> VlmprepSample; energon's own
decoder is never applied, so nothing is unpickled, and a member outside the format is refused. VlmprepTaskEncoder
batches VlmprepSamples with vlmprep's Collator: the dict an HF model takes.
"""
import dataclasses
import json
from pathlib import Path

import numpy as np
from megatron.energon import DefaultTaskEncoder, Sample, StandardWebdatasetFactory, stateless
from megatron.energon.edataclass import edataclass
from megatron.energon.flavors import BaseWebdatasetFactory

from vlmprep.clients import sample_version
from vlmprep.clients.collate import Collator
from vlmprep.shards.dataset import NV_META
from vlmprep.shards.reader import load_manifest, sample_from_members


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


_FIELDS = tuple(f.name for f in dataclasses.fields(VlmprepSample) if f.name not in
                {f.name for f in dataclasses.fields(Sample)})


def sample_loader(raw: dict) -> dict:
    """energon's raw sample (member name -> bytes, plus `__key__`, `__shard__`, ...) -> VlmprepSample fields."""
    members = {k: v for k, v in raw.items() if not k.startswith("__")}
    d = sample_from_members(members, key=raw["__key__"], where=str(raw.get("__shard__", "?")),
                            version=sample_version(members)).to_dict()
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
        super().__init__(path, sample_type=sample_type, sample_loader=sample_loader, part_filter=part_filter,
                         decoder=None, **kwargs)


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
        return self.collator([{name: getattr(s, name) for name in _FIELDS} for s in samples])


def prepare(d: str | Path, *, workers: int = 1) -> int:
    """What `energon prepare DIR --split-ratio 1,0,0 --skip-dataset-yaml` does: index the manifest's shards, all in
    the train split. Returns the sample count energon indexed (the manifest's, when the shards are intact)."""
    d = Path(d)
    manifest = load_manifest(d)
    names = [s["name"] for s in manifest["shards"]]
    BaseWebdatasetFactory.prepare_dataset(d, names, split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)],
                                          shuffle_seed=None, workers=workers)
    return sum(json.loads((d / NV_META / ".info.json").read_text())["shard_counts"].values())
