"""Video training: shard samples with videos give the batch and the tiny-model loss of online processing, packed
rows with video segments isolate each sample, and the CLI trains a mixed video/image/text dataset (with and
without --pack-to)."""
from __future__ import annotations

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
from trainer.collate import IGNORE_INDEX, CollateSpec, collate
from trainer.model import build_model, forward_loss
from trainer.pack import collate_packed
from trainer.shards import load_image_processor_config, load_video_processor_config
from trainer.vision import ImageSpec, Patchifier

CLIPS = [(9, 4, 64, 48), (6, 2, 56, 56)]  # frames, fps, width, height: an odd sampled count and an even one


def _records() -> list[dict]:
    user = lambda *parts: {"role": "user", "content": list(parts)}  # noqa: E731
    video = lambda k: {"type": "video", "video": f"c{k}.mp4"}  # noqa: E731
    image = {"type": "image_url", "image_url": {"url": "s.png"}}
    return [{"id": "v", "messages": [user(video(0), {"type": "text", "text": "what moves"}),
                                     {"role": "assistant", "content": "a square"}]},
            {"id": "i", "messages": [user(image, {"type": "text", "text": "what is it"}),
                                     {"role": "assistant", "content": "a picture"}]},
            {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"id": "vi", "messages": [user(video(1), image, {"type": "text", "text": "both"}),
                                      {"role": "assistant", "content": "a clip and a picture"}]}]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
    from vlmprep.config import BuildConfig
    from vlmprep.pipeline import build

    d = tmp_path_factory.mktemp("videodata")
    for k, (n, fps, w, h) in enumerate(CLIPS):
        (d / f"c{k}.mp4").write_bytes(encode(frames(n, w, h, seed=k), fps))
    Image.fromarray(frames(1, 60, 40, seed=7)[0]).save(d / "s.png")
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    build(BuildConfig(inputs=(str(d / "r.jsonl"),), out=str(d / "out"), processor="builtin:qwen2-vl", seq_len=4096,
                      progress=False, overwrite=True))
    return d


@pytest.fixture(scope="module")
def video_spec(video_data):
    location = str(video_data / "out" / "processor")
    return ImageSpec.from_config(load_image_processor_config(location), load_video_processor_config(location))


def _online(d, record) -> dict:
    """processor.apply_chat_template on the record, each video as all its PyAV frames, the processor sampling them."""
    from transformers.video_utils import VideoMetadata

    from vlmprep.normalize import normalize_record
    from vlmprep.processor import load_processor
    from vlmprep.task import Renderer
    from vlmprep.config import BuildConfig
    from vlmprep.types import Source

    processor = load_processor(str(d / "out" / "processor"))
    r = Renderer(BuildConfig(inputs=(str(d / "r.jsonl"),), out=str(d / "out"), processor="builtin:qwen2-vl"),
                 processor, saved=True)
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
        out = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt",
                                            do_sample_frames=True, fps=2.0, video_metadata=meta or None)
    return out, processor


def _spec(net) -> CollateSpec:
    return CollateSpec(pad_id=0, image_token_id=int(net.config.image_token_id), patch_size=14, merge_size=2,
                       video_token_id=int(net.config.video_token_id))


@pytest.mark.parametrize("sample_id", ["v", "vi"])
def test_video_sample_batch_and_loss_equal_online_processing(video_data, video_spec, sample_id):
    samples = {s.id: s for s in read_all_samples(video_data / "out", video_spec)}
    records = {r["id"]: r for r in _records()}
    net = build_model(tiny_random="qwen2-vl", seed=0).eval()
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
    rope, _ = net.model.get_rope_index(on["input_ids"], mm_token_type_ids=on["mm_token_type_ids"],
                                       image_grid_thw=on.get("image_grid_thw"), video_grid_thw=on["video_grid_thw"],
                                       attention_mask=on["attention_mask"])
    assert torch.equal(batch.position_ids[..., :n], rope)
    with torch.no_grad():
        ours = forward_loss(net, batch, pixels, pixel_values_videos=videos) / batch.num_trained
        logits = net(input_ids=on["input_ids"], attention_mask=on["attention_mask"],
                     mm_token_type_ids=on["mm_token_type_ids"], pixel_values=on.get("pixel_values"),
                     image_grid_thw=on.get("image_grid_thw"), pixel_values_videos=on["pixel_values_videos"],
                     video_grid_thw=on["video_grid_thw"], use_cache=False).logits
        ref = F.cross_entropy(logits[0, :-1].float(), on_labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")
        ref = ref / (on_labels[0, 1:] != IGNORE_INDEX).sum()
    assert abs(float(ours) - float(ref)) / abs(float(ref)) <= 1e-6, (float(ours), float(ref))
