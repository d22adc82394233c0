"""Verify a built dataset dir: manifest and meta against schemas/, shard sha256 and counts, and per-sample
invariants (aligned lengths, occurrence -> image mapping, placeholders = grid rows, mask only on text, images
decodable at grid size; format v3: video placeholders = video grid rows, frame members = the meta's frames, each at
grid size). Reads through shards/reader.py: refused members are reported, never decoded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jsonschema
import numpy as np
from referencing import Registry, Resource

from vlmprep.families import FamilySpec, family_of
from vlmprep.processors.load import load_saved_processor, vocab_size
from vlmprep.shards.dataset import MANIFEST_NAME, SHARD_GLOB, sha256_file
from vlmprep.shards.format import META_MEMBER, arrays_of, id_hash, is_video_member
from vlmprep.shards.manifest import (
    Manifest,
    ShardEntry,
    ShardFormatError,
    VersionRefError,
    open_dataset,
    processor_dir,
)
from vlmprep.shards.reader import StoredSample, iter_shard, load_sample_index, read_index_file, sample_ranges
from vlmprep.shards.versions import manifest_number, replaced_by_rebuilds, shard_version
from vlmprep.tools.per_shard import map_shards
from vlmprep.tools.sample_checks import source_problems, span_problems, views_problems
from vlmprep_schemas import NAMES, load
from vlmprep_schemas.boundary import UnsafeDataset
from vlmprep_schemas.limits import LIMITS, grid_problem
from vlmprep_schemas.processor_dir import processor_files
from vlmprep_schemas.views import unnamed_views


@dataclass(frozen=True)
class Violation:
    """One broken rule of a dataset: where (a file, or file and sample) and what."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def schema_validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for one of schemas/, with the others registered so cross-file $refs resolve offline."""
    registry = Registry().with_resources((load(n)["$id"], Resource.from_contents(load(n))) for n in NAMES)
    return jsonschema.Draft202012Validator(load(name), registry=registry)


def _schema_error(validator, obj) -> str | None:
    err = jsonschema.exceptions.best_match(validator.iter_errors(obj))
    return None if err is None else f"{err.message} at {'/'.join(map(str, err.absolute_path)) or '(root)'}"


def verify_dataset(
    root: Path, *, deep: bool = True, workers: int = 1, on_shard: Callable[[int, int], None] | None = None
) -> list[Violation]:
    """A dataset dir -> every violation found ([] for a valid dataset): the manifest against its schema, each listed
    shard present with its size and sha256, no unlisted shards, and with `deep` every sample decoded and checked
    (member names, array dtypes and shapes, meta schema, token counts against image and video grids, mask and types).
    Trade-off: `deep` reads and decodes every sample; without it only sizes and hashes are checked, in a fraction of
    the time. `workers` > 1: shards are checked in that many processes (tools/per_shard.py), the violations listed in
    manifest order all the same (the same list for any value). `on_shard(done, total)`: called as each shard is
    done."""
    try:
        root, manifest = open_dataset(root)  # DIR, DIR@vN or DIR@TAG
    except VersionRefError:
        raise  # not a fault of the dataset: the version asked for is not there (one line)
    except ShardFormatError as e:
        return [Violation(MANIFEST_NAME, str(e))]
    problem = _schema_error(schema_validator("manifest.schema.json"), manifest.to_json())
    if problem:
        return [Violation(MANIFEST_NAME, f"schema: {problem}")]
    try:  # the vocabulary too (a reader of shards skips it): a file no tokenizer could load is not a valid dataset
        processor_files(processor_dir(root, manifest))
    except (ShardFormatError, UnsafeDataset) as e:
        return [Violation(MANIFEST_NAME, str(e))]

    try:  # deep: loaded as every reader loads it, and every token id checked against it
        vocab = _vocabulary(root, manifest) if deep else 0
    except (ShardFormatError, UnsafeDataset) as e:
        return [Violation(f"{manifest.processor.dir}/", str(e))]
    out: list[Violation] = _version_problems(manifest)
    listed, number = {s.name for s in manifest.shards}, manifest_number(manifest)
    listed |= replaced_by_rebuilds(root, manifest) if number > 1 else set()  # kept for the versions before
    for extra in sorted(p.name for p in root.glob(SHARD_GLOB) if p.name not in listed):
        if shard_version(extra) <= number:  # a later version's shards (or an append under way) are not this one's
            out.append(Violation(extra, "shard file not listed in the manifest"))
    job = _ShardJob(root, manifest, _SampleCheck(manifest, root, vocab), deep)
    for found in map_shards(
        _check_shard, job, len(manifest.shards), workers=workers, command="verify", on_shard=on_shard
    ):
        out.extend(found)
    out.extend(_verify_dataset_index(root, manifest, deep=deep))
    return out


