"""Sources: a --data URL (dataset dir, shard pattern, object-store or http(s) URL, pipe: commands) -> the dataset's
shard list, with its manifest's counts, sha256 and sample indexes where it has one (checked against the schema and
its format_version) -> a token-balanced shard-to-rank plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from pathlib import Path

import braceexpand

from trainer.data.errors import DataError
from trainer.data.pins import DatasetVersion, read_version
from trainer.data.storage import StorageError, read_url
from vlmprep_schemas import load
from vlmprep_schemas.boundary import (
    MANIFEST_NAME,
    REMOTE,
    UnsafeDataset,
    dataset_paths,
    refuse_credentials,
)
from vlmprep_schemas.limits import LIMITS, load_json, schema_problem
from vlmprep_schemas.versions import VersionError, read_plain_file, split_ref

READABLE_VERSIONS = tuple(load("shard_format.schema.json")["readable_versions"])
# Shard URLs that are not local files: streamed once, or read from the rank's shard cache
REMOTE_OR_PIPE = ("pipe:",) + REMOTE


@dataclass(frozen=True)
class IndexRef:
    """A shard's sample index sidecar as the manifest lists it (shard_format.schema.json sample_index)."""

    url: str
    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardRef:
    """One shard of a dataset: where to read it and, from the manifest where there is one, its counts."""

    url: str
    name: str
    num_samples: int | None = None  # from the manifest; None when the source has none
    num_tokens: int | None = None
    num_bytes: int | None = None
    sha256: str | None = None
    index: IndexRef | None = None  # None: an older build's shard, indexed from its tar headers and metas
    row: int | None = None  # where its rows start in the dataset's sample index (DataSource.index), where listed


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset: its shards in manifest order, its saved processor, and its manifest (None for a bare URL)."""

    shards: tuple[ShardRef, ...]
    processor: str | None  # local dir or URL of the dataset's saved processor
    manifest: dict | None
    index: IndexRef | None = None  # the dataset's sample index: every shard's rows in one file (manifest order)
    index_rows: int = 0  # the rows it holds: the samples of every shard the manifest lists
    base: str = ""  # the dataset dir or base URL ('' for shards named without one)
    version: DatasetVersion | None = None  # the version of a dataset dir or URL read (its record and sha256)

    @property
    def counted(self) -> bool:
        """True when every shard's sample count is known (from a manifest), so steps are known up front."""
        return all(s.num_samples is not None for s in self.shards)


def read_dataset_file(url: str, limit: int = LIMITS.manifest_bytes) -> bytes:
    """A small file of a dataset (a processor config, its tokenizer), refused when over `limit` bytes or (local) when
    not a plain file; OSError (FileNotFoundError) where a local one cannot be opened."""
    if url.startswith(REMOTE):
        try:
            data = read_url(url, limit)
        except StorageError as e:
            raise DataError(str(e)) from None
        if len(data) > limit:
            raise DataError(f"{url} is more than {limit} bytes, more than a reader accepts")
        return data
    try:  # a FIFO planted at its name is refused, never waited on
        return read_plain_file(url, limit)
    except (UnsafeDataset, ValueError) as e:
        raise DataError(str(e)) from None


def _load_manifest(base: str, *, option: str = "--data", ref: str | None = None, pinned: dict | None = None):
    """The manifest of the version `ref` names (None: the latest) of the dataset at `base`, checked (its
    format_version, the schema), and that version (pins.read_version: `pinned`, a resumed run's record of it)."""
    url = join_url(base, MANIFEST_NAME)
    try:
        found = read_version(base, ref, option=option, pinned=pinned)
    except DataError as e:  # its own line names the URL
        raise DataError(str(e) if str(e).startswith(("cannot ", option)) else f"cannot read {url}: {e}") from None
    if found is None:
        raise DataError(f"cannot read {url}: no such file (not a finished vlmprep build: run `vlmprep build` first)")
    version, data = found
    url = join_url(base, version.record)
    try:
        manifest = load_json(data, "it", LIMITS.manifest_bytes)
    except ValueError as e:
        raise DataError(f"cannot read {url}: {e}") from None
    fmt = manifest.get("format_version") if isinstance(manifest, dict) else None
    if fmt not in READABLE_VERSIONS:
        raise DataError(
            f"{url}: format_version {fmt!r} is not supported by this trainer (it reads "
            f"format_version {', '.join(map(str, READABLE_VERSIONS))}); rebuild the shards or upgrade "
            "the trainer"
        )
    problem = schema_problem(manifest, "manifest.schema.json")
    if problem:
        raise DataError(f"{url} does not match the manifest schema: {problem}")
    return manifest, version


