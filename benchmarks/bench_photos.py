"""Photos (issue 54): the default `--image-format auto` (a lossy photo stored as its bytes where its pixels would be
much larger, every other image zstd-pdelta) against `zstd-pdelta` everywhere.

- `storage`: image bytes over the sources' bytes per storage, from `vlmprep stats` of a default build and of a
  zstd-pdelta build of the same records: the LLaMA-Factory demo photos and each file of ../shared/data/real_traces.
- `build_cpu`: CPU per record of the default build of the demo photos against `--image-format zstd-pdelta` in the
  same process, the two alternated, best of 3, the slope between 1,800 records and 600 (start-up cancels out).
- `loader` (`--only photo_loader`): per family, the trainer's data path over photo shards (small JPEGs as the
  demo's; 12 MP JPEGs resized to the pixel budget), samples/s per core beside the online path (TRL's collator where
  it takes the family's processor, else the processor's apply_chat_template) and the floor (shard read + the bare
  decode of every stored member), and how many times one core covers a GPU's need (NEED_TOKENS_PER_S,
  docs/performance.md), counting the language model's tokens alone and with the vision tower's patches too.
`--workers 2` on short records is bench_build's `speedup_2_workers` row (shape short_vqa), which `--only photos` runs
too. Each stored-photo loader row also runs the same records stored as zstd-pdelta (`pdelta_*`).
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import time
from pathlib import Path

from benchmarks.bench_build import build_config, short_records_scaling
from benchmarks.bench_families import vqa_record
from benchmarks.emit import emit
from benchmarks.inputs import OUT, jsonl_zst, vqa_demo

REAL_TRACES = Path(
    os.environ.get("VLMPREP_REAL_TRACES", Path(__file__).resolve().parents[2] / "shared" / "data" / "real_traces")
)
# What one GPU takes (docs/performance.md): an H100 at ~40% of its dense bf16 peak trains ~9k tokens/s of a 7B model;
# one loader core should cover it NEED_TIMES over.
NEED_TOKENS_PER_S = 9000
NEED_TIMES = 5
# The vision tower's share of that GPU time, as the trainer's FlopCounter counts a step (6 x parameters per text token
# and per vision patch): a patch costs VISION_PARAMS / TEXT_PARAMS of a text token. 300M is the smallest tower of
# these families' 7B-class checkpoints (InternViT-300M; SigLIP-so400m, Pixtral's, Qwen's and Mllama's are 0.4-0.9B),
# so the need counted with it is not understated.
TEXT_PARAMS, VISION_PARAMS = 7e9, 3e8
# The released checkpoints' patch sides (the tiny models patchify coarser): pixels the tower sees -> patches.
REAL_PATCH = {"qwen3-vl": 16, "qwen3.5": 16, "gemma-4": 16, "smolvlm": 16}  # the others: 14
LARGE = (4000, 3000)  # a 12 MP photo
GRID_BUDGET = 1_003_520  # --max-pixels of the grid families' large rows: ~1,280 tokens an image


def cpu() -> float:
    """CPU seconds (user + system) of this process and its finished children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _build(inp: Path, out: Path, **kw) -> float:
    """CPU seconds of one build in this process."""
    from vlmprep.builder.pipeline import build

    shutil.rmtree(out, ignore_errors=True)
    t0 = cpu()
    build(build_config(inp, out, **kw))
    return cpu() - t0


def _storage(ds: Path) -> dict:
    from vlmprep.tools.stats import compute_stats

    return compute_stats(ds)["image_storage"]


def storage_rows(quick: bool) -> list[dict]:
    """Image bytes over source bytes, default vs zstd-pdelta, on the demo photos and each real_traces file."""
    inputs = []
    recs = vqa_demo(1 if quick else 16)
    if recs:
        inputs.append(("llamafactory_demo", jsonl_zst(recs, OUT / "inputs" / f"vqa-{len(recs)}.jsonl.zst")))
    if REAL_TRACES.is_dir() and not quick:
        inputs += [(p.stem, p) for p in sorted(REAL_TRACES.glob("*.jsonl"))]
    rows = []
    for name, inp in inputs:
        for fmt in ("auto", "zstd-pdelta"):
            ds = OUT / "photos" / f"storage-{name}-{fmt}"
            _build(inp, ds, image_format=fmt, long_traces="split", seq_len=32768)
            by = _storage(ds)
            stored, source = sum(c["bytes"] for c in by.values()), sum(c["source_bytes"] for c in by.values())
            rows.append(
                emit(
                    "photos",
                    metric="image_bytes_vs_source",
                    input=name,
                    image_format=fmt,
                    images=sum(c["images"] for c in by.values()),
                    by_storage={
                        k: {**c, "ratio": round(c["bytes"] / max(c["source_bytes"], 1), 3)} for k, c in by.items()
                    },
                    stored_mb=round(stored / 1e6, 3),
                    source_mb=round(source / 1e6, 3),
                    ratio=round(stored / max(source, 1), 3),
                    goal_ratio=1.5 if name == "llamafactory_demo" else None,
                )
            )
    return rows


