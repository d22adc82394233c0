"""Decode: one sample's raw tar members -> DecodedSample (numpy only). The only decoders are npy (never unpickled),
json and image bytes; members are checked against the shard format's one member-name rule
(schemas/shard_format.schema.json, shared with vlmprep) first, so nothing unknown is read and nothing unpickled, and
each member against the meta and the format's reader limits before it is decoded or memory is allocated for it (json
size and depth, .npy header shape and length, zstd content size, image header size, grids against the image sizes).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

import numpy as np
import zstandard
from PIL import Image

from trainer.data.errors import DataError
from trainer.data.jpeg import JpegHeader, jpeg_header
from trainer.data.originals import OriginalResizer, views_layout
from trainer.data.vision import ImageSpec
from vlmprep_schemas import load
from vlmprep_schemas.delta import PDELTA, ZSTD_IMAGE, decompressor, pdelta_prefixes, unfilter_into
from vlmprep_schemas.limits import (
    LIMITS,
    check_grid_sizes,
    dtype_name,
    load_json,
    load_npy,
    npy_header,
    schema_problem,
)
from vlmprep_schemas.resize import strict_load
from vlmprep_schemas.tar_members import sample_version
from vlmprep_schemas.views import VIEWS_MEMBER

_FORMAT = load("shard_format.schema.json")
META_MEMBER = _FORMAT["meta_member"]
# (dtype, ndim, first format version that has it)
NPY_MEMBERS = {name: (np.dtype(a["dtype"]), a["ndim"], a["since"]) for name, a in _FORMAT["arrays"].items()}
# Each array's shape in the meta's terms: L = num_tokens, N = image occurrences, V = videos.
NPY_SHAPES = {name: tuple(a["shape"]) for name, a in _FORMAT["arrays"].items()}
IMAGE_MEMBER = {
    5: re.compile(_FORMAT["$defs"]["image_member"]["pattern"]),
    4: re.compile(_FORMAT["$defs"]["image_member"]["pattern"]),  # v4 added .pdelta.zst
    3: re.compile(_FORMAT["$defs"]["image_member_v2"]["pattern"]),
    2: re.compile(_FORMAT["$defs"]["image_member_v2"]["pattern"]),
    1: re.compile(_FORMAT["$defs"]["image_member_v1"]["pattern"]),
}
VIDEO_MEMBER = re.compile(_FORMAT["$defs"]["video_member"]["pattern"])  # format v3
# Model types whose video path (pixel_values_videos, packed video segments) matches online processing in tests.
VIDEO_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
NO_VIDEO = (
    "this trainer trains video samples only for model types {} (loss parity verified); train this model on "
    "a dataset without video parts"
).format(", ".join(VIDEO_MODELS))
MAX_IMAGE_BYTES = LIMITS.image_bytes  # a decoded image or frame larger than this is corrupt, not a screenshot
# The .npy header vlmprep writes for an image, matched instead of running numpy's literal_eval header parser.
_NPY_RGB_HEADER = re.compile(
    rb"\x93NUMPY\x01\x00..\{'descr': '\|u1', 'fortran_order': False, "
    rb"'shape': \((\d{1,6}), (\d{1,6}), 3\), \} *\n\Z",
    re.DOTALL,
)


@dataclass
class DecodedSample:
    """One sample read from a shard: its token arrays, unique images and video frames as numpy arrays (decoded and
    resized, not yet tensors), with its key, id and place in the rank's stream."""

    key: str
    id: str
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    mm_token_type_ids: np.ndarray  # uint8 [L]
    position_ids: np.ndarray  # int32 [3, L]
    image_grid_thw: np.ndarray  # int32 [N, 3], one row per occurrence
    images: list[np.ndarray]  # unique stored images, uint8 H x W x 3, already resized
    image_index: list[int]  # occurrence -> images
    # Per unique image, for a kept photo loaded from its views (format v5): (canvas, global view) sizes, its images
    # entry their packed array (vlmprep_schemas.views); None for every other image. Empty: none has views.
    views: list[tuple[tuple[int, int], tuple[int, int]] | None] = field(default_factory=list)
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))  # int32 [V, 3]
    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # float32 [V]
    videos: list[list[np.ndarray]] = field(default_factory=list)  # per video its frames, uint8 H x W x 3, resized
    position: int = -1  # index in the rank's sample stream (set by the reader)
    worker: int = -1  # DataLoader worker that decoded it
    source: int = 0  # index of its dataset in a mixture

    @property
    def num_tokens(self) -> int:
        """The sample's length in tokens."""
        return int(self.input_ids.shape[0])


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
    return model_type in VIDEO_MODELS and any(
        ds.manifest is None or (ds.manifest.get("totals") or {}).get("videos") for ds in datasets
    )


