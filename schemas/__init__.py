"""The shard-format contract shared by vlmprep and the trainer (which never import each other): JSON Schemas for
the input record, the sample meta, the manifest and the member-name rule. Installed as the `vlmprep_schemas` package.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files

NAMES = ("record.schema.json", "sample_meta.schema.json", "manifest.schema.json", "shard_format.schema.json")


@cache
def load(name: str) -> dict:
    """One schema as a dict (cached: callers must not mutate it)."""
    if name not in NAMES:
        raise ValueError(f"unknown schema {name!r}: one of {', '.join(NAMES)}")
    return json.loads(files(__name__).joinpath(name).read_text(encoding="utf-8"))