def _version_problems(manifest: Manifest) -> list[Violation]:
    """A version record's own facts agree with the dataset it describes: its parent is the version before it, the
    shards it added are the last of its list, and its shards of each version carry that version's names."""
    version, number = manifest.version, manifest_number(manifest)
    where = MANIFEST_NAME if version is None else f"version {number}"
    if version is not None and version.get("parent") != (number - 1 if number > 1 else None):
        return [Violation(where, f"parent {version.get('parent')!r} is not version {number - 1}")]
    names = [s.name for s in manifest.shards]
    added = list((version or {}).get("added", {}).get("shards", []))
    if added and names[-len(added) :] != added:
        return [Violation(where, "the shards it added are not the last of its shard list")]
    late = [n for n in names if shard_version(n) > number]
    if late:
        return [Violation(where, f"lists {late[0]}, a shard of a later version than {number}")]
    return []


@dataclass(frozen=True)
class _ShardJob:
    """What every shard's check needs (workers inherit it at the fork)."""

    root: Path
    manifest: Manifest
    check: "_SampleCheck"
    deep: bool


def _check_shard(job: _ShardJob, k: int) -> list[Violation]:
    """The manifest's k-th shard of `job`'s dataset: present with its size and sha256, its sidecar, and (deep) every
    sample and the sidecar's rows."""
    root, s, check = job.root, job.manifest.shards[k], job.check
    path = root / s.name
    if not path.is_file():  # a dir or a FIFO where a shard should be is not "missing"
        kind = "missing" if not os.path.lexists(path) else "not a plain file (a directory, FIFO or device)"
        return [Violation(s.name, kind)]
    if path.stat().st_size != s.bytes:
        return [Violation(s.name, f"size {path.stat().st_size} != manifest {s.bytes}")]
    if sha256_file(path) != s.sha256:
        return [Violation(s.name, "sha256 differs from the manifest")]
    out: list[Violation] = []
    index = _index_file(root, s)
    if index:
        out.append(index)
    seen: list[tuple[str, str | None, int, int]] = []
    if job.deep:
        out.extend(_verify_shard(path, s, check, seen))
        if index is None and s.index:
            out.extend(_verify_index(root, s, path, seen))
    return out


def _verify_dataset_index(root: Path, manifest: Manifest, *, deep: bool) -> list[Violation]:
    """The dataset's sample index, where the manifest lists one: present with the listed size and sha256 and (`deep`)
    every shard's sidecar rows, in manifest order (each sidecar is checked against its shard above)."""
    listed = manifest.sample_index
    if listed is None:
        return []
    name, p = listed.name, root / listed.name
    if not p.is_file():
        return [Violation(name, "missing (the dataset's sample index)")]
    if p.stat().st_size != listed.bytes or sha256_file(p) != listed.sha256:
        return [Violation(name, "size or sha256 differs from the manifest")]
    if not deep:
        return []
    try:
        rows = read_index_file(p, listed, rows=sum(s.num_samples for s in manifest.shards))
        at = 0
        for s in manifest.shards:
            part = load_sample_index(root, s)
            if part is None:
                return [Violation(name, f"listed, but shard {s.name} has no sample index of its own")]
            if not np.array_equal(rows[at : at + len(part)], part):
                return [Violation(name, f"rows {at}..{at + len(part) - 1} are not {s.name}'s sample index")]
            at += len(part)
    except ShardFormatError as e:
        return [Violation(name, str(e))]
    if at != len(rows):
        return [Violation(name, f"{len(rows)} rows for the shards' {at} samples")]
    return []


