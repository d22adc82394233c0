"""Shards vs online rendering: the same records through the processor's own apply_chat_template (which resizes
the source images itself) must give the same batch and the same tiny-model loss."""

import io

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.trainer.conftest import TRACES, read_all_samples
from trainer.data.collate import IGNORE_INDEX, CollateSpec, collate
from trainer.data.vision import Patchifier
from trainer.model import build_model, forward_loss
from trainer.options import ModelOptions


def _messages(processor, conv):
    from vlmprep.render.sample import RenderContext, template_messages

    ctx = RenderContext(processor)
    return ctx.messages(conv) if hasattr(ctx, "messages") else template_messages(conv)


def _online(processor, record) -> dict:
    from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
    from vlmprep.types import Source

    conv = normalize_record(record, Source("/tmp/traces.jsonl", 1), NormalizeOptions())
    msgs = _messages(processor, conv)
    pil = iter([Image.open(io.BytesIO(im.data)) for im in conv.images])
    for m in msgs:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = next(pil)
    return processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")


def _independent_labels(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Trained = what follows each `<|im_start|>assistant\\n` header, up to and including the next <|im_end|>."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids.tolist()
    labels = [IGNORE_INDEX] * len(ids)
    for k in range(len(ids) - len(header) + 1):
        if ids[k : k + len(header)] == header:
            j = k + len(header)
            while ids[j] != im_end:
                labels[j] = ids[j]
                j += 1
            labels[j] = im_end
    return torch.tensor(labels)


def _pad(rows, value, length):
    return torch.stack([F.pad(r, (0, length - len(r)), value=value) for r in rows])


@pytest.fixture(scope="module")
def processor(dataset):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(dataset / "processor"), local_files_only=True)


def test_shard_batches_equal_online_rendering_and_give_the_same_loss(dataset, image_spec, processor):
    from scripts.demo_traces import generate_traces

    records = {r["id"]: r for r in generate_traces(**TRACES)}
    samples = read_all_samples(dataset, image_spec)
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    spec = CollateSpec(pad_id=0, image_token_id=int(net.config.image_token_id), patch_size=14, merge_size=2)
    patchify = Patchifier(image_spec, "cpu")
    groups = [samples[k : k + 4] for k in range(0, len(samples), 4)]
    mixed = [g for g in groups if any(s.image_index for s in g) and any(not s.image_index for s in g)]
    assert mixed, "fixture must put text-only and image samples in one batch"
    worst = 0.0
    # Inputs for every sample; the (slow, full-logits) loss comparison for two batches, one of them mixed.
    for k, group in enumerate(groups):
        if not any(s.image_index for s in group):
            continue
        with_loss = group is mixed[0] or k == 0
        batch = collate(group, spec).to("cpu")  # what the model receives
        online = [_online(processor, records[s.id]) for s in group]
        L = batch.input_ids.shape[1]
        assert L == max(o["input_ids"].shape[1] for o in online)
        on_ids = _pad([o["input_ids"][0] for o in online], 0, L)
        on_mask = _pad([o["attention_mask"][0] for o in online], 0, L)
        on_mm = _pad([o["mm_token_type_ids"][0] for o in online], 0, L)
        on_labels = _pad([_independent_labels(o["input_ids"][0], processor.tokenizer) for o in online], IGNORE_INDEX, L)
        on_pixels = torch.cat([o["pixel_values"] for o in online if "pixel_values" in o])
        on_grid = torch.cat([o["image_grid_thw"] for o in online if "image_grid_thw" in o])
        pixel_values = patchify(batch.images, batch.image_index)

        assert torch.equal(batch.input_ids, on_ids)
        assert torch.equal(batch.attention_mask, on_mask)
        assert torch.equal(batch.labels, on_labels)
        assert torch.equal(batch.mm_token_type_ids, on_mm)
        assert torch.equal(batch.image_grid_thw, on_grid)
        assert pixel_values.shape == on_pixels.shape and float((pixel_values - on_pixels).abs().max()) == 0.0

        if not with_loss:
            continue
        with torch.no_grad():
            ours = forward_loss(net, batch, pixel_values) / batch.num_trained
            # Online side: the model computes its own MRoPE positions and full logits.
            logits = net(
                input_ids=on_ids,
                attention_mask=on_mask,
                mm_token_type_ids=on_mm,
                pixel_values=on_pixels,
                image_grid_thw=on_grid,
                use_cache=False,
            ).logits
            ref = (
                F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(),
                    on_labels[:, 1:].flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                / (on_labels[:, 1:] != IGNORE_INDEX).sum()
            )
        rel = abs(float(ours) - float(ref)) / abs(float(ref))
        worst = max(worst, rel)
        assert rel <= 1e-6, (float(ours), float(ref))
    print(f"parity: worst relative loss difference {worst:.2e}")
