"""Verify a built dataset dir: manifest and meta against schemas/, shard sha256 and counts, and per-sample
invariants (aligned lengths, placeholders = grid rows, mask only on text, images decodable at grid size).
Reads with allow_pickle=False and refuses unknown members without decoding them.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np

from vlmprep.images import decode_stored_image
from vlmprep.shards import FORMAT_VERSION

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
ARRAYS = {"input_ids.npy": np.int32, "loss_mask.npy": np.uint8, "mm_token_type_ids.npy": np.uint8,
          "position_ids.npy": np.int32, "image_grid_thw.npy": np.int32}
IMAGE_MEMBER = re.compile(r"^img\d{3}\.(npy\.zst|png|webp|orig\.[a-z0-9]+)$")
# Families whose image i takes prod(grid_i) / merge^2 placeholder tokens and H = grid_h * patch.
GRID_FAMILIES = {"Qwen2VLProcessor", "Qwen2_5_VLProcessor"}


@dataclass(frozen=True)
class Violation:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def load_schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_samples(path: Path):
    """Yield (key, {ext: bytes}) per sample from a tar, grouping consecutive members by key."""
    key, members = None, {}
    with tarfile.open(path) as tf:
        for m in tf:
            if not m.isfile():
                raise ValueError(f"{path.name}: member {m.name!r} is not a regular file")
            k, _, ext = m.name.partition(".")
            if k != key and key is not None:
                yield key, members
                members = {}
            key = k
            members[ext] = tf.extractfile(m).read()
    if key is not None:
        yield key, members


def verify_dataset(root: Path, *, deep: bool = True) -> list[Violation]:
    root = Path(root)
    out: list[Violation] = []
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except FileNotFoundError:
        return [Violation("manifest.json", "missing: the build did not finish (or this is not a dataset dir)")]
    except ValueError as e:
        return [Violation("manifest.json", f"not valid JSON: {e}")]
    if manifest.get("format_version") != FORMAT_VERSION:
        return [Violation("manifest.json", f"format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}")]
    try:
        jsonschema.validate(manifest, load_schema("manifest.schema.json"))
    except jsonschema.ValidationError as e:
        out.append(Violation("manifest.json", f"schema: {e.message} at {'/'.join(map(str, e.absolute_path))}"))
        return out

    listed = {s["name"] for s in manifest["shards"]}
    for extra in sorted(p.name for p in root.glob("shard-*.tar") if p.name not in listed):
        out.append(Violation(extra, "shard file not listed in the manifest"))
    meta_schema = load_schema("sample_meta.schema.json")
    proc_class = manifest["processor"]["class"]
    pcfg = _processor_config(root / manifest["processor"]["dir"])
    for s in manifest["shards"]:
        path = root / s["name"]
        if not path.is_file():
            out.append(Violation(s["name"], "missing"))
            continue
        if path.stat().st_size != s["bytes"]:
            out.append(Violation(s["name"], f"size {path.stat().st_size} != manifest {s['bytes']}"))
            continue
        if _sha256(path) != s["sha256"]:
            out.append(Violation(s["name"], "sha256 differs from the manifest"))
            continue
        if deep:
            out.extend(_verify_shard(path, s, meta_schema, proc_class, pcfg, manifest["image_format"]))
    return out


def _processor_config(d: Path) -> dict:
    for name in ("preprocessor_config.json", "processor_config.json"):
        p = d / name
        if p.exists():
            cfg = json.loads(p.read_text())
            return cfg.get("image_processor", cfg)
    return {}


def _verify_shard(path: Path, info: dict, meta_schema: dict, proc_class: str, pcfg: dict, image_format: str):
    out: list[Violation] = []
    n = tokens = trainable = 0
    try:
        for key, members in read_samples(path):
            n += 1
            where = f"{path.name}:{key}"
            v, counts = _verify_sample(where, members, meta_schema, proc_class, pcfg, image_format)
            out.extend(v)
            tokens += counts[0]
            trainable += counts[1]
    except (tarfile.TarError, ValueError, OSError) as e:
        return out + [Violation(path.name, f"unreadable tar: {e}")]
    if n != info["num_samples"]:
        out.append(Violation(path.name, f"{n} samples, manifest says {info['num_samples']}"))
    if (tokens, trainable) != (info["num_tokens"], info["num_trainable_tokens"]):
        out.append(Violation(path.name, f"token counts ({tokens}, {trainable}) differ from the manifest"))
    return out


def _verify_sample(where, members, meta_schema, proc_class, pcfg, image_format):
    out: list[Violation] = []
    unknown = [e for e in members if e not in ARRAYS and e != "json" and not IMAGE_MEMBER.match(e)]
    if unknown:
        # Never decoded: .pyd/.pth/.pickle members are exactly what unpickling readers would execute.
        return [Violation(where, f"unexpected member(s) {sorted(unknown)} refused, not decoded")], (0, 0)
    missing = [e for e in list(ARRAYS) + ["json"] if e not in members]
    if missing:
        return [Violation(where, f"missing member(s) {missing}")], (0, 0)
    arr = {}
    for ext, dtype in ARRAYS.items():
        try:
            a = np.load(io.BytesIO(members[ext]), allow_pickle=False)
        except ValueError as e:
            return [Violation(where, f"{ext}: refused ({e})")], (0, 0)
        if a.dtype != dtype:
            out.append(Violation(where, f"{ext}: dtype {a.dtype}, expected {np.dtype(dtype)}"))
        arr[ext] = a
    try:
        meta = json.loads(members["json"])
        jsonschema.validate(meta, meta_schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return out + [Violation(where, f"meta: {getattr(e, 'message', e)}")], (0, 0)
    ids, mask, mm, pos, grid = (arr[k] for k in ARRAYS)
    L = len(ids)
    if not (mask.shape == mm.shape == (L,) and pos.shape == (3, L)):
        out.append(Violation(where, f"misaligned arrays: ids {ids.shape}, mask {mask.shape}, types {mm.shape}, positions {pos.shape}"))
        return out, (L, int(mask.sum()))
    if grid.shape != (meta["num_images"], 3) or len(meta["images"]) != meta["num_images"]:
        out.append(Violation(where, f"image_grid_thw {grid.shape} vs {meta['num_images']} images in meta"))
    if (mask.astype(bool) & (mm != 0)).any():
        out.append(Violation(where, "loss_mask trains image placeholder tokens"))
    if meta["num_tokens"] != L or meta["num_trainable_tokens"] != int(mask.sum()):
        out.append(Violation(where, "meta token counts differ from the arrays"))
    if proc_class in GRID_FAMILIES and grid.shape[1:] == (3,):
        merge = int(pcfg.get("merge_size", 2))
        patch = int(pcfg.get("patch_size", 14))
        want = int((grid.prod(axis=1) // merge**2).sum())
        if int((mm == 1).sum()) != want:
            out.append(Violation(where, f"{int((mm == 1).sum())} image placeholders, grid rows need {want}"))
        for k, (im, g) in enumerate(zip(meta["images"], grid)):
            if im["member"] not in members:
                out.append(Violation(where, f"image {k}: member {im['member']} missing"))
                continue
            try:
                pixels = decode_stored_image(im["member"].split(".", 1)[1], members[im["member"]])
            except Exception as e:  # noqa: BLE001 - any decode fault is a reported violation
                out.append(Violation(where, f"image {k}: undecodable ({type(e).__name__}: {e})"))
                continue
            if image_format != "original" and pixels.shape[:2] != (g[1] * patch, g[2] * patch):
                out.append(Violation(where, f"image {k}: {pixels.shape[1]}x{pixels.shape[0]} does not match grid {g.tolist()}"))
    return out, (L, int(mask.sum()))