def _index_file(root: Path, s: ShardEntry) -> Violation | None:
    """The shard's sample index sidecar, where the manifest lists one: present with the listed size and sha256."""
    index = s.index
    if index is None:
        return None
    p = root / index.name
    if not p.is_file():
        return Violation(index.name, f"missing (the sample index of {s.name})")
    if p.stat().st_size != index.bytes or sha256_file(p) != index.sha256:
        return Violation(index.name, "size or sha256 differs from the manifest")
    return None


def _verify_index(
    root: Path, s: ShardEntry, path: Path, seen: list[tuple[str, str | None, int, int]]
) -> list[Violation]:
    """The sidecar's rows are the shard's samples: their byte ranges (from the tar headers), input positions, id
    hashes and token counts (from the metas read by the sample checks)."""
    name = s.index.name
    try:
        rows = load_sample_index(root, s)
        ranges = sample_ranges(path)
    except ShardFormatError as e:
        return [Violation(name, str(e))]
    if len(rows) != len(ranges) or len(rows) != len(seen):
        return [Violation(name, f"{len(rows)} rows for the shard's {len(ranges)} samples")]
    for i, (row, (key, a, z), (_, sid, t, tr)) in enumerate(zip(rows, ranges, seen)):
        got = tuple(int(x) for x in row.tolist())
        if sid is None:  # the sample failed its own checks (reported): only what the tar headers say is compared
            got, want = (got[0], got[2], got[3]), (int(key[:10]), a, z)
        else:
            want = (int(key[:10]), id_hash(sid), a, z, t, tr)
        if got != want:
            return [
                Violation(
                    name,
                    f"row {i} {row.tolist()} does not describe sample {key} {list(want)}: the index "
                    "is wrong, not the sample",
                )
            ]
    return []


def _vocabulary(root: Path, manifest: Manifest) -> int:
    """The saved processor's vocabulary size (load.vocab_size), the processor loaded as the Collator and inspect load
    it (a dir that does not load is not a valid dataset); the size the manifest records must be it."""
    size = vocab_size(load_saved_processor(processor_dir(root, manifest)))
    recorded = manifest.processor.vocab_size
    if recorded is not None and recorded != size:
        raise ShardFormatError(
            f"the saved processor's tokenizer has {size} tokens, the manifest records {recorded}: it is not the "
            "processor the shards were tokenized with"
        )
    return size


def _processor_config(d: Path) -> dict:
    for name in ("preprocessor_config.json", "processor_config.json"):
        p = d / name
        if p.exists():
            cfg = json.loads(p.read_text())
            return cfg.get("image_processor", cfg)
    return {}