def arrays_of(version: int) -> list[str]:
    """The .npy members a sample of shard format `version` holds."""
    return [n for n, (_, _, since) in NPY_MEMBERS.items() if since <= version]


def check_member_names(names, *, url: str, key: str, version: int) -> None:
    """Refuses (DataError naming `url` and `key`) any member name outside the shard format `version`: nothing else in
    a shard is ever decoded (no pickle, no code); a required member that is missing is refused too."""
    arrays = arrays_of(version)
    for name in names:
        if version >= 3 and VIDEO_MEMBER.match(name) or version >= 5 and VIEWS_MEMBER.match(name):
            continue
        if name not in arrays and name != META_MEMBER and not IMAGE_MEMBER[version].match(name):
            raise DataError(
                f"{url}: sample {key}: member {name!r} is not part of the vlmprep shard format "
                f"v{version}; refusing to decode it (this reader never unpickles: .pyd, .pth, .pickle "
                "are never loaded)"
            )
    missing = missing_members(names, version)
    if missing:
        raise DataError(f"{url}: sample {key}: missing members {', '.join(missing)}")


def missing_members(names, version: int) -> list[str]:
    """The members every sample of format `version` holds that `names` lacks."""
    return [n for n in (*arrays_of(version), META_MEMBER) if n not in names]


def _npy(data: bytes, name: str, dims: dict[str, int]) -> np.ndarray:
    """An array member, its header checked first (vlmprep_schemas.limits.load_npy): dtype as the format says, shape as
    the meta says (`dims`), data exactly as long as declared; so a header declaring an enormous shape allocates
    nothing, and nothing is unpickled."""
    dtype, _, _ = NPY_MEMBERS[name]
    return load_npy(data, name, dtype, tuple(dims[d] if isinstance(d, str) else d for d in NPY_SHAPES[name]))


# The meta fields decode_sample reads (their types and bounds are checked; `vlmprep verify` checks the rest).
_DIMS = ("member", "height", "width")
META_READ = ("id", "num_tokens", ("images", (*_DIMS, "prefix", "views")), ("videos", (*_DIMS, "frames")))
_SAMPLE_FAULTS = (ValueError, KeyError, TypeError, OSError, ArithmeticError)  # a sample's bytes at fault
_SAMPLE_FAULTS += (zstandard.ZstdError, Image.DecompressionBombError)


def _meta_dims(meta) -> dict[str, int]:
    """The meta's sizes that array shapes are given in, once its types are checked against the meta schema."""
    problem = schema_problem(meta, "sample_meta.schema.json", META_READ)
    if problem:
        raise ValueError(f"meta: {problem}")
    return {"L": meta["num_tokens"], "N": len(meta["images"]), "V": len(meta.get("videos", ()))}


def decode_image(
    name: str,
    data: bytes,
    resize_original: OriginalResizer,
    opened: Image.Image | JpegHeader | None = None,
    size: tuple[int, int] | None = None,
) -> np.ndarray:
    """A PNG / WebP / `orig.*` member (not a zstd one) -> uint8 H x W x 3; opened: its header, _decoded_size's;
    size: the meta's height x width of it."""
    with strict_load():  # a cut-off image is an error here, whatever set PIL's process-wide flag
        if ".orig." not in name:
            with opened or Image.open(io.BytesIO(data)) as im:
                arr = np.array(im.convert("RGB"))
        else:
            arr = resize_original(data, opened, size)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"{name} decodes to {arr.dtype} {arr.shape}, expected uint8 H x W x 3")
    return arr


