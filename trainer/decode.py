"""Decode: one sample's raw tar members -> DecodedSample (numpy only). The only decoders are npy with
allow_pickle=False, json and image bytes; members are checked against the shard format's one member-name rule
(schemas/shard_format.schema.json, shared with vlmprep) first, so nothing unknown is read and nothing unpickled.
"""
from __future__ import annotations

import io
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard
from PIL import Image

from trainer.shards import DataError
from trainer.vision import ImageSpec
from vlmprep_schemas import load

_FORMAT = load("shard_format.schema.json")
META_MEMBER = _FORMAT["meta_member"]
# (dtype, ndim, first format version that has it)
NPY_MEMBERS = {name: (np.dtype(a["dtype"]), a["ndim"], a["since"]) for name, a in _FORMAT["arrays"].items()}
IMAGE_MEMBER = {3: re.compile(_FORMAT["$defs"]["image_member"]["pattern"]),
                2: re.compile(_FORMAT["$defs"]["image_member"]["pattern"]),
                1: re.compile(_FORMAT["$defs"]["image_member_v1"]["pattern"])}
VIDEO_MEMBER = re.compile(_FORMAT["$defs"]["video_member"]["pattern"])  # format v3
# Model types whose video path (pixel_values_videos, packed video segments) matches online processing in tests.
VIDEO_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
NO_VIDEO = ("this trainer trains video samples only for model types {} (loss parity verified); train this model on "
            "a dataset without video parts").format(", ".join(VIDEO_MODELS))
MAX_IMAGE_BYTES = 1 << 30  # a decompressed image larger than this is corrupt, not a screenshot
# The .npy header vlmprep writes for an image, matched instead of running numpy's literal_eval header parser.
_NPY_RGB_HEADER = re.compile(rb"\x93NUMPY\x01\x00..\{'descr': '\|u1', 'fortran_order': False, "
                             rb"'shape': \((\d{1,6}), (\d{1,6}), 3\), \} *\n\Z", re.DOTALL)


@dataclass
class DecodedSample:
    key: str
    id: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    mm_token_type_ids: np.ndarray  # uint8 [L]
    position_ids: np.ndarray  # int32 [3, L]
    image_grid_thw: np.ndarray  # int32 [N, 3], one row per occurrence
    images: list[np.ndarray]  # unique stored images, uint8 H x W x 3, already resized
    image_index: list[int]  # occurrence -> images
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # int32 [V, 3]
    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [V]
    videos: list[list[np.ndarray]] = field(default_factory=list)  # per video its frames, uint8 H x W x 3, resized
    position: int = -1  # index in the rank's sample stream (set by the reader)
    worker: int = -1  # DataLoader worker that decoded it
    source: int = 0  # index of its dataset in a mixture

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def sample_version(names) -> int:
    """A sample's format version from its members (v2 added image_index.npy, v3 video_grid_thw.npy): pipe: sources
    have no manifest."""
    return 3 if "video_grid_thw.npy" in names else 2 if "image_index.npy" in names else 1


def refuse_videos(manifest: dict | None, where: str, model_type: str = "", why: str = NO_VIDEO) -> None:
    """At start-up: a dataset whose manifest counts videos is refused in one line, not mid-run, unless the model's
    video path is verified (VIDEO_MODELS)."""
    n = ((manifest or {}).get("totals") or {}).get("videos", 0)
    if n and model_type not in VIDEO_MODELS:
        raise DataError(f"{where}: the dataset holds {n} video{'s' if n != 1 else ''}; {why}")


def trains_videos(datasets, model_type: str) -> bool:
    """Whether a run (or an eval set) over `datasets` (DataSources) runs the video pass: a verified model type and a
    dataset whose manifest counts videos, or one without a manifest (a pipe: source may hold them). Then every
    micro-batch runs it (a placeholder video where it holds none), on every rank alike."""
    return model_type in VIDEO_MODELS and any(ds.manifest is None or (ds.manifest.get("totals") or {}).get("videos")
                                              for ds in datasets)


def arrays_of(version: int) -> list[str]:
    return [n for n, (_, _, since) in NPY_MEMBERS.items() if since <= version]


