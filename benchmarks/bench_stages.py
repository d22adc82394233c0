"""Stage benchmark: a 1-worker build's record path cut into its stages (JSON parse, base64 + normalize, image header,
image decode, resize, encode, tokenize, render + mask, split search, tar write, hashing), each timed beside its floor,
the least work that stage needs, measured in the same run on the same data; then the whole record path
(Renderer.process + ShardWriter.write) against the sum of the floors (docs/performance.md's stage table). Two shapes:
the demo agent traces (`shape: traces`) and short VQA records (`shape: short_vqa`, LLaMA-Factory's demo chats: 1-2
small JPEGs each, where the per-record Python around the floors weighs most). Each figure is the median over
interleaved repetitions: the stage, then its floor, on a box shared with other jobs."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import statistics
import tempfile
from pathlib import Path

from benchmarks.bench_build import build_config
from benchmarks.bench_limits import _best
from benchmarks.emit import emit
from benchmarks.inputs import OUT, jsonl_zst, traces, vqa_demo

GOAL_RECORD_PATH = 1.5  # the whole record path over the sum of its stages' floors
_DATA_URI = re.compile(rb'"data:image/[a-z]+;base64,([A-Za-z0-9+/=]+)"')


def _pair(stage, floor, reps: int) -> tuple[float, float]:
    """Median seconds of `stage` and of `floor`, run alternately so both see the same neighbours."""
    a, b = [], []
    for _ in range(reps):
        a.append(_best(stage, 1))
        b.append(_best(floor, 1))
    return statistics.median(a), statistics.median(b)


def _row(stage: str, unit: str, n: float, seconds: float, floor_seconds: float, floor: str, **extra) -> dict:
    per = 1e3 / n if n else 0.0
    return emit(
        "stages",
        metric="stage",
        stage=stage,
        unit=unit,
        n=round(n, 1),
        ms=round(seconds * per, 3),
        floor_ms=round(floor_seconds * per, 3),
        floor=floor,
        ratio=round(seconds / floor_seconds, 2) if floor_seconds else None,
        **extra,
    )


def run(quick: bool, n: int | None = None) -> list[dict]:
    """Both shapes: the demo traces, then the short VQA records (skipped where ../shared/data is absent)."""
    rows = _run_shape(quick, n, "traces")
    recs = vqa_demo(1 if quick else 32)
    if not recs:
        return rows + [emit("stages", metric="skipped", shape="short_vqa", why="../shared/data not found")]
    return rows + _run_shape(quick, n, "short_vqa", jsonl_zst(recs, OUT / "inputs" / f"vqa-{len(recs)}.jsonl.zst"))


def _run_shape(quick: bool, n: int | None, shape: str, inp: Path | None = None) -> list[dict]:
    import numpy as np
    import torch
    import zstandard
    from PIL import Image

    from vlmprep import process as process_module
    from vlmprep.ingest.normalize import normalize_record
    from vlmprep.ingest.records import iter_records, parse_record
    from vlmprep.pixels.images import _resize, decode_image, encode_image, open_image
    from vlmprep.process import Renderer
    from vlmprep.processors.load import load_processor
    from vlmprep.render.sample import _expand_images, render_conversation
    from vlmprep.render.tokens import shorten_runs
    from vlmprep.shards.writer import ShardWriter
    from vlmprep.types import PreparedImage
    from vlmprep_schemas.delta import PDELTA_MIN_LEVEL
    from vlmprep_schemas.resize import processed

    torch.set_num_threads(1)  # one worker's core
    n = n or (3 if quick else 16)
    reps = 3 if quick else 5
    size = (320, 200) if quick else (1280, 720)
    seq_len = 2048 if quick else 16384
    settings = f"--long-traces split --seq-len {seq_len}, {size[0]}x{size[1]} screenshots"
    if inp is None:
        inp = traces(n, width=size[0], height=size[1])
    else:
        seq_len, settings = 4096, "--long-traces split --seq-len 4096, LLaMA-Factory's demo chats (1-2 JPEGs each)"
    cfg = build_config(inp, Path(tempfile.mkdtemp()), seq_len=seq_len, long_traces="split")
    renderer = Renderer(cfg, load_processor(cfg.processor))
    ctx, proc, family = renderer.ctx, renderer.processor, renderer.ctx.family
    raws = list(iter_records([inp]))
    lines = [raw.text for raw in raws]
    samples_by_record = [renderer.render(raw) for raw in raws]  # warm-up too: jinja compile, first resize
    datas = [parse_record(raw) for raw in raws]
    convs = [normalize_record(d, raw.source, renderer.norm) for d, raw in zip(datas, raws)]
    images = [im for conv in convs for im in conv.images]
    payloads = [m.group(1) for line in lines for m in _DATA_URI.finditer(line)]
    kept = list({id(im): im for samples in samples_by_record for s in samples for im in s.images}.values())
    samples = [s for ss in samples_by_record for s in ss]
    rows, floor_fns = [], {}
    opts = dict(max_pixels=cfg.max_image_pixels, min_side=cfg.min_image_side)

    def stage(name, unit, count, fn, floor_fn, floor_name, **extra):
        s, f = _pair(fn, floor_fn, reps)
        floor_fns[name] = floor_fn
        rows.append(_row(name, unit, count, s, f, floor_name, shape=shape, **extra))
        return s

    stage(
        "json_parse",
        "ms per record",
        len(raws),
        lambda: [parse_record(r) for r in raws],
        lambda: [json.loads(line) for line in lines],
        "json.loads of the same lines",
        images=len(images),
    )
    stage(
        "normalize_base64",
        "ms per image",
        len(images),
        lambda: [normalize_record(d, raw.source, renderer.norm) for d, raw in zip(datas, raws)],
        lambda: [base64.b64decode(p) for p in payloads],
        "base64.b64decode of the image payloads",
    )
    stage(
        "image_header",
        "ms per image",
        len(images),
        lambda: [open_image(im, proc, family, **opts, shapes=shapes) for shapes in [{}] for im in images],
        lambda: [Image.open(io.BytesIO(im.data)).size for im in images],
        "PIL Image.open (header only)",
    )
    sources = [im.source for im in kept]
    stage(
        "image_decode",
        "ms per kept image",
        len(kept),
        lambda: [decode_image(s, **opts) for s in sources],
        lambda: [Image.open(io.BytesIO(s.data)).load() for s in sources],
        "PIL open + load of the same bytes",
    )
    pils = [decode_image(s, **opts) for s in sources]
    views = [torch.from_numpy(np.asarray(p).copy()).permute(2, 0, 1) for p in pils]
    shapes = [im.pixels.shape[:2] for im in kept]

    def resize_all():
        with torch.no_grad():
            return [
                np.ascontiguousarray(
                    _resize(proc, family, processed(proc.image_processor, p), *p.size).permute(1, 2, 0).numpy()
                )
                for p in pils
            ]

    def kernel_only():
        with torch.no_grad():
            return [
                torch.nn.functional.interpolate(v[None], size=hw, mode="bicubic", antialias=True)
                for v, hw in zip(views, shapes)
            ]

    stage(
        "resize",
        "ms per kept image",
        len(kept),
        resize_all,
        kernel_only,
        "torch bicubic antialias kernel alone on the decoded pixels (channels last)",
    )
    pixels = [PreparedImage(pixels=im.pixels, grid_thw=im.grid_thw, source=im.source) for im in kept]
    level = cfg.zstd_level
    # The floor compresses at the level the format itself uses (zstd-pdelta raises it to PDELTA_MIN_LEVEL for an image
    # stored against the one before; a sample's first keeps `level`): what the chosen output costs, not a cheaper one's.
    later = max(level, PDELTA_MIN_LEVEL) if cfg.image_format == "zstd-pdelta" else level
    firsts = {id(s.images[0]) for s in samples if s.images}
    compressors = {lv: zstandard.ZstdCompressor(level=lv) for lv in (level, later)}
    levels = [level if id(im) in firsts else later for im in kept]
    stage(
        "encode",
        "ms per kept image",
        len(kept),
        lambda: [encode_image(p, cfg.image_format, zstd_level=level) for p in pixels],
        lambda: [compressors[lv].compress(p.pixels) for p, lv in zip(pixels, levels)],
        f"zstandard compress of the pixel buffer alone, at the {cfg.image_format} format's levels (a sample's first "
        f"image {level}, a later one {later})",
    )

    steps = []  # (step conversation, its images, pixels made) of every sample written, as Renderer.render plans them
    for conv in convs:
        imgs = [open_image(im, proc, family, **opts) for im in conv.images]
        for sc in renderer.plan(conv, imgs, {})[0]:
            steps.append((sc.conv, [imgs[k] for k in sc.images]))
    for _, imgs in steps:
        for im in imgs:
            _ = im.pixels  # made before the timing: render reads only their grids, and this stage is not about them
    tokens = sum(s.num_tokens_before_truncation for s in samples)
    expanded = [_expand_images(ctx, ctx.render_text(ctx.messages(sc), sc.tools), imgs, sc)[0] for sc, imgs in steps]
    shorts = [shorten_runs(t, ctx.text.run_re, ctx.text.run_tokens)[0] for t in expanded]
    backend = ctx.tokenizer.backend_tokenizer
    whole = _best(lambda: [ctx.tokenizer(t, return_offsets_mapping=True) for t in expanded], reps)
    stage(
        "tokenize",
        "ms per 1k tokens",
        tokens / 1e3,
        lambda: [ctx.text.encode(t) for t in expanded],
        lambda: [backend.encode(t, add_special_tokens=False) for t in shorts],
        "the tokenizer's Rust encode of the text less each placeholder run's repeats",
        whole_text_ms=round(whole * 1e6 / tokens, 3),
    )
    stage(
        "render_mask",
        "ms per 1k tokens",
        tokens / 1e3,
        lambda: [render_conversation(sc, ctx, imgs) for sc, imgs in steps],
        lambda: (
            [ctx.render_text(ctx.messages(sc), sc.tools) for sc, _ in steps]
            + [backend.encode(t, add_special_tokens=False) for t in shorts]
        ),
        "one template render + the tokenize floor (tokenize included in both)",
    )

    calls = [0]
    count = process_module.count_tokens

    def counted(*a, **kw):
        calls[0] += 1
        return count(*a, **kw)

    opened = [[open_image(im, proc, family, **opts) for im in conv.images] for conv in convs]

    def search():
        calls[0] = 0
        for conv, imgs in zip(convs, opened):
            renderer.plan(conv, imgs, {})

    process_module.count_tokens = counted
    try:
        search()
        n_calls = calls[0]
        stage(
            "split_search",
            "ms per sample",
            len(samples),
            search,
            lambda: [count(sc, ctx, imgs) for sc, imgs in steps],
            "one count_tokens per sample written",
            count_tokens_calls=n_calls,
            samples=len(samples),
            records=len(raws),
        )
    finally:
        process_module.count_tokens = count

    encoded = [s for raw in raws for kind, s in renderer.process(raw)[0] if kind == "ok"]
    total_bytes = sum(len(b) for s in encoded for b in s.members.values())
    tmp = Path(tempfile.mkdtemp())

    def tar_write():
        w = ShardWriter(tmp, samples_per_shard=10**9, shard_size_bytes=1 << 40)
        for s in encoded:
            w.write(s)
        w.close()

    def plain_write():
        h = hashlib.sha256()
        with open(tmp / "plain.bin", "wb") as f:
            for s in encoded:
                for b in s.members.values():
                    h.update(b)
                    f.write(b)
            f.flush()
            os.fsync(f.fileno())
        return h.hexdigest()

    stage(
        "tar_write",
        "ms per MB",
        total_bytes / 1e6,
        tar_write,
        plain_write,
        "the same member bytes written to one file, hashed (sha256) and fsynced; no tar headers",
    )
    stage(
        "hashing",
        "ms per MB",
        sum(len(im.source.data) for im in kept) / 1e6,
        lambda: [PreparedImage(pixels=im.pixels, grid_thw=im.grid_thw, source=im.source).digest for im in kept],
        lambda: [hashlib.sha256(im.source.data).hexdigest() for im in kept],
        "hashlib.sha256 of the kept sources' bytes, once each (the shard's own sha256: tar_write)",
    )

    def record_path():
        w = ShardWriter(tmp, samples_per_shard=10**9, shard_size_bytes=1 << 40)
        for raw in raws:
            for kind, s in renderer.process(raw)[0]:
                if kind == "ok":
                    w.write(s)
        w.close()

    # Interleaved, so that a neighbour's load falls on both sides of the ratio. Every stage's floor but tokenize's
    # (inside render + mask's); where the plan counted nothing (records that look short are rendered once, that
    # render kept as the sample), the split search's floor would count the render's floor twice: it is left out too.
    in_sum = tuple(k for k in floor_fns if k != "tokenize" and (k != "split_search" or n_calls))
    paths, sums = [], []
    for _ in range(reps):
        paths.append(_best(record_path, 1))
        sums.append(sum(_best(floor_fns[k], 1) for k in in_sum))
    path_s, floor_sum = statistics.median(paths), statistics.median(sums)
    rows.append(
        emit(
            "stages",
            metric="record_path",
            shape=shape,
            records=len(raws),
            images=len(images),
            kept_images=len(kept),
            samples=len(samples),
            tokens=tokens,
            ms_per_record=round(path_s * 1e3 / len(raws), 2),
            ms_per_kept_image=round(path_s * 1e3 / max(1, len(kept)), 2),
            floor_sum_ms_per_record=round(floor_sum * 1e3 / len(raws), 2),
            ratio=round(statistics.median(p / f for p, f in zip(paths, sums)), 2),
            goal=GOAL_RECORD_PATH,
            floors_in_sum=list(in_sum),
            settings=settings,
        )
    )
    return rows