def _image_layout(
    meta: dict, members: dict[str, bytes], image_index: np.ndarray | None
) -> tuple[list[tuple[str, int, int]], list[int]]:
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
        member, h, w = im["member"], int(im["height"]), int(im["width"])
        if member not in unique:
            if member not in members:
                raise ValueError(f"meta names image member {member!r} that the sample does not have")
            if h <= 0 or w <= 0 or h * w * 3 > MAX_IMAGE_BYTES:
                raise ValueError(f"meta gives image member {member!r} an impossible size {h}x{w}")
            unique[member] = len(layout)
            layout.append((member, h, w))
        if layout[unique[member]][1:] != (h, w):
            raise ValueError(f"meta gives image member {member!r} two sizes, {layout[unique[member]][1:]} and {(h, w)}")
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
        if member != f"vid{v:03d}" or n <= 0 or h <= 0 or w <= 0 or h * w * 3 > MAX_IMAGE_BYTES:
            raise ValueError(f"meta gives video {v} an impossible entry {member!r}, {n} frames of {h}x{w}")
        frames = []
        for f in range(n):  # each frame found is popped: a count the members do not hold ends at the first missing
            found = by_frame.pop(f"{member}.{f:04d}", [])
            if len(found) != 1:
                raise ValueError(f"video {v}: frame {f} has {len(found)} members, expected 1")
            frames.append((found[0], h, w))
        out.append(frames)
    if by_frame:
        raise ValueError(
            f"frame members {sorted(m for ms in by_frame.values() for m in ms)[:3]} belong to no video in the meta"
        )
    return out


def _decoded_size(
    name: str, data: bytes, h: int, w: int, opened: dict[str, Image.Image | JpegHeader] | None = None
) -> int:
    """Bytes an image member decodes to: a zstd frame's declared size (npy header + pixels), else the pixels; its
    declared size (frame content size, image header) checked against the meta's h x w before anything is decoded
    (an `orig.*` source, resized at load time, against the image limit). Its header read is kept in `opened`."""
    if not name.endswith(ZSTD_IMAGE):
        head = jpeg_header(data) if ".orig." in name else None  # a kept photo: its frame header, without PIL
        im = head or Image.open(io.BytesIO(data))  # the header only
        width, height = (head.width, head.height) if head else im.size
        if opened is not None:
            opened[name] = im
        elif not head:
            im.close()
        if ".orig." in name and width * height * 4 > MAX_IMAGE_BYTES:
            raise ValueError(f"{name} declares {width}x{height}, more pixels than a reader decodes")
        if ".orig." not in name and (height, width) != (h, w):
            raise ValueError(f"{name} declares {width}x{height}, but its meta gives {w}x{h}")
        return h * w * 3
    size = zstandard.frame_content_size(data)
    if not h * w * 3 < size <= h * w * 3 + 4096:
        raise ValueError(f"{name} declares {size} decompressed bytes, not a {h}x{w}x3 uint8 .npy as its meta says")
    return size


