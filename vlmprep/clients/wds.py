"""webdataset adapter: one raw webdataset sample (member name -> bytes) -> a decoded vlmprep sample dict.

    wds.WebDataset(vlmprep.clients.wds.shard_urls(DIR), shardshuffle=False).map(vlmprep.clients.wds.decode)

Only vlmprep's own reader decodes (webdataset's default decoders would unpickle `.pyd` and torch.load `.pth`).
"""

from __future__ import annotations

from pathlib import Path

from vlmprep.shards.manifest import open_dataset, shard_paths
from vlmprep.shards.reader import sample_from_members
from vlmprep_schemas.tar_members import sample_version


def shard_urls(d: str | Path) -> list[str]:
    """A built dataset's shards in manifest order (the manifest's format_version checked)."""
    return [str(p) for p in shard_paths(*open_dataset(d))]  # DIR, DIR@vN or DIR@TAG


def decode(sample: dict) -> dict:
    """A webdataset sample -> `__key__`, `__url__`, `id`, the arrays (numpy: input_ids, loss_mask,
    mm_token_type_ids, position_ids, image_grid_thw, image_index; format v3: video_grid_thw, second_per_grid_ts),
    `images` (uint8 HxWx3, one per occurrence, in token order), `videos` (uint8 frames x H x W x 3, one per video, in
    token order) and `meta`. Member names are checked first; an unknown member is refused, never decoded."""
    members = {k: v for k, v in sample.items() if not k.startswith("__")}
    where = str(sample.get("__url__", "?"))
    out = sample_from_members(members, key=sample["__key__"], where=where, version=sample_version(members)).to_dict()
    out["__url__"] = where
    return out
