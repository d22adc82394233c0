"""What Megatron-Energon needs in a built dataset dir, written by `vlmprep build` without importing energon:
DIR/.nv-meta/dataset.yaml naming the sample type and loader of the installed vlmprep package
(vlmprep/clients/energon.py), so nothing is ever executed from the dataset dir.
"""

from __future__ import annotations

from pathlib import Path

from vlmprep.shards.dataset import NV_META, write_bytes_atomic
from vlmprep_schemas.boundary import state_dir

PREPARE_COMMAND = "energon prepare DIR --non-interactive --split-ratio 1,0,0 --skip-dataset-yaml --no-progress"
DATASET_YAML = f"""\
# Written by `vlmprep build`. Energon reads this dataset through vlmprep's own reader (installed package
# `vlmprep[energon]`; nothing is executed from this directory). Index it once, after the build:
#   {PREPARE_COMMAND}
# or in Python: vlmprep.clients.energon.prepare(DIR)
__module__: vlmprep.clients.energon
__class__: VlmprepWebdataset
sample_type:
  __module__: vlmprep.clients.energon
  __class__: VlmprepSample
"""
# Index files of an earlier `energon prepare` (and a version's split.v00000N.json): they describe the old tars, so a
# rebuild or an append drops them.
STALE_INDEX = (".info.yaml", ".info.json", "split.yaml", "index.sqlite", "index.uuid")


def write_energon_meta(out: Path) -> None:
    """Write DIR/.nv-meta/dataset.yaml atomically (same bytes every build) and drop a stale energon index."""
    meta = state_dir(Path(out) / NV_META)  # a link planted there: refused, nothing removed or written through it
    for p in [meta / n for n in STALE_INDEX] + list(meta.glob("split.v*.json")) + list(Path(out).glob("*.tar.idx")):
        p.unlink(missing_ok=True)
    write_bytes_atomic(meta / "dataset.yaml", DATASET_YAML.encode("ascii"))