def _read_npy_zst_into(
    data: bytes, buf: np.ndarray, shape: tuple[int, int, int], name: str, prefix: bytes | None = None
) -> np.ndarray:
    """A zstd-compressed uint8 .npy decompressed in one pass into `buf` (header + pixels); returns the pixel view.
    The header is checked before the pixels are used, and nothing is ever unpickled. prefix: a `.pdelta.zst`
    member's dictionary (the payload of the member its meta names)."""
    reader = decompressor(prefix).stream_reader(data)
    view, got = memoryview(buf), 0
    while got < buf.size:
        n = reader.readinto(view[got:])
        if n == 0:
            raise ValueError(f"{name}: stream ends after {got} of {buf.size} bytes")
        got += n
    if reader.read(1):
        raise ValueError(f"{name}: data after the array")
    header = buf[: buf.size - shape[0] * shape[1] * 3].tobytes()
    fast = _NPY_RGB_HEADER.match(header)
    if fast and int.from_bytes(header[8:10], "little") == len(header) - 10:
        descr, fortran, dims = "|u1", False, (int(fast.group(1)), int(fast.group(2)), 3)
    else:
        descr, fortran, dims, end = npy_header(header, name)
        if end != len(header):
            raise ValueError(f"{name}: header and pixels disagree in length")
    if descr != "|u1" or fortran or dims != shape:
        raise ValueError(f"{name} holds {dtype_name(descr)} {dims}, expected uint8 {shape} as its meta says")
    return buf[len(header) :].reshape(shape)


def decode_image_into(
    name: str,
    data: bytes,
    buf: np.ndarray,
    shape: tuple[int, int, int],
    resize_original: OriginalResizer,
    prefix: bytes | None = None,
    keep: dict[str, bytes] | None = None,
    opened: Image.Image | JpegHeader | None = None,
) -> np.ndarray:
    """Decode one stored image into `buf` (sized by _decoded_size); returns the uint8 H x W x 3 view. prefix: a
    `.pdelta.zst` member's dictionary; keep: where its payload goes when a later member names it as prefix; opened:
    the member as _decoded_size opened it."""
    if name.endswith(".npy.zst"):
        return _read_npy_zst_into(data, buf, shape, name)
    if name.endswith((".delta.zst", PDELTA)):  # a .npy.zst whose rows are filtered: undone from a copy into the view
        view = _read_npy_zst_into(data, buf, shape, name, prefix)
        if keep is not None:
            keep[name] = buf.tobytes()
        return unfilter_into(view.reshape(shape[0], 3, shape[1]).copy(), view)
    arr = decode_image(name, data, resize_original, opened, shape[:2])
    if arr.shape != shape:
        raise ValueError(f"{name} decodes to {arr.shape}, but the meta says {shape}")
    out = buf.reshape(shape)
    out[...] = arr
    return out