def build_cpu_rows(quick: bool) -> list[dict]:
    """CPU per record: the default build of the demo photos against --image-format zstd-pdelta, in one process, the
    two alternated, each the best of 3: the slope between a build of the records and one of a third of them, so the
    start-up (the processor's load and save, the merge) cancels out instead of being estimated apart."""
    recs = vqa_demo(1 if quick else 300)
    if not recs:
        return [emit("photos", metric="build_cpu", skipped="../shared/data not found")]
    big = jsonl_zst(recs, OUT / "inputs" / f"vqa-{len(recs)}.jsonl.zst")
    small = jsonl_zst(recs[: len(recs) // 3], OUT / "inputs" / f"vqa-{len(recs) // 3}.jsonl.zst")
    _build(small, OUT / "photos" / "warm", seq_len=4096)  # the first build of a process loads the processor
    runs: dict[str, dict[str, list[float]]] = {fmt: {"small": [], "big": []} for fmt in ("auto", "zstd-pdelta")}
    for _ in range(1 if quick else 3):
        for fmt, got in runs.items():
            for size, inp in (("small", small), ("big", big)):
                got[size].append(_build(inp, OUT / "photos" / f"cpu-{size}-{fmt}", image_format=fmt, seq_len=4096))
    n = len(recs) - len(recs) // 3
    ms = {fmt: (min(got["big"]) - min(got["small"])) / n * 1e3 for fmt, got in runs.items()}
    return [
        emit(
            "photos",
            metric="build_cpu_per_record",
            shape="short_vqa",
            records=[len(recs) // 3, len(recs)],
            ms_per_record={k: round(v, 3) for k, v in ms.items()},
            cpu_seconds={k: {size: [round(x, 2) for x in v] for size, v in got.items()} for k, got in runs.items()},
            ratio=round(ms["auto"] / ms["zstd-pdelta"], 3),
            goal_ratio=0.6,
            load_average=round(os.getloadavg()[0], 1),
        )
    ]


def _large_photos(n: int, root: Path) -> list[bytes]:
    """n 12 MP JPEGs (q90): the real photos of real_traces upscaled to 4000x3000, else a synthetic photo."""
    import numpy as np
    from PIL import Image

    sources = sorted((REAL_TRACES / "images" / "qwen25vl").glob("unireco_*.jpg")) if REAL_TRACES.is_dir() else []
    out = []
    for k in range(n):
        path = root / f"large-{k}.jpg"
        if not path.exists():
            im = (
                Image.open(sources[k % len(sources)]).convert("RGB")
                if sources
                else Image.fromarray(np.random.default_rng(k).integers(0, 256, (240, 320, 3), dtype=np.uint8))
            )
            im.resize(LARGE, Image.BICUBIC).save(path, format="JPEG", quality=90)
        out.append(path.read_bytes())
    return out


def photo_records(shape: str, n: int, root: Path) -> list[dict]:
    """n VQA records of one photo each: `small` the demo's JPEGs (about 300x170), `large` 12 MP JPEGs."""
    import base64

    if shape == "small":
        demo = sorted((REAL_TRACES.parent / "llamafactory_mllm_demo" / "mllm_demo_data").glob("*.jpg"))
        photos = [p.read_bytes() for p in demo] or _large_photos(1, root)
    else:
        photos = _large_photos(min(n, 4), root)
    return [
        vqa_record(f"p{k}", "data:image/jpeg;base64," + base64.b64encode(photos[k % len(photos)]).decode(), k, turns=1)
        for k in range(n)
    ]


def _online(lines: list[dict], processor_dir: Path) -> tuple[float, str]:
    """CPU seconds of the online path over the records: TRL's DataCollatorForVisionLanguageModeling per record where
    it takes this processor, else bench_families' apply_chat_template path; and which ran."""
    from benchmarks.bench_families import online_pass

    try:
        from PIL import Image
        from transformers import AutoProcessor
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

        from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
        from vlmprep.render.chat_template import template_messages
        from vlmprep.types import Source

        collate = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(processor_dir))
        t0 = cpu()
        for k, rec in enumerate(lines):
            conv = normalize_record(json.loads(json.dumps(rec)), Source("/bench/x.jsonl", k + 1), NormalizeOptions())
            images = [Image.open(io.BytesIO(im.data)).convert("RGB") for im in conv.images]
            collate([{"messages": template_messages(conv), "images": images}])
        return cpu() - t0, "trl_collator"
    except Exception:  # noqa: BLE001 - a processor TRL's collator cannot drive: the processor's own path instead
        t0 = cpu()
        online_pass(lines, processor_dir)
        return cpu() - t0, "apply_chat_template"


def patches_of(pixel_values, name: str) -> float:
    """Vision patches one micro-batch's pixel_values give the tower (padded tiles included: the tower runs on them):
    their rows where they are patch rows (Qwen's hold a patch twice, its temporal pair), else their pixels over the
    released checkpoint's patch area."""
    if pixel_values is None:
        return 0.0
    if pixel_values.dim() == 2:
        return float(pixel_values.shape[0])
    return pixel_values.numel() / 3 / REAL_PATCH.get(name, 14) ** 2


def loader_rows(quick: bool) -> list[dict]:
    """Per family and photo shape: the trainer's data path, the online path and the floor, samples/s per core."""
    from benchmarks.bench_families import loader_pass
    from benchmarks.bench_loader import decode_floor_seconds
    from trainer.families import FAMILIES
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.shards.manifest import load_manifest

    root = OUT / "photos" / "loader"
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape, n in (("small", 4 if quick else 60), ("large", 2 if quick else 8)):
        recs = photo_records(shape, n, root)
        (root / f"{shape}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        for family in FAMILIES[:2] if quick else FAMILIES:
            ds = root / f"{shape}-{family.name}"
            grid = family.pixels == "patchify"
            build(
                BuildConfig(
                    inputs=(str(root / f"{shape}.jsonl"),),
                    out=str(ds),
                    processor=f"tiny:{family.name}",
                    progress=False,
                    overwrite=True,
                    max_pixels=GRID_BUDGET if grid and shape == "large" else None,
                )
            )
            manifest = load_manifest(ds)
            storage = _storage(ds)
            counted: list[float] = []  # per sample, from the pass that makes every pixel input (the device's too)
            seen = lambda pv, into=counted, name=family.name: into.append(patches_of(pv, name))  # noqa: E731
            passes = {
                pixels: loader_pass(ds, family.name, pixels, time.process_time, seen=seen if pixels else None)[0]
                for pixels in (True, False)
            }
            if family.pixels != "patchify":  # the workers' part (collate: the host's inputs), not the device's math
                passes["workers"] = loader_pass(ds, family.name, True, time.process_time, device=False)[0]
            pdelta = None
            if "original" in storage:  # the same records with their pixels stored, for comparison
                build(
                    BuildConfig(
                        inputs=(str(root / f"{shape}.jsonl"),),
                        out=str(ds) + "-pdelta",
                        processor=f"tiny:{family.name}",
                        progress=False,
                        overwrite=True,
                        image_format="zstd-pdelta",
                        max_pixels=GRID_BUDGET if grid and shape == "large" else None,
                    )
                )
                pdelta = loader_pass(
                    Path(str(ds) + "-pdelta"), family.name, family.pixels != "patchify", time.process_time, device=False
                )[0]
            # Qwen's and GLM's pixel math runs on the training device: their worker path is the decode alone; Gemma 3's
            # normalize runs there too: its worker path is the decode and collate (its token types); Gemma 4's patchify
            # too, and Mllama's tiles: their worker path is the decode and collate (the processor's resize, and the
            # patches' position ids or the tiles' aspect ratios and cross-attention mask); Llama 4's and InternVL's
            # processor runs there with its rescale and normalize off (uint8 pixel_values, those two on the device).
            worker = {"patchify": passes[False]}.get(family.pixels, passes.get("workers", passes[True]))
            floor = decode_floor_seconds(sorted(ds.glob("shard-*.tar")), time.process_time)
            online, path = _online(recs, ds / "processor")
            tokens = manifest.totals["tokens"] / n
            need = NEED_TOKENS_PER_S / tokens  # samples a second one GPU takes, counting its text tokens alone
            patches = sum(counted) / n
            need_vision = NEED_TOKENS_PER_S / (tokens + patches * VISION_PARAMS / TEXT_PARAMS)  # and its tower
            rows.append(
                emit(
                    "photos",
                    metric="loader",
                    shape=shape,
                    family=family.name,
                    samples=n,
                    storage={k: c["images"] for k, c in storage.items()},
                    tokens_per_sample=round(tokens, 1),
                    worker_path={
                        "patchify": "decode only (patchify on the device)",
                        "normalize": "decode and collate (normalize on the device)",
                        "patches": "decode, collate and resize (patchify on the device)",
                        "tiles": "decode, collate and resize (tiles on the device)",
                        "uint8": "host, uint8 (rescale + normalize on the device)",
                    }.get(family.pixels, "host"),
                    loader_samples_per_s=round(n / worker, 1),
                    pdelta_loader_samples_per_s=round(n / pdelta, 1) if pdelta else None,
                    with_pixels_on_this_cpu_samples_per_s=round(n / passes[True], 1),
                    floor_samples_per_s=round(n / floor, 1),
                    online_samples_per_s=round(n / online, 1),
                    online_path=path,
                    speedup_vs_online=round(online / worker, 2),
                    need_samples_per_s=round(need, 1),
                    covers_need=round(n / worker / need, 1),
                    vision_patches_per_sample=round(patches, 1),
                    need_with_vision_samples_per_s=round(need_vision, 1),
                    covers_need_with_vision=round(n / worker / need_vision, 1),
                    goal_covers_need=NEED_TIMES,
                )
            )
    return rows


def run(quick: bool) -> list[dict]:
    """`--only photos`: the bytes, the build's CPU per record and --workers 2 on short records."""
    import torch

    torch.set_num_threads(1)
    return storage_rows(quick) + build_cpu_rows(quick) + short_records_scaling(quick)


def run_loader(quick: bool) -> list[dict]:
    """`--only photo_loader`: the loader per family on photos."""
    import torch

    torch.set_num_threads(1)
    return loader_rows(quick)