def check_member_names(names, *, url: str, key: str, version: int) -> None:
    for name in names:
        if version >= 3 and VIDEO_MEMBER.match(name):
            continue
        if name not in arrays_of(version) and name != META_MEMBER and not IMAGE_MEMBER[version].match(name):
            raise DataError(f"{url}: sample {key}: member {name!r} is not part of the vlmprep shard format "
                            f"v{version}; refusing to decode it (this reader never unpickles: .pyd, .pth, .pickle "
                            "are never loaded)")
    missing = [n for n in (*arrays_of(version), META_MEMBER) if n not in names]
    if missing:
        raise DataError(f"{url}: sample {key}: missing members {', '.join(missing)}")


def _load_npy(data: bytes, name: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:  # an object array is a pickle inside the .npy
        raise ValueError(f"{name}: {e}; refusing to unpickle") from None


def _npy(data: bytes, name: str) -> np.ndarray:
    dtype, ndim, _ = NPY_MEMBERS[name]
    arr = _load_npy(data, name)
    if arr.dtype != dtype or arr.ndim != ndim:
        raise ValueError(f"{name} is {arr.dtype} with {arr.ndim} dims, expected {np.dtype(dtype)} with {ndim}")
    return arr


class OriginalResizer:
    """`img*.orig.*` members hold source bytes: resize them at load time with the saved processor's own
    resize, exactly as vlmprep did when it counted the tokens."""

    def __init__(self, spec: ImageSpec):
        self.spec = spec
        self._ip = None

    def __call__(self, data: bytes) -> np.ndarray:
        import torch

        if self._ip is None:
            from transformers import AutoImageProcessor

            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "preprocessor_config.json").write_text(json.dumps(self.spec.config))
                self._ip = AutoImageProcessor.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        ip = self._ip
        with Image.open(io.BytesIO(data)) as pil:
            pil.load()
            with torch.no_grad():
                t = ip.process_image(pil, do_convert_rgb=ip.do_convert_rgb)
                t = ip.resize(t[None], size=ip.size, resample=ip.resample, factor=ip.patch_size * ip.merge_size)[0]
        return np.ascontiguousarray(t.permute(1, 2, 0).numpy())


def decode_image(name: str, data: bytes, resize_original: OriginalResizer) -> np.ndarray:
    """A PNG / WebP / `orig.*` member -> uint8 H x W x 3 (`.npy.zst` members go through _read_npy_zst_into)."""
    if ".orig." in name:
        arr = resize_original(data)
    else:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.array(im.convert("RGB"))
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"{name} decodes to {arr.dtype} {arr.shape}, expected uint8 H x W x 3")
    return arr


def _image_layout(meta: dict, members: dict[str, bytes],
                  image_index: np.ndarray | None) -> tuple[list[tuple[str, int, int]], list[int]]:
    """Unique image members in first-use order with their stored (height, width), and occurrence -> unique.
    v2 samples carry the occurrence -> member map (image_index.npy); it must agree with the meta's."""
    if image_index is not None:
        stored = [f"img{int(u):03d}." for u in image_index]
        named = [im["member"] for im in meta["images"]]
        if len(stored) != len(named) or any(not m.startswith(p) for p, m in zip(stored, named)):
            raise ValueError(f"image_index.npy {image_index.tolist()} disagrees with the meta's image members {named}")
    unique: dict[str, int] = {}
    layout: list[tuple[str, int, int]] = []
    index: list[int] = []
    for im in meta["images"]:
        member = im["member"]
        if member not in unique:
            if member not in members:
                raise ValueError(f"meta names image member {member!r} that the sample does not have")
            h, w = int(im["height"]), int(im["width"])
            if h <= 0 or w <= 0 or h * w * 3 > MAX_IMAGE_BYTES:
                raise ValueError(f"meta gives image member {member!r} an impossible size {h}x{w}")
            unique[member] = len(layout)
            layout.append((member, h, w))
        index.append(unique[member])
    return layout, index