def join_url(base: str, name: str) -> str:
    """`name` inside the dataset dir or base URL `base`."""
    return base.rstrip("/") + "/" + name if base.startswith(REMOTE) else str(Path(base) / name)


def _from_manifest(
    base: str, manifest: dict, only: list[str] | None = None, version: DatasetVersion | None = None
) -> DataSource:
    where = join_url(base, version.record if version else MANIFEST_NAME)
    try:  # every path the manifest names stays inside the dataset, its processor asks for no custom code
        paths = dataset_paths(base, manifest, where=where)
    except UnsafeDataset as e:
        raise DataError(str(e)) from None
    rows, row = {}, 0
    for s in manifest["shards"]:
        rows[s["name"]] = row
        row += int(s["num_samples"])
    whole = manifest.get("sample_index")
    index = IndexRef(paths.sample_index, int(whole["bytes"]), str(whole["sha256"])) if whole else None
    by_name = {s["name"]: (s, url, ix) for s, url, ix in zip(manifest["shards"], paths.shards, paths.indexes)}
    names = only if only is not None else [s["name"] for s in manifest["shards"]]
    shards = []
    for name in names:
        if name not in by_name:
            raise DataError(f"{join_url(base, name)} is not listed in {where}")
        s, url, ix = by_name[name]
        shards.append(
            ShardRef(
                url,
                name,
                int(s["num_samples"]),
                int(s["num_tokens"]),
                int(s["bytes"]),
                str(s["sha256"]) if "sha256" in s else None,
                IndexRef(ix, int(s["index"]["bytes"]), str(s["index"]["sha256"])) if ix else None,
                rows[name] if index else None,
            )
        )
    # A local shard's presence and size are checked by the rank that reads it, as it starts (trainer/data/integrity.py
    # ShardCheck.verify): not here, where every rank would stat every shard of the dataset (10^5 files x 512 ranks
    # of metadata calls on a shared filesystem).
    return DataSource(tuple(shards), paths.processor, manifest, index, row, base, version)


RAW_SUFFIXES = (".jsonl", ".jsonl.zst", ".json")  # what `vlmprep build --in` reads


def _refuse_raw_input(path: str) -> None:
    """A records file (or a dir of them, no manifest.json) is what `vlmprep build` reads, not shards: say so."""
    p = Path(path)
    raw = (
        p.is_file()
        and p.name.endswith(RAW_SUFFIXES)
        or p.is_dir()
        and not (p / "manifest.json").exists()
        and any(c.name.endswith(RAW_SUFFIXES) for c in p.iterdir())
    )
    if raw:
        raise DataError(
            f"--data {path} is raw input (records), not a built dataset: run `vlmprep build --in {path} "
            "--out DIR` first, then pass --data DIR"
        )


