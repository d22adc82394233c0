"""Per-family loader benchmark: for each family vlmprep renders, the trainer's data path over its shards (read ->
decode -> the family's pixel inputs -> collated batch, one core) against the processor's own online path on the same
records (parse, decode the images, apply_chat_template with tokenization and image processing, one core), and the
floor (read and decode only, no pixel math). VQA records (an image of 320-1280 px and two question/answer turns),
built with each family's `tiny:NAME` processor (a small vocabulary: tokenization is cheap on both sides, so the
ratio is the pixel and template work; with a real vocabulary the online path is slower still)."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.emit import emit
from benchmarks.inputs import OUT

SIZES = [(320, 200), (640, 360), (1280, 720), (800, 1280), (1024, 1024)]


def records(n: int, path: Path) -> list[dict]:
    """n VQA records, each an image (sizes cycling through SIZES, random pixels) and two question/answer turns."""
    from PIL import Image

    out = []
    rng = np.random.default_rng(0)
    for k in range(n):
        w, h = SIZES[k % len(SIZES)]
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        out.append(vqa_record(f"q{k}", uri, k))
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return out


def vqa_record(rid: str, uri: str, k: int, *, turns: int = 2) -> dict:
    """One VQA record: an image (a data URI) and a question about it, answered; turns=2: a second question/answer."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": f"What is in picture {k}?"},
            ],
        },
        {"role": "assistant", "content": "A red square and a green banner."},
        {"role": "user", "content": "And the page?"},
        {"role": "assistant", "content": f"The page shows {k % 7 + 2} search results."},
    ]
    return {"id": rid, "messages": messages[: 2 * turns]}


def _spec(ds: Path, name: str):
    """The trainer's collate spec for the dataset, as a run makes it (a tiny model of the family for its ids)."""
    from trainer.config import TrainConfig
    from trainer.data.datasets import RunData, load_image_spec
    from trainer.model import build_model, collate_spec_of, tiny_vocab
    from trainer.options import DataOptions, ModelOptions

    processor = str(ds / "processor")
    image = load_image_spec(DataOptions.of(TrainConfig(data=str(ds), tiny_random=name)), processor)
    net = build_model(ModelOptions(tiny_random=name), tiny_vocab(name, processor))
    return image, collate_spec_of(net, RunData((), [], [], image, "", processor), processor)


def loader_pass(
    ds: Path, name: str, pixels: bool, clock=time.perf_counter, device: bool = True, seen=None
) -> tuple[float, int]:
    """One pass of the trainer's data path (micro-batch 1, in this process): seconds (of `clock`), samples.
    pixels=False: the floor, samples read and decoded, no pixel inputs made; device=False: the DataLoader workers'
    part alone (collate and the host's pixel inputs), not the pixel math the training device runs (Patchifier);
    `seen(pixel_values)`: called with each micro-batch's, the device's or else the host's (None without images)."""
    from trainer.data.collate import collate
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream
    from trainer.data.vision import Patchifier

    image, cspec = _spec(ds, name)
    patchify = Patchifier(image, "cpu") if device else None
    shards = list(resolve_data(str(ds)).shards)
    t0 = clock()
    n = 0
    for sample in RankStream(shards, start=0, spec=image):
        n += 1
        if not pixels:
            continue
        batch = collate([sample], cspec)
        if patchify is not None:  # a host family's batch holds its pixel_values: nothing made here
            made = patchify.inputs(batch)[0]
            if seen is not None:
                seen(made if made is not None else batch.vision.get("pixel_values"))
    return clock() - t0, n


def online_pass(lines: list[dict], processor_dir: Path) -> tuple[float, int]:
    """The processor's own online path per record: parse, decode its images, apply_chat_template (render, tokenize,
    process the images), one core."""
    from PIL import Image
    from transformers import AutoProcessor

    from vlmprep.families import family_of
    from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
    from vlmprep.render.chat_template import template_messages
    from vlmprep.types import Source

    processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True)
    family = family_of(type(processor).__name__)
    t0 = time.perf_counter()
    for k, rec in enumerate(lines):
        conv = normalize_record(json.loads(json.dumps(rec)), Source("/bench/x.jsonl", k + 1), NormalizeOptions())
        images = iter([Image.open(io.BytesIO(im.data)).convert("RGB") for im in conv.images])
        msgs = template_messages(conv, string_content=bool(family and family.string_content))
        for m in msgs:
            for part in m["content"] if isinstance(m["content"], list) else []:
                if part["type"] == "image":
                    part["image"] = next(images)
        processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")
    return time.perf_counter() - t0, len(lines)


def run(quick: bool, n: int | None = None) -> list[dict]:
    from trainer.families import FAMILIES
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    torch.set_num_threads(1)
    n = n or (3 if quick else 40)
    root = OUT / "families"
    root.mkdir(parents=True, exist_ok=True)
    recs = records(n, root / "vqa.jsonl")
    rows = []
    for family in FAMILIES[:3] if quick else FAMILIES:
        ds = root / family.name
        build(
            BuildConfig(
                inputs=(str(root / "vqa.jsonl"),),
                out=str(ds),
                processor=f"tiny:{family.name}",
                progress=False,
                overwrite=True,
                samples_per_shard=64,
            )
        )
        loader_s, samples = loader_pass(ds, family.name, True)
        floor_s, _ = loader_pass(ds, family.name, False)
        online_s, _ = online_pass(recs, ds / "processor")
        rows.append(
            emit(
                "families",
                family=family.name,
                pixels=family.pixels,
                samples=samples,
                loader_samples_per_s=round(samples / loader_s, 1),
                floor_samples_per_s=round(samples / floor_s, 1),
                online_samples_per_s=round(samples / online_s, 1),
                speedup_vs_online=round(online_s / loader_s, 2),
                share_of_floor=round(floor_s / loader_s, 3),
            )
        )
    return rows