def _video_layout(meta: dict, members: dict[str, bytes], n_grids: int) -> list[list[tuple[str, int, int]]]:
    """Per video (token order) its frame members with their stored (height, width), as the meta lists them; every
    frame member of the sample must belong to one."""
    videos = meta.get("videos", [])
    if len(videos) != n_grids:
        raise ValueError(f"meta lists {len(videos)} videos, video_grid_thw has {n_grids} rows")
    by_frame: dict[str, list[str]] = {}  # "vidVVV.FFFF" -> its members (one, unless a frame is stored twice)
    for m in members:
        if VIDEO_MEMBER.match(m):
            by_frame.setdefault(m[:11], []).append(m)
    out = []
    for v, vid in enumerate(videos):
        member, n, h, w = vid["member"], int(vid["frames"]), int(vid["height"]), int(vid["width"])
        if member != f"vid{v:03d}" or n <= 0 or h <= 0 or w <= 0 or n * h * w * 3 > MAX_IMAGE_BYTES:
            raise ValueError(f"meta gives video {v} an impossible entry {member!r}, {n} frames of {h}x{w}")
        frames = []
        for f in range(n):
            found = by_frame.pop(f"{member}.{f:04d}", [])
            if len(found) != 1:
                raise ValueError(f"video {v}: frame {f} has {len(found)} members, expected 1")
            frames.append((found[0], h, w))
        out.append(frames)
    if by_frame:
        raise ValueError(f"frame members {sorted(m for ms in by_frame.values() for m in ms)[:3]} belong to no video "
                         "in the meta")
    return out


def _decoded_size(name: str, data: bytes, h: int, w: int) -> int:
    """Bytes an image member decodes to: a zstd frame's declared size (npy header + pixels), else the pixels."""
    if not name.endswith(".npy.zst"):
        return h * w * 3
    size = zstandard.frame_content_size(data)
    if not h * w * 3 < size <= h * w * 3 + 4096:
        raise ValueError(f"{name} declares {size} decompressed bytes, not a {h}x{w}x3 uint8 .npy as its meta says")
    return size


def _read_npy_zst_into(data: bytes, buf: np.ndarray, shape: tuple[int, int, int], name: str) -> np.ndarray:
    """A zstd-compressed uint8 .npy decompressed in one pass into `buf` (header + pixels); returns the pixel view.
    The header is checked before the pixels are used, and nothing is ever unpickled."""
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    view, got = memoryview(buf), 0
    while got < buf.size:
        n = reader.readinto(view[got:])
        if n == 0:
            raise ValueError(f"{name}: stream ends after {got} of {buf.size} bytes")
        got += n
    if reader.read(1):
        raise ValueError(f"{name}: data after the array")
    header = buf[:buf.size - shape[0] * shape[1] * 3].tobytes()
    fast = _NPY_RGB_HEADER.match(header)
    if fast and int.from_bytes(header[8:10], "little") == len(header) - 10:
        dims, fortran, dtype = (int(fast.group(1)), int(fast.group(2)), 3), False, np.dtype(np.uint8)
    else:
        f = io.BytesIO(header)
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                raise ValueError(f"unsupported .npy version {version}")
            dims, fortran, dtype = read_header[version](f)
        except ValueError as e:
            raise ValueError(f"{name}: not a uint8 {shape} .npy as its meta says ({e})") from None
        if f.read(1):
            raise ValueError(f"{name}: header and pixels disagree in length")
    if dtype != np.uint8 or fortran or tuple(dims) != shape:
        raise ValueError(f"{name} holds {dtype} {tuple(dims)}, expected uint8 {shape} as its meta says")
    return buf[len(header):].reshape(shape)


def decode_image_into(name: str, data: bytes, buf: np.ndarray, shape: tuple[int, int, int],
                      resize_original: OriginalResizer) -> np.ndarray:
    """Decode one stored image into `buf` (sized by _decoded_size); returns the uint8 H x W x 3 view."""
    if name.endswith(".npy.zst"):
        return _read_npy_zst_into(data, buf, shape, name)
    arr = decode_image(name, data, resize_original)
    if arr.shape != shape:
        raise ValueError(f"{name} decodes to {arr.shape}, but the meta says {shape}")
    out = buf.reshape(shape)
    out[...] = arr
    return out