class _SampleCheck:
    """Per-sample invariants of one dataset; family facts come from the registry by the manifest's processor class."""

    def __init__(self, manifest: Manifest, root: Path, vocab: int = 0):
        self.vocab = vocab  # every token id is below it (0: not checked)
        self.version = manifest.format_version
        self.image_format = manifest.image_format
        self.meta_validator = schema_validator("sample_meta.schema.json")
        self.family: FamilySpec | None = family_of(manifest.processor.class_name)
        self.processor_dir = processor_dir(root, manifest)
        self._image_processor = None  # loaded on the first views member (views_problems)
        pcfg = _processor_config(self.processor_dir)
        self.merge = int(pcfg.get("merge_size", 2))
        patch = pcfg.get("patch_size", 14)  # PixtralImageProcessor saves {"height": h, "width": w}
        self.patch = int(patch["height"] if isinstance(patch, dict) else patch)
        self.temporal = int(pcfg.get("temporal_patch_size") or 2)

    def __getstate__(self):
        return {**self.__dict__, "_image_processor": None}

    @property
    def image_processor(self):
        """The dataset's saved image processor (its checked dir, no code), loaded once."""
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(
                str(self.processor_dir), local_files_only=True, trust_remote_code=False
            )
        return self._image_processor

    def __call__(self, s: StoredSample) -> tuple[list[Violation], tuple[int, int]]:
        where = f"{s.where}:{s.key}"
        if s.unknown:
            # Never decoded: .pyd/.pth/.pickle members are exactly what unpickling readers would execute.
            return [Violation(where, f"unexpected member(s) {sorted(s.unknown)} refused, not decoded")], (0, 0)
        missing = [n for n in [*arrays_of(self.version), META_MEMBER] if n not in s.names]
        if missing:
            return [Violation(where, f"missing member(s) {missing}")], (0, 0)
        try:
            meta = s.meta()
            problem = _schema_error(self.meta_validator, meta)
            if problem:
                return [Violation(where, f"meta: {problem}")], (0, 0)
            arr = {n.removesuffix(".npy"): s.array(n) for n in arrays_of(self.version)}
        except ShardFormatError as e:
            return [Violation(where, str(e).split(": ", 2)[-1])], (0, 0)
        out: list[Violation] = []
        ids, mask, mm, pos, grid = (
            arr[k] for k in ("input_ids", "loss_mask", "mm_token_type_ids", "position_ids", "image_grid_thw")
        )
        L = len(ids)
        counts = (L, int(mask.sum()))
        if not (mask.shape == mm.shape == (L,) and pos.shape == (3, L)):
            out.append(
                Violation(
                    where,
                    f"misaligned arrays: ids {ids.shape}, mask {mask.shape}, types {mm.shape}, positions {pos.shape}",
                )
            )
            return out, counts
        if self.vocab and L and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab:
            bad = int(ids.max()) if ids.max() >= self.vocab else int(ids.min())
            out.append(Violation(where, f"token id {bad} outside the saved processor's {self.vocab} tokens"))
        n_images = meta["num_images"]
        if grid.shape != (n_images, 3) or len(meta["images"]) != n_images:
            out.append(Violation(where, f"image_grid_thw {grid.shape} vs {n_images} images in meta"))
        if (mask.astype(bool) & (mm != 0)).any():
            out.append(Violation(where, "loss_mask trains image placeholder tokens"))
        if meta["num_tokens"] != L or meta["num_trainable_tokens"] != int(mask.sum()):
            out.append(Violation(where, "meta token counts differ from the arrays"))
        out.extend(Violation(where, p) for p in span_problems(meta, mm, mask))
        try:
            members = s.image_members()
        except ShardFormatError as e:
            return out + [Violation(where, str(e).split(": ", 2)[-1])], counts
        if members != [im["member"] for im in meta["images"]]:
            out.append(
                Violation(
                    where,
                    f"image_index maps occurrences to {members}, the meta says "
                    f"{[im['member'] for im in meta['images']]}",
                )
            )
        unused = sorted(set(n for n in s.names if n.startswith("img")) - set(members))
        if unused:
            out.append(Violation(where, f"image member(s) {unused} belong to no occurrence"))
        corrupt = source_problems(s, meta)
        out.extend(Violation(where, what) for what in corrupt.values())
        stray = unnamed_views(meta["images"], s.names)
        if stray:
            out.append(Violation(where, f"views member(s) {stray} belong to no kept photo"))
        if any(im.get("views") for im in meta["images"]):
            views = views_problems(s, meta, self.image_processor, max_pixels=LIMITS.image_bytes // 3)
            out.extend(Violation(where, what) for what in views)
        if self.family is not None and self.family.grid_images and grid.shape[1:] == (3,):
            out.extend(self._grid_checks(where, s, meta, grid, mm, [m for m in members if m not in corrupt]))
        if self.version >= 3:
            out.extend(self._video_checks(where, s, meta, arr["video_grid_thw"], arr["second_per_grid_ts"], mm))
        return out, counts

    def _video_checks(self, where, s: StoredSample, meta, vgrid: np.ndarray, sgt: np.ndarray, mm: np.ndarray):
        videos = meta.get("videos", [])
        if vgrid.shape != (len(videos), 3) or sgt.shape != (len(videos),):
            return [
                Violation(
                    where,
                    f"video_grid_thw {vgrid.shape} / second_per_grid_ts {sgt.shape} vs {len(videos)} videos in meta",
                )
            ]
        out = []
        want = int((vgrid.prod(axis=1) // self.merge**2).sum()) if len(videos) else 0
        if int((mm == 2).sum()) != want:
            out.append(Violation(where, f"{int((mm == 2).sum())} video placeholders, video_grid_thw rows need {want}"))
        stored = sorted(n for n in s.names if is_video_member(n, self.version))
        claimed: list[str] = []
        for k, (v, g) in enumerate(zip(videos, vgrid)):
            frames = [n for n in stored if n.startswith(v["member"] + ".")]
            claimed += frames
            if len(frames) != v["frames"] or -(-v["frames"] // self.temporal) != g[0]:
                out.append(
                    Violation(
                        where,
                        f"video {k}: {len(frames)} frame members, meta says {v['frames']} frames, grid t {int(g[0])}",
                    )
                )
            if (v["height"], v["width"]) != (g[1] * self.patch, g[2] * self.patch):
                out.append(
                    Violation(
                        where,
                        f"video {k}: frames of {v['width']}x{v['height']}, grid {g.tolist()} "
                        f"needs {g[2] * self.patch}x{g[1] * self.patch}",
                    )
                )
                continue  # not decoded: the meta's size is what bounds the decode
            for name in frames:
                try:
                    s.decode(name, (v["height"], v["width"]))
                except ShardFormatError as e:
                    out.append(Violation(where, f"video {k}: {name} undecodable ({str(e).split(': ', 2)[-1]})"))
        unused = sorted(set(stored) - set(claimed))
        if unused:
            out.append(Violation(where, f"video member(s) {unused[:3]} belong to no video"))
        return out

    def _grid_checks(self, where, s: StoredSample, meta, grid: np.ndarray, mm: np.ndarray, members) -> list[Violation]:
        out = []
        want = int((grid.prod(axis=1) // self.merge**2).sum())
        if int((mm == 1).sum()) != want:
            out.append(Violation(where, f"{int((mm == 1).sum())} image placeholders, grid rows need {want}"))
        try:
            sizes = s.stored_sizes()
        except ShardFormatError as e:
            return out + [Violation(where, str(e).split(": ", 2)[-1])]
        found: dict[int, str] = {}
        occurrences: dict[str, list[int]] = {}  # member -> its occurrences whose size the grid makes
        for k, (name, g, im) in enumerate(zip(members, grid, meta["images"])):
            problem = grid_problem(im["height"], im["width"], g, self.patch)
            if problem:  # not decoded: the meta's size is what bounds the decode
                found[k] = f"image {k} {problem}"
            else:
                occurrences.setdefault(name, []).append(k)
        for name in sorted(occurrences):  # member order: a .pdelta.zst member's prefix is the one just decoded
            try:
                s.decode(name, sizes[name])
            except ShardFormatError as e:
                found.update({k: f"image {k}: undecodable ({str(e).split(': ', 2)[-1]})" for k in occurrences[name]})
        return out + [Violation(where, found[k]) for k in sorted(found)]


def _verify_shard(
    path: Path, info: ShardEntry, check: _SampleCheck, seen: list[tuple[str, str | None, int, int]]
) -> list[Violation]:
    """Every sample's checks and the shard's counts; `seen` gets each sample's (key, id (None: it failed its checks),
    tokens, trained)."""
    out: list[Violation] = []
    n = tokens = trainable = 0
    try:
        for sample in iter_shard(path, version=check.version, on_unknown="report"):
            n += 1
            v, (t, tr) = check(sample)
            seen.append((sample.key, str(sample.meta().get("id")) if not v else None, t, tr))
            out.extend(v)
            tokens += t
            trainable += tr
    except (ShardFormatError, OSError) as e:
        return out + [Violation(path.name, f"unreadable: {e}")]
    if n != info.num_samples:
        out.append(Violation(path.name, f"{n} samples, manifest says {info.num_samples}"))
    if (tokens, trainable) != (info.num_tokens, info.num_trainable_tokens):
        out.append(Violation(path.name, f"token counts ({tokens}, {trainable}) differ from the manifest"))
    return out
