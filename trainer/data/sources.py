"""Read shards: a --data URL -> the shard list (with manifest counts when there is one) -> a token-balanced
shard-to-rank plan -> raw tar members grouped per sample, opened with webdataset's opener (random access by
sample: trainer/data/index.py).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import braceexpand

from trainer.data.storage import StorageError, open_url, read_url
from vlmprep_schemas import load
from vlmprep_schemas.boundary import (
    MANIFEST_NAME,
    MAX_CONFIG_BYTES,
    MAX_VOCAB_BYTES,
    PROCESSOR_FILES,
    REMOTE,
    UnsafeDataset,
    dataset_file,
    dataset_paths,
    processor_files,
    refuse_bad_sizes,
    refuse_credentials,
    refuse_custom_code,
)
from vlmprep_schemas.limits import LIMITS, load_json, schema_problem

READABLE_VERSIONS = tuple(load("shard_format.schema.json")["readable_versions"])
# Shard URLs that are not local files: streamed once, or read from the rank's shard cache
REMOTE_OR_PIPE = ("pipe:",) + REMOTE


class DataError(RuntimeError):
    """Unreadable, inconsistent or unsafe data; the message names the URL (and sample) that failed."""


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

    @property
    def counted(self) -> bool:
        """True when every shard's sample count is known (from a manifest), so steps are known up front."""
        return all(s.num_samples is not None for s in self.shards)


def _read_url(url: str, limit: int = LIMITS.manifest_bytes) -> bytes:
    """A small file of a dataset (its manifest, a processor config), refused when over `limit` bytes."""
    if url.startswith(REMOTE):
        try:
            data = read_url(url, limit)
        except StorageError as e:
            raise DataError(str(e)) from None
    else:
        with open(url, "rb") as f:  # read() of n bytes allocates n first: ask for no more than the file holds
            data = f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
    if len(data) > limit:
        raise DataError(f"{url} is more than {limit} bytes, more than a reader accepts")
    return data