def decode_sample(
    members: dict[str, bytes], *, key: str, url: str, spec: ImageSpec, resize_original: OriginalResizer, alloc=None
) -> DecodedSample:
    """`alloc(sizes) -> uint8 arrays` gives the buffers the sample's images are decoded into: by default one array
    each (freed heap is reused); a DataLoader worker passes views of one shared-memory slab."""
    version = sample_version(members)
    check_member_names(members, url=url, key=key, version=version)
    try:
        meta = load_json(members[META_MEMBER], "the meta", LIMITS.meta_bytes)
        dims = _meta_dims(meta)
        arrays = {name: _npy(members[name], name, dims) for name in arrays_of(version)}
        layout, index = _image_layout(meta, members, arrays.get("image_index.npy"))
        grids = arrays.get("video_grid_thw.npy", np.zeros((0, 3), np.int32))
        video_layout = _video_layout(meta, members, len(grids)) if version >= 3 else []
        frames = [f for v in video_layout for f in v]
        _validate(arrays, layout, index, video_layout, spec)
        views, layout = views_layout(meta, members, layout, spec) if version >= 5 else ([], layout)
        opened: dict[str, Image.Image | JpegHeader] = {}
        sizes = [_decoded_size(m, members[m], h, w, opened) for m, h, w in layout + frames]
        if sum(sizes) > LIMITS.sample_bytes:
            raise ValueError(
                f"its images and frames decode to {sum(sizes)} bytes, more than a reader accepts "
                f"({LIMITS.sample_bytes})"
            )
        # One alloc for images and frames: a DataLoader worker's slab holds all of the sample's pixels.
        prefixes = pdelta_prefixes(meta["images"], members) if version >= 4 else {}
        buffers = (alloc or _alloc)(sizes)
        items = list(zip(layout + frames, buffers))
        decoded, payloads = [None] * len(items), {}  # payloads: of decoded members a later one names as its prefix
        # Images in member order, whatever order the occurrences list them in: a .pdelta.zst member's prefix (the
        # member before it) is then decoded just before it, so each payload is held until the next one only.
        for i in sorted(range(len(layout)), key=lambda u: layout[u][0]) + list(range(len(layout), len(items))):
            (m, h, w), buf = items[i]
            if m in prefixes and prefixes[m] not in payloads:
                raise ValueError(f"{m}'s prefix {prefixes[m]} is not decoded before it (images decode in member order)")
            try:
                decoded[i] = decode_image_into(
                    m,
                    members[m],
                    buf,
                    (h, w, 3),
                    resize_original,
                    payloads.pop(prefixes.get(m), None),
                    payloads if m in prefixes.values() else None,
                    opened.pop(m, None),
                )
            except zstandard.ZstdError as e:  # named: a .pdelta.zst member decodes only with its own prefix
                raise ValueError(f"{m} does not decode ({e})") from None
        images, rest = decoded[: len(layout)], iter(decoded[len(layout) :])
        videos = [[next(rest) for _ in v] for v in video_layout]
        sample = DecodedSample(
            key=key,
            id=str(meta["id"]),
            input_ids=arrays["input_ids.npy"],
            loss_mask=arrays["loss_mask.npy"],
            mm_token_type_ids=arrays["mm_token_type_ids.npy"],
            position_ids=arrays["position_ids.npy"],
            image_grid_thw=arrays["image_grid_thw.npy"],
            images=images,
            image_index=index,
            views=views,
            video_grid_thw=grids,
            second_per_grid_ts=arrays.get("second_per_grid_ts.npy", np.zeros(0, np.float32)),
            videos=videos,
        )
    except _SAMPLE_FAULTS as e:
        raise DataError(f"{url}: sample {key}: {type(e).__name__}: {e}") from None
    return sample


def _alloc(sizes: list[int]) -> list[np.ndarray]:
    return [np.empty(n, dtype=np.uint8) for n in sizes]


def _validate(
    arrays: dict[str, np.ndarray],
    layout: list[tuple[str, int, int]],
    index: list[int],
    video_layout: list[list[tuple[str, int, int]]],
    spec: ImageSpec,
) -> None:
    """Before anything is allocated: each image's and video's size (the meta's; every member is checked to decode to
    exactly that) makes the stored grid, and the grids make the placeholder counts. Array lengths already agree (each
    array's shape was checked against the meta)."""
    grids, types = arrays["image_grid_thw.npy"], arrays["mm_token_type_ids.npy"]
    check_grid_sizes([layout[u][1:] for u in index], grids, patch=spec.patch_size)
    n_image_tokens = int(grids.prod(axis=1).sum()) // spec.merge_size**2 if len(grids) else 0
    if spec.grid_images and int((types == 1).sum()) != n_image_tokens:  # other families: their processor's count
        raise ValueError(f"{int((types == 1).sum())} image tokens but the grids need {n_image_tokens}")
    vgrids = arrays.get("video_grid_thw.npy", np.zeros((0, 3), np.int32))
    vspec = spec.video or spec
    for v, frames in enumerate(video_layout):
        _, h, w = frames[0]
        t = -(-len(frames) // vspec.temporal_patch_size)
        if (t, *vspec.grid(h, w)[1:]) != tuple(int(x) for x in vgrids[v]):
            raise ValueError(
                f"video {v} is {len(frames)} frames of {h}x{w} (grid {(t, *vspec.grid(h, w)[1:])}), "
                f"but the sample stores grid {vgrids[v].tolist()}"
            )
    n_video_tokens = int(vgrids.prod(axis=1).sum()) // vspec.merge_size**2 if len(vgrids) else 0
    if int((types == 2).sum()) != n_video_tokens:
        raise ValueError(f"{int((types == 2).sum())} video tokens but the grids need {n_video_tokens}")