def decode_sample(members: dict[str, bytes], *, key: str, url: str, spec: ImageSpec,
                  resize_original: OriginalResizer, alloc=None) -> DecodedSample:
    """`alloc(sizes) -> uint8 arrays` gives the buffers the sample's images are decoded into: by default one array
    each (freed heap is reused); a DataLoader worker passes views of one shared-memory slab."""
    version = sample_version(members)
    check_member_names(members, url=url, key=key, version=version)
    try:
        arrays = {name: _npy(members[name], name) for name in arrays_of(version)}
        meta = json.loads(members[META_MEMBER].decode("utf-8"))
        layout, index = _image_layout(meta, members, arrays.get("image_index.npy"))
        grids = arrays.get("video_grid_thw.npy", np.zeros((0, 3), np.int32))
        video_layout = _video_layout(meta, members, len(grids)) if version >= 3 else []
        frames = [f for v in video_layout for f in v]
        # One alloc for images and frames: a DataLoader worker's slab holds all of the sample's pixels.
        buffers = (alloc or _alloc)([_decoded_size(m, members[m], h, w) for m, h, w in layout + frames])
        decoded = [decode_image_into(m, members[m], buf, (h, w, 3), resize_original)
                   for (m, h, w), buf in zip(layout + frames, buffers)]
        images, rest = decoded[:len(layout)], iter(decoded[len(layout):])
        videos = [[next(rest) for _ in v] for v in video_layout]
        sample = DecodedSample(key=key, id=str(meta["id"]), input_ids=arrays["input_ids.npy"],
                               loss_mask=arrays["loss_mask.npy"], mm_token_type_ids=arrays["mm_token_type_ids.npy"],
                               position_ids=arrays["position_ids.npy"], image_grid_thw=arrays["image_grid_thw.npy"],
                               images=images, image_index=index, video_grid_thw=grids,
                               second_per_grid_ts=arrays.get("second_per_grid_ts.npy", np.zeros(0, np.float32)),
                               videos=videos)
        _validate(sample, meta, spec)
    except (ValueError, KeyError, TypeError, OSError, zstandard.ZstdError) as e:
        raise DataError(f"{url}: sample {key}: {type(e).__name__}: {e}") from None
    return sample


def _alloc(sizes: list[int]) -> list[np.ndarray]:
    return [np.empty(n, dtype=np.uint8) for n in sizes]


def _validate(s: DecodedSample, meta: dict, spec: ImageSpec) -> None:
    n = s.num_tokens
    if s.loss_mask.shape != (n,) or s.mm_token_type_ids.shape != (n,) or s.position_ids.shape != (3, n):
        raise ValueError(f"member lengths disagree with input_ids length {n}")
    grids = s.image_grid_thw
    if grids.shape != (len(s.image_index), 3):
        raise ValueError(f"image_grid_thw has shape {grids.shape} for {len(s.image_index)} image occurrences")
    for k, u in enumerate(s.image_index):
        h, w = s.images[u].shape[:2]
        if spec.grid(h, w) != tuple(int(x) for x in grids[k]) or (h, w) != (meta["images"][k]["height"],
                                                                           meta["images"][k]["width"]):
            raise ValueError(f"image {k} is {h}x{w} (grid {spec.grid(h, w)}), but the sample stores grid "
                             f"{grids[k].tolist()} and meta {meta['images'][k]['height']}x{meta['images'][k]['width']}")
    n_image_tokens = int(grids.prod(axis=1).sum()) // spec.merge_size ** 2 if len(grids) else 0
    if int((s.mm_token_type_ids == 1).sum()) != n_image_tokens:
        raise ValueError(f"{int((s.mm_token_type_ids == 1).sum())} image tokens but the grids need {n_image_tokens}")
    vgrids, vspec = s.video_grid_thw, spec.video or spec
    if s.second_per_grid_ts.shape != (len(vgrids),):
        raise ValueError(f"second_per_grid_ts has shape {s.second_per_grid_ts.shape} for {len(vgrids)} videos")
    for v, frames in enumerate(s.videos):
        h, w = frames[0].shape[:2]
        t = -(-len(frames) // vspec.temporal_patch_size)
        if (t, *vspec.grid(h, w)[1:]) != tuple(int(x) for x in vgrids[v]):
            raise ValueError(f"video {v} is {len(frames)} frames of {h}x{w} (grid {(t, *vspec.grid(h, w)[1:])}), "
                             f"but the sample stores grid {vgrids[v].tolist()}")
    n_video_tokens = int(vgrids.prod(axis=1).sum()) // vspec.merge_size ** 2 if len(vgrids) else 0
    if int((s.mm_token_type_ids == 2).sum()) != n_video_tokens:
        raise ValueError(f"{int((s.mm_token_type_ids == 2).sum())} video tokens but the grids need {n_video_tokens}")
