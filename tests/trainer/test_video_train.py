"""Video training: shard samples with videos give the batch and the tiny-model loss of online processing, packed
rows with video segments isolate each sample, the CLI trains a mixed video/image/text dataset (with and
without --pack-to; its step-1 loss equals online processing for Qwen2.5-VL and Qwen3-VL-MoE checkpoints), and a video
eval set's loss equals a single-process computation (one rank and two)."""

from __future__ import annotations

import functools
import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.support.videos import decode_all, encode, frames
from tests.trainer.conftest import read_all_samples, read_metrics, run_trainer
from tests.trainer.test_parity import _independent_labels
from trainer.data.collate import IGNORE_INDEX, CollateSpec, collate
from trainer.data.errors import DataError
from trainer.data.pack import collate_packed
from trainer.data.processors import load_image_processor_config, load_video_processor_config
from trainer.data.vision import ImageSpec, Patchifier
from trainer.model import build_model, forward_loss
from trainer.options import ModelOptions

CLIPS = [(9, 4, 64, 48), (6, 2, 56, 56)]  # frames, fps, width, height: an odd sampled count and an even one


def _records() -> list[dict]:
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731
    video = lambda k: {"type": "video", "video": f"c{k}.mp4"}  # noqa: E731
    image = {"type": "image_url", "image_url": {"url": "s.png"}}
    return [
        {
            "id": "v",
            "messages": [
                user(video(0), {"type": "text", "text": "what moves"}),
                {"role": "assistant", "content": "a square"},
            ],
        },
        {
            "id": "i",
            "messages": [
                user(image, {"type": "text", "text": "what is it"}),
                {"role": "assistant", "content": "a picture"},
            ],
        },
        {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {
            "id": "vi",
            "messages": [
                user(video(1), image, {"type": "text", "text": "both"}),
                {"role": "assistant", "content": "a clip and a picture"},
            ],
        },
    ]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    d = tmp_path_factory.mktemp("videodata")
    for k, (n, fps, w, h) in enumerate(CLIPS):
        (d / f"c{k}.mp4").write_bytes(encode(frames(n, w, h, seed=k), fps))
    Image.fromarray(frames(1, 60, 40, seed=7)[0]).save(d / "s.png")
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    build(
        BuildConfig(
            inputs=(str(d / "r.jsonl"),),
            out=str(d / "out"),
            processor="builtin:qwen2-vl",
            seq_len=4096,
            progress=False,
            overwrite=True,
        )
    )
    return d


@pytest.fixture(scope="module")
def video_spec(video_data):
    location = str(video_data / "out" / "processor")
    return ImageSpec.from_config(load_image_processor_config(location), load_video_processor_config(location))


def _online(d, record, out: str = "out", family: str = "qwen2-vl") -> dict:
    """processor.apply_chat_template on the record, each video as all its PyAV frames, the processor sampling them."""
    from transformers.video_utils import VideoMetadata

    from vlmprep.config import BuildConfig
    from vlmprep.ingest.normalize import normalize_record
    from vlmprep.process import Renderer
    from vlmprep.processors.load import load_processor
    from vlmprep.types import Source

    processor = load_processor(str(d / out / "processor"))
    r = Renderer(
        BuildConfig(inputs=(str(d / "r.jsonl"),), out=str(d / out), processor=f"builtin:{family}"),
        processor,
        saved=True,
    )
    conv = normalize_record(record, Source(str(d / "r.jsonl"), 1), r.norm)
    decoded, msgs = [], []
    for m in r.ctx.messages(conv):
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = []
            for c in m["content"]:
                if c["type"] == "video":
                    k = [p["video"] for p in record["messages"][0]["content"] if p["type"] == "video"][0][1]
                    decoded.append(decode_all((d / f"c{k}.mp4").read_bytes()))
                    c = {**c, "video": decoded[-1][0]}
                elif c["type"] == "image":
                    c = {**c, "image": Image.open(d / "s.png")}
                parts.append(c)
            m["content"] = parts
        msgs.append(m)
    meta = [VideoMetadata(total_num_frames=len(f), fps=fps) for f, fps in decoded]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor.apply_chat_template(
            msgs,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            do_sample_frames=True,
            fps=2.0,
            video_metadata=meta or None,
        )
    return out, processor


def _spec(net) -> CollateSpec:
    return CollateSpec(
        pad_id=0,
        image_token_id=int(net.config.image_token_id),
        patch_size=14,
        merge_size=2,
        video_token_id=int(net.config.video_token_id),
        videos=True,
    )


@pytest.mark.parametrize("sample_id", ["v", pytest.param("vi", marks=pytest.mark.slow)])  # make-test budget
def test_video_sample_batch_and_loss_equal_online_processing(video_data, video_spec, sample_id):
    samples = {s.id: s for s in read_all_samples(video_data / "out", video_spec)}
    records = {r["id"]: r for r in _records()}
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    patchify = Patchifier(video_spec, "cpu")
    batch = collate([samples[sample_id]], _spec(net)).to("cpu")
    on, processor = _online(video_data, records[sample_id])
    videos = patchify.videos(batch.videos)
    pixels = patchify(batch.images, batch.image_index)
    on_labels = _independent_labels(on["input_ids"][0], processor.tokenizer)[None]
    n = on["input_ids"].shape[1]  # a sample without an image ends with the placeholder image, never a target
    assert batch.input_ids.shape[1] == n + (sample_id == "v")

    assert torch.equal(batch.input_ids[:, :n], on["input_ids"])
    assert torch.equal(batch.attention_mask[:, :n], on["attention_mask"])
    assert torch.equal(batch.labels[:, :n], on_labels) and (batch.labels[:, n:] == IGNORE_INDEX).all()
    assert torch.equal(batch.mm_token_type_ids[:, :n], on["mm_token_type_ids"])
    assert int((batch.mm_token_type_ids == 2).sum())
    assert torch.equal(batch.video_grid_thw, on["video_grid_thw"])
    assert videos.dtype == on["pixel_values_videos"].dtype == torch.float32
    assert videos.shape == on["pixel_values_videos"].shape
    assert float((videos - on["pixel_values_videos"]).abs().max()) <= 1e-6
    if sample_id == "vi":
        assert torch.equal(batch.image_grid_thw, on["image_grid_thw"]) and torch.equal(pixels, on["pixel_values"])
    # The stored MRoPE positions are the model's own get_rope_index with the video.
    rope, _ = net.model.get_rope_index(
        on["input_ids"],
        mm_token_type_ids=on["mm_token_type_ids"],
        image_grid_thw=on.get("image_grid_thw"),
        video_grid_thw=on["video_grid_thw"],
        attention_mask=on["attention_mask"],
    )
    assert torch.equal(batch.position_ids[..., :n], rope)
    with torch.no_grad():
        ours = forward_loss(net, batch, pixels, pixel_values_videos=videos) / batch.num_trained
        logits = net(
            input_ids=on["input_ids"],
            attention_mask=on["attention_mask"],
            mm_token_type_ids=on["mm_token_type_ids"],
            pixel_values=on.get("pixel_values"),
            image_grid_thw=on.get("image_grid_thw"),
            pixel_values_videos=on["pixel_values_videos"],
            video_grid_thw=on["video_grid_thw"],
            use_cache=False,
        ).logits
        ref = F.cross_entropy(logits[0, :-1].float(), on_labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")
        ref = ref / (on_labels[0, 1:] != IGNORE_INDEX).sum()
    assert abs(float(ours) - float(ref)) / abs(float(ref)) <= 1e-6, (float(ours), float(ref))


def _logits(net, batch, patchify):
    with torch.no_grad():
        return (
            net(
                input_ids=batch.input_ids,
                attention_mask=None if batch.packed else batch.attention_mask,
                position_ids=batch.position_ids,
                mm_token_type_ids=batch.mm_token_type_ids,
                pixel_values=patchify(batch.images, batch.image_index),
                image_grid_thw=batch.image_grid_thw,
                pixel_values_videos=patchify.videos(batch.videos),
                video_grid_thw=batch.video_grid_thw,
                use_cache=False,
            )
            .logits[0]
            .float()
        )


@pytest.mark.slow  # make-test budget (~13 s); the placeholder and parity cases stay
def test_packed_row_with_video_image_and_text_gives_each_sample_its_own_logits(video_data, video_spec):
    """A packed row of a video sample, an image sample, a text sample and a video+image sample: each segment's logits
    equal the sample's logits alone (fp32, <= 1e-5); with text positions running on (no resets) they do not."""
    samples = {s.id: s for s in read_all_samples(video_data / "out", video_spec)}
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    spec, patchify = _spec(net), Patchifier(video_spec, "cpu")
    row = [samples[k] for k in ("v", "i", "t", "vi")]
    packed = collate_packed([row], spec)
    assert packed.video_grid_thw.tolist() == [s.video_grid_thw.tolist()[0] for s in row if s.videos]
    broken = collate_packed([row], spec, isolate=False)
    alone = torch.cat([_logits(net, collate([s], spec), patchify)[: s.num_tokens] for s in row])
    for batch, ok in ((packed, True), (broken, False)):
        diff = (_logits(net, batch, patchify)[: len(alone)] - alone).abs().amax(dim=1)
        worst = [float(d.max()) for d in diff.split([s.num_tokens for s in row])]
        # Broken: the first sample sees nothing before it either way; every later one attends to its predecessors.
        assert (max(worst) <= 1e-5) if ok else min(worst[1:]) > 1e-3, (ok, worst)


def test_placeholder_video_runs_the_video_pass_and_touches_no_real_token(video_data, video_spec):
    """Where the run's data holds videos, a micro-batch (or packed row) without one gets a placeholder video token
    after the last real token (after the placeholder image), no label: the same vision passes on every rank, and
    the real tokens' logits unchanged."""
    import dataclasses

    samples = {s.id: s for s in read_all_samples(video_data / "out", video_spec)}
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    spec, patchify = _spec(net), Patchifier(video_spec, "cpu")
    plain = dataclasses.replace(spec, videos=False)
    t, i = samples["t"], samples["i"]
    b = collate([t, i], spec)
    n = t.num_tokens if t.num_tokens >= i.num_tokens else i.num_tokens
    row0 = b.input_ids[0, t.num_tokens : t.num_tokens + 1].tolist()
    assert row0 == [int(net.config.video_token_id)] and b.mm_token_type_ids[0, t.num_tokens] == 2
    assert b.input_ids.shape[1] == max(n, t.num_tokens + 1) and len(b.videos) == 1 and len(b.images) == 1
    assert b.video_grid_thw.tolist() == [[1, 2, 2]] and (b.labels[0, t.num_tokens :] == IGNORE_INDEX).all()
    text = collate([t], spec)  # neither: the placeholder image, then the placeholder video
    assert text.input_ids[0, -2:].tolist() == [int(net.config.image_token_id), int(net.config.video_token_id)]
    assert text.mm_token_type_ids[0, -2:].tolist() == [1, 2]
    assert torch.equal(
        _logits(net, text, patchify)[: t.num_tokens], _logits(net, collate([t], plain), patchify)[: t.num_tokens]
    )
    packed = collate_packed([[t, i]], spec)
    assert packed.input_ids[0, -1] == int(net.config.video_token_id) and packed.loss_mask[0, -1] == 0
    assert collate([samples["v"]], spec).input_ids.shape[1] == samples["v"].num_tokens + 1  # its own video: no extra
    with pytest.raises(DataError, match="hold videos, but this run does not train video"):
        collate([samples["v"]], plain)  # a pipe: source under an unverified model: one line, not a model error


def test_decoded_frames_are_the_stored_frames_and_bad_video_members_are_refused(video_data, video_spec):
    """Decode gives each video its stored frames in order (the same pixels vlmprep's reader gives); a missing frame
    or a video grid that disagrees with the frames is one DataError, never a crash mid-collate."""
    import io
    import tarfile

    from trainer.data.decode import OriginalResizer, decode_sample
    from vlmprep.shards.reader import decode_stored_image

    with tarfile.open(video_data / "out" / "shard-000000.tar") as tf:
        members = {}
        for m in tf:
            key, name = m.name.split(".", 1)
            members.setdefault(key, {})[name] = tf.extractfile(m).read()
    key, sample = next((k, m) for k, m in members.items() if b'"id": "vi"' in m["json"])
    kw = dict(key=key, url="u.tar", spec=video_spec, resize_original=OriginalResizer(video_spec))
    d = decode_sample(sample, **kw)
    meta = json.loads(sample["json"])
    names = sorted(n for n in sample if n.startswith("vid000."))
    assert len(d.videos) == 1 and len(d.videos[0]) == meta["videos"][0]["frames"] == len(names)
    for got, name in zip(d.videos[0], names):
        assert np.array_equal(got, decode_stored_image(name, sample[name]))
    assert d.video_grid_thw.tolist() == [meta["videos"][0]["grid_thw"]] and d.second_per_grid_ts.shape == (1,)
    with pytest.raises(DataError, match="video 0: frame 1 has 0 members"):
        decode_sample({n: v for n, v in sample.items() if not n.startswith("vid000.0001.")}, **kw)
    grid = d.video_grid_thw.copy()
    grid[0, 0] += 1
    buf = io.BytesIO()
    np.save(buf, grid)
    with pytest.raises(DataError, match="but the sample stores grid"):
        decode_sample({**sample, "video_grid_thw.npy": buf.getvalue()}, **kw)


def test_worker_frames_equal_in_process_decode(video_data, video_spec):
    """DataLoader workers send a sample's frames in its shared-memory slab with its images: the same pixels."""
    from trainer.data.batches import sample_loader
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream

    shards = list(resolve_data(str(video_data / "out")).shards)

    def pixels(workers):
        loader = sample_loader(RankStream(shards, start=0, spec=video_spec), num_workers=workers, prefetch_factor=2)
        return [
            (
                s.id,
                [[bytes(memoryview(np.ascontiguousarray(f))) for f in v] for v in s.videos],
                [bytes(memoryview(np.ascontiguousarray(im))) for im in s.images],
            )
            for s in loader
        ]

    ref = pixels(0)
    assert sum(len(v) for _, v, _ in ref) == 2
    assert pixels(1) == ref


@pytest.mark.slow
@pytest.mark.parametrize("nproc,pack", [(1, False), (1, True), (2, False), (2, True)])
def test_cli_trains_a_video_image_text_dataset(video_data, tmp_path, nproc, pack):
    """Two optimizer steps of `python -m trainer` on videos, images and text, padded and packed, one rank and two
    (FSDP2 on gloo: a rank whose micro-batch has no video runs the placeholder video, or the ranks would hang)."""
    out = tmp_path / "run"
    args = [
        "--data",
        video_data / "out",
        "--out",
        out,
        "--device",
        "cpu",
        "--num-workers",
        1,
        "--max-steps",
        2,
        "--no-shuffle",
    ] + (["--pack-to", 4096] if pack else [])
    if nproc == 1 and not pack:  # an image-only held-out set beside video training: eval runs no video pass
        from vlmprep.builder.pipeline import build
        from vlmprep.config import BuildConfig

        (video_data / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records() if r["id"] in ("i", "t")))
        build(
            BuildConfig(
                inputs=(str(video_data / "h.jsonl"),),
                out=str(tmp_path / "held"),
                processor="builtin:qwen2-vl",
                seq_len=4096,
                progress=False,
                overwrite=True,
            )
        )
        args += ["--eval-data", tmp_path / "held"]
    run_trainer(args, nproc=nproc, timeout=300)
    metrics = [m for m in read_metrics(out) if "sample_ids" in m]  # train steps; the eval line has none
    if "--eval-data" in args:
        assert any(np.isfinite(m.get("eval_loss", np.nan)) for m in read_metrics(out)), read_metrics(out)[-1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(np.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    seen = [i for m in metrics for i in m["sample_ids"]]
    assert any(i in ("v", "vi") for i in seen), seen


@functools.cache
def _builtin(family: str):
    from vlmprep.processors.load import load_processor

    return load_processor(f"builtin:{family}")


@pytest.mark.parametrize("family,frames_", [("qwen2-vl", 3), ("qwen2-vl", 4), ("qwen3-vl", 5)])
def test_pixel_values_videos_equal_the_video_processors(family, frames_):
    """Frames already at the processor's size through Patchifier.videos equal the video processor's own
    pixel_values_videos (its rescale/normalize, the last frame repeated to fill an odd count, its patch order)."""
    processor = _builtin(family)
    vp = processor.video_processor
    side = vp.patch_size * vp.merge_size
    clip = frames(frames_, 3 * side, 2 * side, seed=frames_)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = vp(videos=[clip], do_resize=False, do_sample_frames=False, return_tensors="pt")
    spec = ImageSpec.from_config(processor.image_processor.to_dict(), vp.to_dict())
    got = Patchifier(spec, "cpu").videos([[torch.from_numpy(f) for f in clip]])
    assert want["video_grid_thw"].tolist() == [[-(-frames_ // 2), 2 * vp.merge_size, 3 * vp.merge_size]]
    assert got.dtype == torch.float32 and got.shape == want["pixel_values_videos"].shape
    assert float((got - want["pixel_values_videos"]).abs().max()) <= 1e-6


def _tiny_kwargs(model_type: str) -> dict:
    """A tiny random config's keywords: tests/trainer/test_model.py's for the family, Qwen3-VL's plus 4 experts (2
    per token) for Qwen3-VL-MoE."""
    from tests.trainer.test_model import FAMILIES

    kw = json.loads(json.dumps(FAMILIES[model_type.removesuffix("_moe")][1]))
    if model_type == "qwen2_5_vl":
        kw["vision_config"]["tokens_per_second"] = 2
    if model_type == "qwen3_vl_moe":
        kw["text_config"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return kw


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe"])
def test_other_families_video_loss_and_packed_logits(video_data, family):
    """Tiny random Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE: a video+image sample's loss from shards equals online
    processing (rel. 1e-6), and a packed row of video, image and text samples gives each its own logits (<= 1e-5).
    What a model type must pass before it joins VIDEO_MODELS (with the CLI step-1 loss test below)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    model_type = family.replace(".", "_").replace("-", "_")
    family = family.removesuffix("-moe")  # Qwen3-VL-MoE reads Qwen3-VL's processor
    out = f"out-{family}"
    if not (video_data / out / "manifest.json").exists():
        build(
            BuildConfig(
                inputs=(str(video_data / "r.jsonl"),),
                out=str(video_data / out),
                processor=f"builtin:{family}",
                seq_len=8192,
                progress=False,
                overwrite=True,
            )
        )
    location = str(video_data / out / "processor")
    vspec = ImageSpec.from_config(load_image_processor_config(location), load_video_processor_config(location))
    samples = {s.id: s for s in read_all_samples(video_data / out, vspec)}
    kw = _tiny_kwargs(model_type)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        **kw,
    )
    net = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=vspec.patch_size, merge_size=2, video_token_id=151656, videos=True
    )
    patchify = Patchifier(vspec, "cpu")
    batch = collate([samples["vi"]], spec).to("cpu")
    on, processor = _online(video_data, _records()[3], out, family)
    on_labels = _independent_labels(on["input_ids"][0], processor.tokenizer)[None]
    assert torch.equal(batch.input_ids, on["input_ids"]) and torch.equal(batch.labels, on_labels)
    assert torch.equal(batch.video_grid_thw, on["video_grid_thw"])
    videos = patchify.videos(batch.videos)
    assert float((videos - on["pixel_values_videos"]).abs().max()) <= 1e-6
    extra = {"second_per_grid_ts": on["second_per_grid_ts"]} if "second_per_grid_ts" in on else {}
    if extra:
        assert torch.equal(batch.second_per_grid_ts, on["second_per_grid_ts"].float())
    with torch.no_grad():
        ours = forward_loss(net, batch, patchify(batch.images, batch.image_index), pixel_values_videos=videos)
        ours = ours / batch.num_trained
        logits = net(
            input_ids=on["input_ids"],
            attention_mask=on["attention_mask"],
            mm_token_type_ids=on["mm_token_type_ids"],
            pixel_values=on["pixel_values"],
            image_grid_thw=on["image_grid_thw"],
            pixel_values_videos=on["pixel_values_videos"],
            video_grid_thw=on["video_grid_thw"],
            use_cache=False,
            **extra,
        ).logits
        ref = F.cross_entropy(logits[0, :-1].float(), on_labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")
        ref = ref / (on_labels[0, 1:] != IGNORE_INDEX).sum()
    assert abs(float(ours) - float(ref)) / abs(float(ref)) <= 1e-6, (float(ours), float(ref))
    row = [samples[k] for k in ("v", "i", "t", "vi")]
    packed = _logits(net, collate_packed([row], spec), patchify)
    alone = torch.cat([_logits(net, collate([s], spec), patchify)[: s.num_tokens] for s in row])
    assert float((packed[: len(alone)] - alone).abs().max()) <= 1e-5


@pytest.mark.slow
def test_cli_trains_video_with_a_qwen3_vl_checkpoint_on_two_ranks(video_data, tmp_path):
    """A Qwen3-VL checkpoint dir (tiny, random) trains the video/image/text dataset built for it on two ranks, packed:
    its deepstack vision path runs the placeholder video like Qwen2-VL's."""
    import subprocess

    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.trainer.conftest import ROOT, TORCHRUN, trainer_env
    from tests.trainer.test_model import FAMILIES
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    out = "out-qwen3-vl"
    if not (video_data / out / "manifest.json").exists():
        build(
            BuildConfig(
                inputs=(str(video_data / "r.jsonl"),),
                out=str(video_data / out),
                processor="builtin:qwen3-vl",
                seq_len=8192,
                progress=False,
                overwrite=True,
            )
        )
    cfg = AutoConfig.for_model(
        "qwen3_vl",
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        **FAMILIES["qwen3_vl"][1],
    )
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    for pack in ([], ["--pack-to", 8192]):
        run = tmp_path / f"run{len(pack)}"
        cmd = [
            str(TORCHRUN),
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer",
            "--model",
            tmp_path / "ckpt",
            "--no-progress",
            "--data",
            video_data / out,
            "--out",
            run,
            "--device",
            "cpu",
            "--num-workers",
            1,
            "--max-steps",
            2,
            "--no-shuffle",
            *pack,
        ]
        proc = subprocess.run(
            [str(c) for c in cmd], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        metrics = read_metrics(run)
        assert metrics and all(np.isfinite(m["loss"]) for m in metrics)


@pytest.fixture(scope="module")
def held(video_data):
    """An image/text-only dataset (records i and t) from the same processor: no videos in its manifest."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    (video_data / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records() if r["id"] in ("i", "t")))
    build(
        BuildConfig(
            inputs=(str(video_data / "h.jsonl"),),
            out=str(video_data / "held"),
            processor="builtin:qwen2-vl",
            seq_len=4096,
            progress=False,
            overwrite=True,
        )
    )
    return video_data / "held"


def _reference_eval(net, dataset, vspec) -> tuple[float, int, int]:
    """(mean token loss, trained tokens, samples) of every sample of `dataset`, one sample per forward with full
    logits and no placeholder video: no batching, FSDP, logits_to_keep or all-reduce involved."""
    patchify = Patchifier(vspec, "cpu")
    total, tokens, n = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for s in read_all_samples(dataset, vspec):
            b = collate(
                [s],
                CollateSpec(
                    pad_id=0,
                    image_token_id=151655,
                    patch_size=14,
                    merge_size=2,
                    video_token_id=151656,
                    videos=bool(s.videos),
                ),
            )
            video = (
                dict(pixel_values_videos=patchify.videos(b.videos), video_grid_thw=b.video_grid_thw) if s.videos else {}
            )
            out = net(
                input_ids=b.input_ids.long(),
                attention_mask=b.attention_mask,
                position_ids=b.position_ids.long(),
                mm_token_type_ids=b.mm_token_type_ids.long(),
                pixel_values=patchify(b.images, b.image_index),
                image_grid_thw=b.image_grid_thw,
                use_cache=False,
                **video,
            )
            labels = b.labels[0, 1:]
            trained = labels != IGNORE_INDEX
            total += F.cross_entropy(out.logits[0, :-1].float()[trained], labels[trained], reduction="sum").double()
            tokens, n = tokens + int(trained.sum()), n + 1
    return float(total) / tokens, tokens, n


def test_eval_of_a_video_set_equals_a_single_process_computation(video_data, video_spec, held):
    """In-process, one rank, the run's own eval_loaders + evaluate: a video set runs the video pass in every micro-batch
    and an image-only set none, whether training runs it or not; beside training without it, the video set's eval
    loss (v, i, t, vi; micro-batches of 1, so i and t take the placeholder video) equals one sample per forward with
    full logits (rel. 1e-6). Without a saved video processor a video set is one ConfigError at start-up."""
    import dataclasses

    import torch.distributed as dist

    from trainer.config import ConfigError, TrainConfig
    from trainer.data.datasets import RunData
    from trainer.data.integrity import ShardCheck
    from trainer.data.pipeline import ReadPlan, eval_loaders
    from trainer.data.sources import resolve_data
    from trainer.evaluate import evaluate
    from trainer.options import Batching, DataOptions

    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0))
    cfg = TrainConfig(
        data=str(held),
        tiny_random="qwen2-vl",
        num_workers=0,
        grad_accum=2,
        eval_data=(f"name=vid,path={video_data / 'out'}", f"name=img,path={held}"),
    )
    train_spec = dataclasses.replace(_spec(net), videos=False)
    train_data = dataclasses.replace(resolve_data(str(held)), processor=None)  # skip the (slow) processor check
    plan = ReadPlan(0, False, False, held / "no-cache", 0, 0, ShardCheck(None, enabled=False))

    def eval_sets(spec, collate_spec):  # the run's, over training data whose processor is `spec`
        data = RunData(cfg.sources, [train_data], [], spec, str(held))
        return eval_loaders(
            DataOptions.of(cfg),
            plan,
            data,
            batching=Batching.of(cfg),
            collate_spec=collate_spec,
            model_type="qwen2_vl",
            eval_every=0,
        )

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for videos in (True, False):  # training with and without the video pass
            sets = eval_sets(video_spec, dataclasses.replace(train_spec, videos=videos))
            assert [s.loader.collate_spec.videos for s in sets] == [True, False]
        with pytest.raises(ConfigError, match="holds videos, but the training data's processor saved no video"):
            eval_sets(dataclasses.replace(video_spec, video=None), train_spec)
        row = evaluate(net, sets[:1], step=3, device=torch.device("cpu"), patchifier=Patchifier(video_spec, "cpu"))
    finally:
        dist.destroy_process_group()
    assert net.training  # restored
    loss, tokens, samples = _reference_eval(net.eval(), video_data / "out", video_spec)
    assert (row["eval_tokens"], row["eval_samples"]) == (tokens, samples) == (tokens, 4)
    assert row["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0)


@pytest.mark.slow  # two torchrun runs of 2 steps with an eval after each: ~1 min on 2 shared cores
@pytest.mark.parametrize("train", ["held", "out"])
def test_two_ranks_eval_a_video_set_beside_training_with_and_without_videos(
    video_data, video_spec, held, tmp_path, train
):
    """2 ranks (FSDP2 on gloo), micro-batches of 1, eval after every step over a video set (one shard: rank 0 reads v
    and t, rank 1 i and vi, so one rank's micro-batch holds a video while the other's does not) and an image-only
    set, training on image-only data (no video pass in training) or on the video data. The run completes (no
    collective mismatch or hang) and the final eval equals the reference per set (rel. 1e-6)."""
    from tests.trainer.test_eval import final_model

    out = tmp_path / "run"
    run_trainer(
        [
            "--data",
            video_data / train,
            "--out",
            out,
            "--device",
            "cpu",
            "--num-workers",
            1,
            "--max-steps",
            2,
            "--no-shuffle",
            "--lr",
            1e-3,
            "--eval-every",
            1,
            "--eval-data",
            f"name=vid,path={video_data / 'out'}",
            "--eval-data",
            f"name=img,path={held}",
            "--no-tensorboard",
        ],
        nproc=2,
        timeout=400,
    )
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all(r["eval_samples"] == 6 for r in evals)
    net = final_model(out)
    last = evals[-1]
    for name, path in (("vid", video_data / "out"), ("img", held)):
        loss, tokens, _ = _reference_eval(net, path, video_spec)
        assert last["eval_tokens_by_source"][name] == tokens
        assert last["eval_loss_by_source"][name] == pytest.approx(loss, rel=1e-6, abs=0), name


@pytest.mark.slow  # a shard build for the family and a CLI run of one step: ~30 s on 2 shared cores
@pytest.mark.parametrize("family,model_type", [("qwen2.5-vl", "qwen2_5_vl"), ("qwen3-vl", "qwen3_vl_moe")])
def test_cli_step_one_loss_of_a_checkpoint_equals_online_processing(video_data, tmp_path, family, model_type):
    """`python -m trainer --model DIR` (a tiny random checkpoint of the model type, saved from its config) trains the
    video/image/text dataset built for its family: step 1 (micro-batches of 1, grad_accum 4: all four samples) has
    the loss of the same checkpoint on online `apply_chat_template` output, one record per forward (rel. 1e-6).
    Qwen3-VL-MoE reads Qwen3-VL's processor: its shards are the qwen3-vl build."""
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.trainer.conftest import ROOT, trainer_env

    out = f"out-{family}"
    if not (video_data / out / "manifest.json").exists():
        from vlmprep.builder.pipeline import build
        from vlmprep.config import BuildConfig

        build(
            BuildConfig(
                inputs=(str(video_data / "r.jsonl"),),
                out=str(video_data / out),
                processor=f"builtin:{family}",
                seq_len=8192,
                progress=False,
                overwrite=True,
            )
        )
    kw = _tiny_kwargs(model_type)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        **kw,
    )
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--model",
        tmp_path / "ckpt",
        "--no-progress",
        "--data",
        video_data / out,
        "--out",
        run,
        "--device",
        "cpu",
        "--num-workers",
        0,
        "--max-steps",
        1,
        "--no-shuffle",
        "--grad-accum",
        4,
        "--no-tensorboard",
    ]
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (step,) = read_metrics(run)
    assert sorted(step["sample_ids"]) == ["i", "t", "v", "vi"]
    net = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    total, tokens = 0.0, 0
    for record in _records():
        on, processor = _online(video_data, record, out, family)
        labels = _independent_labels(on["input_ids"][0], processor.tokenizer)[1:]
        with torch.no_grad():
            logits = net(**{k: v for k, v in on.items() if k != "token_type_ids"}, use_cache=False).logits
        total += float(F.cross_entropy(logits[0, :-1].double(), labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += int((labels != IGNORE_INDEX).sum())
    assert step["num_trained_tokens"] == tokens
    assert abs(step["loss"] - total / tokens) / (total / tokens) <= 1e-6, (step["loss"], total / tokens)