def _load_manifest(base: str) -> dict:
    try:
        url = dataset_file(base, MANIFEST_NAME, where=base, what="file")  # not a symlink out of the dataset
    except UnsafeDataset as e:
        raise DataError(str(e)) from None
    try:
        data = _read_url(url)
    except DataError as e:  # its own line names the URL
        raise DataError(str(e) if str(e).startswith("cannot ") else f"cannot read {url}: {e}") from None
    except OSError as e:
        raise DataError(f"cannot read {url}: {e}") from None
    try:
        manifest = load_json(data, "it", LIMITS.manifest_bytes)
    except ValueError as e:
        raise DataError(f"cannot read {url}: {e}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise DataError(f"{url}: format_version {version!r} is not supported by this trainer (it reads "
                        f"format_version {', '.join(map(str, READABLE_VERSIONS))}); rebuild the shards or upgrade "
                        "the trainer")
    problem = schema_problem(manifest, "manifest.schema.json")
    if problem:
        raise DataError(f"{url} does not match the manifest schema: {problem}")
    return manifest


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if base.startswith(REMOTE) else str(Path(base) / name)


def _from_manifest(base: str, manifest: dict, only: list[str] | None = None) -> DataSource:
    where = _join(base, MANIFEST_NAME)
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
            raise DataError(f"{_join(base, name)} is not listed in {where}")
        s, url, ix = by_name[name]
        shards.append(ShardRef(url, name, int(s["num_samples"]), int(s["num_tokens"]), int(s["bytes"]),
                               str(s["sha256"]) if "sha256" in s else None,
                               IndexRef(ix, int(s["index"]["bytes"]), str(s["index"]["sha256"])) if ix else None,
                               rows[name] if index else None))
    # A local shard's presence and size are checked by the rank that reads it, as it starts (trainer/data/integrity.py
    # ShardCheck.verify): not here, where every rank would stat every shard of the dataset (10^5 files x 512 ranks
    # of metadata calls on a shared filesystem).
    return DataSource(tuple(shards), paths.processor, manifest, index, row)


RAW_SUFFIXES = (".jsonl", ".jsonl.zst", ".json")  # what `vlmprep build --in` reads


def _refuse_raw_input(path: str) -> None:
    """A records file (or a dir of them, no manifest.json) is what `vlmprep build` reads, not shards: say so."""
    p = Path(path)
    raw = p.is_file() and p.name.endswith(RAW_SUFFIXES) or p.is_dir() and not (p / "manifest.json").exists() and any(
        c.name.endswith(RAW_SUFFIXES) for c in p.iterdir())
    if raw:
        raise DataError(f"--data {path} is raw input (records), not a built dataset: run `vlmprep build --in {path} "
                        "--out DIR` first, then pass --data DIR")


def resolve_data(url: str, *, option: str = "--data") -> DataSource:
    """Dataset dir or base URL (manifest required), shard path/pattern/URL (manifest used when beside it),
    or `pipe:` commands (no manifest). `option`: the option that named it, for the messages (--eval-data)."""
    if url.startswith("file:"):
        url = url[len("file:"):]
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
    is_pattern = "{" in url or url.endswith(".tar")
    if not is_pattern:
        if not remote:
            _refuse_raw_input(url)
        if not remote and not Path(url).is_dir():
            raise DataError(f"--data {url}: no such dataset dir (or pass a shard pattern like "
                            "DIR/shard-{000000..000009}.tar)")
        return _from_manifest(url, _load_manifest(url))
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
            return _from_manifest(base, _load_manifest(base), names)
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


def open_shard(url: str):
    """Local files stay seekable, so members a worker skips are never read; remote ones stream through fsspec
    (trainer/data/storage.py), pipe: commands through webdataset's gopen."""
    if url.startswith(REMOTE_OR_PIPE):
        try:
            return open_url(url)
        except StorageError as e:
            raise OSError(str(e)) from None
    return open(url, "rb")


SAMPLE_KEY = re.compile(r"^[^.]+$")


def member_key(ti: tarfile.TarInfo, url: str) -> tuple[str, str]:
    """A shard member's (sample key, extension) from its `<key>.<ext>` base name."""
    k, dot, ext = os.path.basename(ti.name).partition(".")
    if not dot or not SAMPLE_KEY.match(k):
        raise DataError(f"{url}: member {ti.name!r} has no '<key>.<ext>' name")
    return k, ext


def check_member_size(ti: tarfile.TarInfo, ext: str, url: str) -> None:
    """Before a member is read into memory: a regular member (a sparse one would expand its holes) within the reader
    limit (the meta's, for the json member)."""
    limit = LIMITS.meta_bytes if ext == "json" else LIMITS.member_bytes
    if ti.issparse() or ti.size > limit:
        raise DataError(f"{url}: member {ti.name!r} is {'sparse' if ti.issparse() else f'{ti.size} bytes'}: a reader "
                        f"accepts plain members of at most {limit} bytes; refusing to read it")


def iter_tar_samples(url: str, want: Callable[[int], bool]) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """Yield (index in shard, key, members) per sample, in tar order; members is None when want(index) is
    False, and then no member bytes were read from a seekable file."""
    try:
        stream = open_shard(url)
    except OSError as e:
        raise DataError(f"cannot open shard {url}: {e}") from None
    mode = "r|" if url.startswith(REMOTE_OR_PIPE) else "r:"
    finished = False
    try:
        with tarfile.open(fileobj=stream, mode=mode) as tar:
            index, key, members = -1, None, None
            for ti in tar:
                if not ti.isfile():
                    continue
                k, ext = member_key(ti, url)
                if k != key:
                    if key is not None:
                        yield index, key, members
                    index, key = index + 1, k
                    members = {} if want(index) else None
                if members is not None:
                    if ext in members:
                        raise DataError(f"{url}: sample {k} has member {ext!r} twice")
                    check_member_size(ti, ext, url)
                    members[ext] = tar.extractfile(ti).read()
            if key is not None:
                yield index, key, members
        finished = True
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{url}: unreadable, corrupt or truncated tar: {e}") from None
    finally:
        try:
            stream.close()
        except Exception as e:  # noqa: BLE001 - a reader stopped early kills curl/pipe; only a full read must succeed
            if finished:
                raise DataError(f"{url}: reader failed: {e}") from None


def check_processor(location: str, *, user_named: bool = False) -> None:
    """A processor dir the trainer reads settings from (the dataset's, or --processor): each file it would read
    inside it and no custom code (vlmprep_schemas.boundary.processor_files); a URL's configs are checked as read.
    A dir the user named (`user_named`) may link out (a Hugging Face cache snapshot); a dataset's may not."""
    if not location.startswith(REMOTE):
        try:
            processor_files(location, links_out=user_named)
        except UnsafeDataset as e:
            raise DataError(str(e)) from None


def load_processor(processor_dir: str):
    """transformers' processor from a checked local dir (check_processor), offline and without code; a tokenizer or
    config it cannot load is one DataError naming the dir (the tokenizers library's own errors are bare Exceptions)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(processor_dir, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise anything
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"{processor_dir}: cannot load the processor there ({type(e).__name__}: {text[:200]}); "
                        "pass --processor DIR with the processor the shards were built with") from None


def _no_custom_code(cfg, url: str):
    """A processor config as read from `url`, refused (one line) when it asks for custom code or its sizes are not
    positive integers."""
    try:
        refuse_custom_code(cfg, url)
        refuse_bad_sizes(cfg, url)
    except UnsafeDataset as e:
        raise DataError(str(e)) from None
    return cfg if isinstance(cfg, dict) else {}


def load_image_processor_config(location: str) -> dict:
    """The image processor's saved settings: `processor_config.json` (transformers 5) or the older
    `preprocessor_config.json`, from a local dir or a URL."""
    errors = []
    for name, pick in (("processor_config.json", lambda d: d.get("image_processor")),
                       ("preprocessor_config.json", lambda d: d)):
        url = _join(location, name)
        if not url.startswith(REMOTE) and not Path(url).is_file():
            errors.append(f"{url}: no such file")
            continue
        try:
            raw = load_json(_read_url(url, MAX_CONFIG_BYTES), url, MAX_CONFIG_BYTES)
        except (OSError, ValueError, RecursionError, DataError) as e:
            errors.append(f"{url}: {e}")
            continue
        cfg = pick(_no_custom_code(raw, url))
        if isinstance(cfg, dict):
            return cfg
        errors.append(f"{url}: no image processor settings")
    raise DataError(f"cannot load the image processor from {location} ({'; '.join(errors)}); "
                    "pass --processor DIR pointing at the processor the shards were built with")


def load_video_processor_config(location: str) -> dict | None:
    """The video processor's saved settings (`processor_config.json`'s video_processor, or the older
    `video_preprocessor_config.json`), or None where the processor saved none (an image-only model)."""
    for name, pick in (("processor_config.json", lambda d: d.get("video_processor")),
                       ("video_preprocessor_config.json", lambda d: d)):
        url = _join(location, name)
        if not url.startswith(REMOTE) and not Path(url).is_file():
            continue
        try:
            raw = load_json(_read_url(url, MAX_CONFIG_BYTES), url, MAX_CONFIG_BYTES)
        except (OSError, ValueError, RecursionError, DataError):
            continue
        cfg = pick(_no_custom_code(raw, url))
        if isinstance(cfg, dict):
            return cfg
    return None


def local_processor(location: str, dest: Path) -> str:
    """A processor dir the trainer loads (its tokenizer, for a tiny model's vocabulary and a placeholder image's
    tokens): a local one as it is, a URL's files (the fixed list a processor may hold, each bounded) copied into
    `dest` first. Checked like any processor (no file linking out, no custom code) before it is loaded."""
    if not location.startswith(REMOTE):
        return location
    dest.mkdir(parents=True, exist_ok=True)
    for name in PROCESSOR_FILES:
        url = _join(location, name)
        try:
            data = _read_url(url, MAX_CONFIG_BYTES)
        except DataError as e:
            if "no such file or object" in str(e):  # a file this processor does not have
                continue
            raise
        (dest / name).write_bytes(data)
    check_processor(str(dest))
    return str(dest)


def processor_difference(a: DataSource, b: DataSource, processor: str = "") -> list[str]:
    """How b's processor differs from a's in what training depends on ('part a-digest vs b-digest'; [] when none).
    `processor` (the run's --processor) stands in for both when given."""
    ia, ib = (processor_identity(processor or x.processor or "", x.manifest) for x in (a, b))
    return [f"{k} {ia[k]} vs {ib[k]}" for k in ia if ib[k] != ia[k]]


def processor_identity(location: str, manifest: dict | None) -> dict[str, str]:
    """What must agree between mixed datasets: the model family (processor class), the tokenizer's vocabulary
    (tokens, merges and added tokens; not the chat template or truncation settings) and the image and video
    processors' settings that the trainer's pixel math uses (not frame sampling or resize budgets: the frames
    are stored already sampled and resized). Digests, so the message can say which part differs."""
    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]

    out = {"family": str(((manifest or {}).get("processor") or {}).get("class", "?"))}
    try:
        url = _join(location, "tokenizer.json")
        tok = load_json(_read_url(url, MAX_VOCAB_BYTES), url, MAX_VOCAB_BYTES)
        out["vocabulary"] = digest([tok.get("model"), tok.get("added_tokens")])
    except (OSError, ValueError, DataError):
        out["vocabulary"] = "?"  # a slow tokenizer only: compared by family and image settings
    keep = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
            "do_rescale", "do_normalize")
    image = load_image_processor_config(location)
    out["image processor"] = digest({k: image.get(k) for k in ("image_processor_type", *keep)})
    # One run normalizes every dataset's videos with the first dataset's video processor.
    video = load_video_processor_config(location)
    out["video processor"] = "none" if video is None else digest({k: video.get(k) for k in keep})
    return out