def resolve_data(url: str, *, option: str = "--data", pinned: dict | None = None) -> DataSource:
    """Dataset dir or base URL (manifest required; `DIR@vN` / `DIR@TAG` read that version's record, plain `DIR` the
    latest, once: docs/datasets-that-grow.md), shard path/pattern/URL (manifest used when beside it), or `pipe:`
    commands (no manifest). `option`: the option that named it, for the messages (--eval-data). `pinned`: a resumed
    run's record of the version it read (pins.DatasetVersion.entry): that version is read again and checked."""
    if url.startswith("file:"):
        url = url[len("file:") :]
        if url.startswith("//"):
            url = url[2:]
    if url.startswith("pipe:"):
        cmds = list(braceexpand.braceexpand(url))
        return DataSource(tuple(ShardRef(c, c) for c in cmds), None, None)
    remote = url.startswith(REMOTE)
    if remote:
        try:
            refuse_credentials(url, where=option)
        except UnsafeDataset as e:
            raise DataError(str(e)) from None
    try:
        url, ref = split_ref(url)
    except VersionError as e:
        raise DataError(f"{option} {e}") from None
    is_pattern = "{" in url or url.endswith(".tar")
    if ref is not None and is_pattern:
        raise DataError(
            f"{option} {url}@{ref}: a version names a dataset dir or URL, not shards: pass DIR@{ref} (every shard of "
            "that version)"
        )
    if not is_pattern:
        if not remote:
            _refuse_raw_input(url)
        if not remote and not Path(url).is_dir():
            raise DataError(
                f"--data {url}: no such dataset dir (or pass a shard pattern like DIR/shard-{{000000..000009}}.tar)"
            )
        manifest, version = _load_manifest(url, option=option, ref=ref, pinned=pinned)
        return _from_manifest(url, manifest, version=version)
    urls = list(braceexpand.braceexpand(url))
    base = urls[0].rsplit("/", 1)[0] if "/" in urls[0] else "."
    if any(u.rsplit("/", 1)[0] != base for u in urls):
        raise DataError(f"--data {url}: all shards of a pattern must live in one directory")
    if not remote:
        missing = [u for u in urls if not Path(u).is_file()]
        if missing:
            raise DataError(f"--data {url}: {len(missing)} shard(s) missing, first: {missing[0]}")
    names = [u.rsplit("/", 1)[-1] for u in urls]
    has_manifest = Path(base, "manifest.json").is_file() if not remote else True
    if has_manifest:
        try:
            manifest, version = _load_manifest(base, option=option)
            return _from_manifest(base, manifest, names, version=version)
        except DataError:
            if not remote:
                raise
    return DataSource(tuple(ShardRef(u, n) for u, n in zip(urls, names)), None, None)


@dataclass(frozen=True)
class ShardPlan:
    """Which shards each rank reads, in manifest order; ranks never share a shard."""

    per_rank: tuple[tuple[int, ...], ...]
    rank_tokens: tuple[int, ...]
    rank_samples: tuple[int | None, ...]
    stride: bool = False  # fewer shards than ranks: every rank reads all shards, keeps every world-th sample

    @property
    def imbalance(self) -> float:
        """max/mean of per-rank tokens: 1.0 is perfect; the pad policy idles ranks for about this much."""
        mean = sum(self.rank_tokens) / max(len(self.rank_tokens), 1)
        return max(self.rank_tokens) / mean if mean else 1.0


def plan_shards(shards: tuple[ShardRef, ...], world: int) -> ShardPlan:
    """Greedy longest-processing-time: biggest shard (by tokens) to the least-loaded rank. Without
    manifest counts every shard weighs the same, which is then a round-robin. With fewer shards than
    ranks, whole shards would leave ranks idle, so every rank strides over all samples instead."""
    weight = [s.num_tokens if s.num_tokens is not None else 1 for s in shards]
    counted = all(s.num_samples is not None for s in shards)
    if 0 < len(shards) < world:
        n = sum(s.num_samples for s in shards) if counted else None
        samples = tuple(len(range(r, n, world)) if counted else None for r in range(world))
        tokens = tuple(sum(weight) * k // n if counted and n else sum(weight) // world for k in samples)
        return ShardPlan(tuple(tuple(range(len(shards))) for _ in range(world)), tokens, samples, stride=True)
    order = sorted(range(len(shards)), key=lambda i: (-weight[i], i))
    loads = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    heap = [(0, 0, k) for k in range(world)]  # (load, shards, rank): the least-loaded rank first, O(log world)
    for i in order:
        load_, count, r = heap[0]
        owned[r].append(i)
        loads[r] += weight[i]
        heapq.heapreplace(heap, (loads[r], count + 1, r))
    samples = tuple(sum(shards[i].num_samples for i in o) if counted else None for o in owned)
    return ShardPlan(tuple(tuple(sorted(o)) for o in owned), tuple(loads), samples)
