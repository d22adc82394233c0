"""HF `datasets` adapter: a built dataset dir -> a `datasets.IterableDataset` over vlmprep's own reader.

    ds = vlmprep.clients.hf.iterable_dataset(DIR)

Examples hold numpy arrays, `images` (uint8 HxWx3, one per occurrence, in token order) and `videos` (uint8
frames x H x W x 3, one per video, in token order); shards are the generator's shard list, so
`split_dataset_by_node` and DataLoader workers split by shard.
"""

from __future__ import annotations

from pathlib import Path

from vlmprep.shards.manifest import open_dataset, shard_paths
from vlmprep.shards.reader import iter_shard


def generate_samples(shards: list[str], version: int):
    """The generator behind iterable_dataset: every sample of `shards`, decoded (StoredSample.to_dict)."""
    for path in shards:
        for sample in iter_shard(Path(path), version=version):
            yield sample.to_dict()


def iterable_dataset(d: str | Path):
    """Every sample of a built dataset dir as a streaming `datasets.IterableDataset` (manifest version checked)."""
    import datasets

    d, manifest = open_dataset(d)  # DIR, DIR@vN or DIR@TAG
    shards = [str(p) for p in shard_paths(d, manifest)]
    return datasets.IterableDataset.from_generator(
        generate_samples, gen_kwargs={"shards": shards, "version": manifest.format_version}
    )
