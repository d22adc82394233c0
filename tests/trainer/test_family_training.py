"""Every family vlmprep renders, the trainer trains: for each --tiny-random NAME, a one-record dataset (an image and two
question/answer turns) built with `tiny:NAME` (or `builtin:NAME`), one step of `python -m trainer` with an lr that
changes nothing, --save-hf: the step-1 loss in metrics.jsonl equals the exported model's own loss on the processor's
own apply_chat_template of the raw record (AutoModelForImageTextToText + AutoProcessor from RUN/hf), labels = the
shard's input_ids where loss_mask is 1, and the token ids are the shard's."""
import base64
import io
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.families import BY_NAME, FAMILIES

# make test: one family per pixel path and attention kind (Qwen's patchify on the device; a fixed-size SigLIP with
# bidirectional image tokens; tiles with cross-attention; a mixture of experts; a packable host family). The rest
# run in make test-all.
FAST = ("qwen2.5-vl", "gemma-3", "llama-3.2-vision", "llama-4", "mistral-3")
NAMES = [pytest.param(f.name, marks=() if f.name in FAST else pytest.mark.slow) for f in FAMILIES]


def _png(w: int, h: int, seed: int) -> tuple[str, Image.Image]:
    a = np.random.default_rng(seed).integers(0, 255, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), Image.fromarray(a)


def one_record(tmp_path, *, width=120, height=90):
    """The record (an image, then two question/answer turns) and its messages as a processor takes them."""
    uri, image = _png(width, height, 0)
    record = {"id": "r", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                     {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And the page?"},
        {"role": "assistant", "content": "The page shows a green banner."}]}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path, record, image


def processor_messages(record: dict, image: Image.Image, string_content: bool) -> list[dict]:
    """The raw record as apply_chat_template takes it: image parts as {"type": "image"}; text-only messages as a
    string where the family's template prints content as one (GLM), else as text parts."""
    out = []
    for m in record["messages"]:
        c = m["content"]
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c if string_content else [{"type": "text", "text": c}]})
        else:
            out.append({"role": m["role"], "content": [{"type": "image", "image": image} if p["type"] == "image_url"
                                                       else p for p in c]})
    return out


def build_one(tmp_path, processor: str) -> tuple:
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    path, record, image = one_record(tmp_path)
    build(BuildConfig(inputs=(str(path),), out=str(tmp_path / "ds"), processor=processor, progress=False))
    return tmp_path / "ds", record, image


def shard_sample(ds):
    from vlmprep.shards.reader import iter_dataset

    [s] = list(iter_dataset(ds))
    return s


def train_one_step(ds, out, name: str, *extra: str) -> dict:
    from trainer.train import main

    assert main(["--data", str(ds), "--out", str(out), "--tiny-random", name, "--lr", "1e-30", "--max-steps", "1",
                 "--no-shuffle", "--no-shuffle-shards", "--num-workers", "0", "--save-hf", "--export-dtype", "fp32",
                 "--no-progress", *extra]) == 0
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def own_loss(hf, record, image, sample, string_content: bool) -> tuple[float, torch.Tensor]:
    """The exported model's loss on the processor's own rendering of the raw record, labels from the shard."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(hf, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(hf, local_files_only=True, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = processor.apply_chat_template(processor_messages(record, image, string_content), tokenize=True,
                                               return_dict=True, return_tensors="pt")
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}  # Llama 4's come as bf16
    ids = torch.as_tensor(sample.array("input_ids")).long()[None]
    labels = torch.where(torch.as_tensor(sample.array("loss_mask")).bool()[None], ids, -100)
    with torch.no_grad():
        loss = model(**inputs, labels=labels).loss
    return float(loss), inputs["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_each_family_trains_and_its_export_gives_the_same_loss(name, tmp_path):
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    family = BY_NAME[name]
    ds, record, image = build_one(tmp_path, f"tiny:{name}")
    sample = shard_sample(ds)
    row = train_one_step(ds, tmp_path / "run", name)
    string_content = RENDER_FAMILIES[family.processor_classes[0]].string_content
    loss, ids = own_loss(tmp_path / "run" / "hf", record, image, sample, string_content)
    assert ids[0].tolist() == sample.array("input_ids").tolist()
    assert row["loss"] == pytest.approx(loss, rel=1e-5), (name, row["loss"], loss)
    # The model is the family's real class, its vocabulary the processor's.
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert config["model_type"] in family.model_types
    text = config.get("text_config", config)
    assert text["vocab_size"] == len(json.loads((tmp_path / "run" / "hf" / "tokenizer.json").read_text())["model"]
                                     ["vocab"]) + len(json.loads((tmp_path / "run" / "hf" / "tokenizer.json")
                                                                 .read_text())["added_tokens"])


def test_a_dataset_of_another_family_is_refused_in_one_line(tmp_path, capsys):
    from trainer.train import main

    ds, _, _ = build_one(tmp_path, "tiny:gemma-3")
    assert main(["--data", str(ds), "--out", str(tmp_path / "run"), "--tiny-random", "smolvlm", "--max-steps",
                 "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was rendered with Gemma3Processor (gemma-3), but the model is smolvlm" in err[0]
