"""Every family vlmprep renders, the trainer trains: for each --tiny-random NAME, a dataset built with `tiny:NAME` (or
`builtin:NAME`) of three records trained as one micro-batch (two images of different sizes in one sample, a text-only
sample beside it, a one-image sample), one step of `python -m trainer` with an lr that changes nothing, --save-hf: the
step-1 loss in metrics.jsonl equals the exported model's own loss on the processor's own apply_chat_template of the
raw records (AutoModelForImageTextToText + AutoProcessor from RUN/hf, right padding), labels = the shard's
input_ids where loss_mask is 1, and the token ids are the shard's; the trainer's and the Collator's forward inputs
are that processor call's, bit for bit."""

import base64
import dataclasses
import io
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.families import BY_NAME, FAMILIES

# make test: one family per pixel path and attention kind (Qwen's patchify on the device; a fixed-size SigLIP with
# bidirectional image tokens; tiles with cross-attention; a mixture of experts; a packable host family; a processor
# that takes a sample's one image and several by different paths). The rest run in make test-all.
FAST = ("qwen2.5-vl", "gemma-3", "llama-3.2-vision", "llama-4", "mistral-3", "llava-onevision")
NAMES = [pytest.param(f.name, marks=() if f.name in FAST else pytest.mark.slow) for f in FAMILIES]


def _png(w: int, h: int, seed: int) -> tuple[str, Image.Image]:
    a = np.random.default_rng(seed).integers(0, 255, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), Image.fromarray(a)


def _jpeg(w: int, h: int, seed: int) -> tuple[str, Image.Image]:
    """A JPEG photo as a data URI, and the image the processor gets from the raw record (its decode): stored as its
    source bytes by the default --image-format auto, decoded and resized by the loader."""
    from tests.vlmprep.test_images import photo

    buf = io.BytesIO()
    photo(w, h, seed).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode(), Image.open(io.BytesIO(buf.getvalue()))


def storages(ds) -> set[str]:
    """The image member kinds a dataset holds (`orig.jpg`, `pdelta.zst`, ...)."""
    return {m["member"].split(".", 1)[1] for s in shard_samples(ds) for m in s.meta()["images"]}


def one_record(tmp_path, *, width=120, height=90):
    """The record (an image, then two question/answer turns) and its messages as a processor takes them."""
    uri, image = _png(width, height, 0)
    record = {
        "id": "r",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uri}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            },
            {"role": "assistant", "content": "A red square."},
            {"role": "user", "content": "And the page?"},
            {"role": "assistant", "content": "The page shows a green banner."},
        ],
    }
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path, record, image


def batch_records(tmp_path) -> tuple[Path, list[dict], list[list[Image.Image]]]:
    """The records a parity step trains as one micro-batch, and each one's images in order: "two" holds two images of
    different sizes (one per user turn), "text" none, "one" a single image (LLaVA-OneVision tiles a sample's one
    image but pads each of several to a square: both paths in one batch). The photos are JPEGs, the other a PNG:
    the default --image-format auto stores the photos as their source bytes and the PNG as pixels, so "two" mixes
    both storages in one sample."""
    (u1, i1), (u2, i2), (u3, i3) = _jpeg(120, 90, 0), _png(64, 96, 1), _jpeg(100, 60, 2)
    two, one = image_records(u1, u2, u3)
    text = {
        "id": "text",
        "messages": [
            {"role": "user", "content": "Open the page, then type the query."},
            {"role": "assistant", "content": "Done: the page is open."},
        ],
    }
    records = [two, text, one]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records, [[i1, i2], [], [i3]]


def image_records(u1: str, u2: str, u3: str) -> tuple[dict, dict]:
    """Record "two" (images u1 and u2, one per user turn) and record "one" (image u3): image URIs."""

    def user(uri, text):
        return {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}],
        }

    two = {
        "id": "two",
        "messages": [
            user(u1, "What is in this picture?"),
            {"role": "assistant", "content": "A red square."},
            user(u2, "And on this page?"),
            {"role": "assistant", "content": "The page shows a green banner."},
        ],
    }
    return two, {
        "id": "one",
        "messages": [user(u3, "Describe the image."), {"role": "assistant", "content": "Three banners."}],
    }


def processor_messages(record: dict, images: list[Image.Image], string_content: bool) -> list[dict]:
    """The raw record as apply_chat_template takes it: image parts as {"type": "image"} with `images` in order;
    text-only messages as a string where the family's template prints content as one (GLM), else as text parts."""
    out, left = [], iter(images)
    for m in record["messages"]:
        c = m["content"]
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c if string_content else [{"type": "text", "text": c}]})
        else:
            out.append(
                {
                    "role": m["role"],
                    "content": [{"type": "image", "image": next(left)} if p["type"] == "image_url" else p for p in c],
                }
            )
    return out


def processor_inputs(processor, records: list[dict], images: list[list], string_content: bool) -> dict:
    """What the processor gives at inference for these records as one batch (right padding), floats in fp32 (Llama
    4's come as bf16)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor.apply_chat_template(
            [processor_messages(r, i, string_content) for r, i in zip(records, images)],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"padding": True, "padding_side": "right"},
        )
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}


def build_one(tmp_path, processor: str) -> tuple:
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    path, record, image = one_record(tmp_path)
    build(BuildConfig(inputs=(str(path),), out=str(tmp_path / "ds"), processor=processor, progress=False))
    return tmp_path / "ds", record, image


def shard_sample(ds):
    [s] = shard_samples(ds)
    return s


def shard_samples(ds) -> list:
    from vlmprep.shards.reader import iter_dataset

    return list(iter_dataset(ds))


def build_batch(tmp_path, processor: str) -> tuple:
    """batch_records built with `processor`: (dataset dir, records, images per record)."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    path, records, images = batch_records(tmp_path)
    build(BuildConfig(inputs=(str(path),), out=str(tmp_path / "ds"), processor=processor, progress=False))
    return tmp_path / "ds", records, images


def train_one_step(ds, out, name: str, *extra: str) -> dict:
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                str(ds),
                "--out",
                str(out),
                "--tiny-random",
                name,
                "--lr",
                "1e-30",
                "--max-steps",
                "1",
                "--no-shuffle",
                "--no-shuffle-shards",
                "--num-workers",
                "0",
                "--save-hf",
                "--export-dtype",
                "fp32",
                "--no-progress",
                *extra,
            ]
        )
        == 0
    )
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def own_loss(hf, records, images, samples, string_content: bool) -> tuple[float, torch.Tensor]:
    """The exported model's loss on the processor's own rendering of the raw records as one batch (right padding),
    labels from the shard; and the processor's token ids (B x L)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(hf, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(hf, local_files_only=True, dtype=torch.float32).eval()
    inputs = processor_inputs(processor, records, images, string_content)
    labels = torch.full_like(inputs["input_ids"], -100)
    for b, sample in enumerate(samples):
        ids = torch.as_tensor(sample.array("input_ids")).long()
        labels[b, : len(ids)] = torch.where(torch.as_tensor(sample.array("loss_mask")).bool(), ids, -100)
    with torch.no_grad():
        loss = model(**inputs, labels=labels).loss
        # And it serves: generate from the first question, as docs/export-and-serving.md does.
        prompt = processor.apply_chat_template(
            processor_messages(records[0], images[0], string_content)[:1],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        prompt = {k: v.float() if v.is_floating_point() else v for k, v in prompt.items()}
        out = model.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    return float(loss), inputs["input_ids"]


def assert_same_tokens(ids: torch.Tensor, samples: list) -> None:
    """The processor's rows (B x L, right-padded) are the shard samples' token ids."""
    assert ids.shape[0] == len(samples)
    for row, sample in zip(ids, samples):
        want = sample.array("input_ids").tolist()
        assert row[: len(want)].tolist() == want, sample.meta()["id"]


@pytest.fixture(scope="module")
def batch_datasets(tmp_path_factory):
    """family -> batch_records built with tiny:NAME, made once per module (the pixel and the training tests share it)."""
    made: dict = {}

    def get(name: str) -> tuple:
        if name not in made:
            made[name] = build_batch(tmp_path_factory.mktemp(f"batch-{name}"), f"tiny:{name}")
        return made[name]

    return get


@pytest.fixture(scope="module", params=NAMES)
def trained(request, tmp_path_factory, batch_datasets):
    """Per family: batch_records built with tiny:NAME, and one trainer step on its three samples as one micro-batch
    (--save-hf)."""
    name = request.param
    ds, records, images = batch_datasets(name)
    run = tmp_path_factory.mktemp(name) / "run"
    return name, ds, records, images, train_one_step(ds, run, name, "--micro-batch-size", "3"), run


def test_each_family_trains_and_its_export_gives_the_same_loss(trained):
    """Two images of different sizes in one sample, a text-only sample beside it and a one-image sample, one
    micro-batch: the step-1 loss is the exported model's own on the processor's batch of the raw records."""
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    name, ds, records, images, row, run = trained
    family = BY_NAME[name]
    samples = shard_samples(ds)
    assert storages(ds) == {"orig.jpg", "pdelta.zst"}  # both storages of the default, in one micro-batch
    assert [s.meta()["id"] for s in samples] == [r["id"] for r in records] and row["num_samples"] == 3
    string_content = RENDER_FAMILIES[family.processor_classes[0]].string_content
    loss, ids = own_loss(run / "hf", records, images, samples, string_content)
    assert_same_tokens(ids, samples)
    assert row["loss"] == pytest.approx(loss, rel=1e-5), (name, row["loss"], loss)
    # The model is the family's real class, its vocabulary the processor's.
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["model_type"] in family.model_types
    tokenizer = json.loads((run / "hf" / "tokenizer.json").read_text())
    assert config.get("text_config", config)["vocab_size"] == len(tokenizer["model"]["vocab"]) + len(
        tokenizer["added_tokens"]
    )


@pytest.mark.slow  # two trainer runs with an export (~20 s of CPU): make test is at its budget
# pixels normalized on the device; patchified there; resized in the workers, then patchified or tiled on the device;
# uint8 from the workers, rescaled and normalized on the device
@pytest.mark.parametrize(
    "name", ["gemma-3", "qwen2-vl", "gemma-4", "llama-3.2-vision", "llama-4", "internvl", "smolvlm", "llava-onevision"]
)
def test_eval_with_the_devices_pixel_values_is_the_exported_models_own_loss(name, tmp_path, batch_datasets):
    """--eval-data makes its pixel inputs as training does (trainer/evaluate.py: Patchifier.inputs): the eval row over
    the three samples equals the exported model's own loss on the processor's batch of the raw records (lr 1e-30:
    the step leaves the weights as they were)."""
    from tests.trainer.conftest import read_metrics
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    ds, records, images = batch_datasets(name)
    train_one_step(ds, tmp_path / "run", name, "--micro-batch-size", "3", "--eval-data", str(ds))
    [row] = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    string_content = RENDER_FAMILIES[BY_NAME[name].processor_classes[0]].string_content
    loss, _ = own_loss(tmp_path / "run" / "hf", records, images, shard_samples(ds), string_content)
    assert row["eval_samples"] == 3 and row["eval_loss"] == pytest.approx(loss, rel=1e-5), (row, loss)


def test_each_familys_collator_with_hf_trainer_gives_the_trainers_step_1_loss(trained, tmp_path):
    """The Collator (vlmprep/clients/collate.py) as HF Trainer's data_collator over the HF datasets reader, the same
    tiny model (same seed, vocabulary), the same micro-batch of three: its step-1 loss is the trainer's."""
    from transformers import Trainer, TrainingArguments

    import vlmprep.clients.hf
    from trainer.model import build_model, tiny_vocab
    from trainer.options import ModelOptions
    from vlmprep.clients.collate import Collator

    name, ds, _, _, row, _ = trained
    model = build_model(ModelOptions(tiny_random=name, seed=0), tiny_vocab(name, str(ds / "processor")))
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf-run"),
        max_steps=1,
        per_device_train_batch_size=3,
        learning_rate=1e-30,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        save_strategy="no",
        dataloader_num_workers=0,
        accelerator_config={"dispatch_batches": False},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=model, args=args, train_dataset=vlmprep.clients.hf.iterable_dataset(ds), data_collator=Collator(ds)
        )
        trainer.train()
    [step] = [e for e in trainer.state.log_history if "loss" in e]
    assert step["loss"] == pytest.approx(row["loss"], rel=1e-5), (name, step["loss"], row["loss"])


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_each_familys_trainer_and_collator_inputs_are_the_processors_on_the_raw_records(name, batch_datasets):
    """batch_records as one micro-batch (two images of different sizes in one sample, a text-only sample beside it,
    a one-image sample), and the two-image sample alone: the trainer's forward inputs (collate + model_inputs: the
    dataset's image processor on the host, or Qwen's patchify) and the Collator's hold, bit for bit, every tensor the
    dataset's processor gives on apply_chat_template of the raw records, and no other pixel input."""
    ds, records, images = batch_datasets(name)
    assert storages(ds) == {"orig.jpg", "pdelta.zst"}  # both storages of the default, "two" mixing them
    assert_inputs_are_the_processors(name, ds, records, images, ([0, 1, 2], [0]))


def assert_inputs_are_the_processors(name: str, ds, records: list[dict], images: list[list], batches) -> None:
    """Each list of rows in `batches` as one micro-batch: the trainer's forward inputs and the Collator's hold, bit
    for bit, every tensor the dataset's processor gives on apply_chat_template of those raw records."""
    from transformers import AutoProcessor

    import vlmprep.clients.hf
    from trainer.data.collate import collate
    from trainer.data.datasets import RunData
    from trainer.metrics import FlopCounter
    from trainer.model import build_model, collate_spec_of, model_inputs, tiny_vocab
    from trainer.options import ModelOptions
    from vlmprep.clients.collate import Collator
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    samples, spec = _decoded(ds)
    processor_dir = str(ds / "processor")
    net = build_model(ModelOptions(tiny_random=name, seed=0), tiny_vocab(name, processor_dir)).eval()
    cspec = collate_spec_of(net, RunData((), [], [], spec, "", processor_dir), processor_dir)
    clients, collator = list(vlmprep.clients.hf.iterable_dataset(ds)), Collator(ds)
    processor = AutoProcessor.from_pretrained(processor_dir, local_files_only=True)
    string_content = RENDER_FAMILIES[BY_NAME[name].processor_classes[0]].string_content
    assert [s.id for s in samples] == [r["id"] for r in records]
    for rows in batches:
        want = processor_inputs(processor, [records[k] for k in rows], [images[k] for k in rows], string_content)
        batch = collate([samples[k] for k in rows], cspec)
        trainer = model_inputs(net, batch, _patchify(spec, batch))
        client = collator([clients[k] for k in rows])
        for who, got in (("trainer", trainer), ("collator", client)):
            # Positions and labels are the shard's (the processor makes neither); every other key is the processor's.
            assert got.keys() - {"position_ids", "use_cache", "labels"} <= want.keys(), (who, got.keys() - want.keys())
            for k, v in want.items():
                assert k in got and got[k].shape == v.shape, (name, rows, who, k)
                same = (
                    torch.equal(got[k].float(), v.float())
                    if v.is_floating_point()
                    else torch.equal(got[k].long(), v.long())
                )
                assert same, (name, rows, who, k, float((got[k].float() - v.float()).abs().max()))
        # FLOPs count the patches of the processor's pixel_values where the device makes them
        if BY_NAME[name].pixels in ("normalize", "patches", "tiles", "uint8"):
            host = dataclasses.replace(batch, vision={**batch.vision, "pixel_values": want["pixel_values"]})
            assert FlopCounter(net).step([batch]) == FlopCounter(net).step([host]) > FlopCounter(net).step([])


@pytest.mark.parametrize(
    "name, jpeg, png",
    [
        ("gemma-4", (1400, 1000), (1100, 800)),
        ("llama-3.2-vision", (1400, 1000), (1300, 1200)),
        ("smolvlm", (2400, 1400), (2200, 1000)),
    ],
)
@pytest.mark.parametrize("built_before", [False, True], ids=["now", "built-before"])
def test_large_images_stored_at_their_first_resize_give_the_processors_inputs(
    name, jpeg, png, built_before, tmp_path, monkeypatch
):
    """Gemma 4, Llama 3.2 Vision and SmolVLM store a large image at its processor's first resize (where it is a
    fixed point, vlmprep_schemas.resize): a JPEG photo (kept as its bytes or its resized pixels, as auto chooses) and
    a PNG beside it in one sample, and a record of the photo alone: the trainer's and the Collator's inputs are the
    processor's on the raw records, which resizes the sources itself. built-before: the same records built as
    vlmprep built them before it stored that resize (the sources, the JPEG kept as its bytes): read the same."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep_schemas import resize as R

    (u1, i1), (u2, i2) = _jpeg(*jpeg, 3), _jpeg(*png, 4)
    u2 = "data:image/png;base64," + base64.b64encode(_png_bytes(i2)).decode()
    records = list(image_records(u1, u2, u1))
    path = tmp_path / "large.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = tmp_path / "ds"
    with monkeypatch.context() as m:
        if built_before:
            m.setattr(R, "FIXED_POINT_MODES", {})
        build(BuildConfig(inputs=(str(path),), out=str(ds), processor=f"tiny:{name}", progress=False))
    metas = [im for s in shard_samples(ds) for im in s.meta()["images"]]
    # Now every image is stored smaller than its source: the resize (an orig.* member is resized on load); built
    # before, the sources, the JPEG kept as its bytes.
    for im in metas:
        source = im["source_height"] * im["source_width"]
        assert (im["height"] * im["width"] == source) if built_before else (im["height"] * im["width"] < source), im
    assert not built_before or ".orig." in metas[0]["member"]
    assert_inputs_are_the_processors(name, ds, records, [[i1, i2], [i1]], ([0, 1], [1]))


def _png_bytes(im) -> bytes:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def test_a_dataset_of_another_family_is_refused_in_one_line(tmp_path, capsys):
    from trainer.train import main

    ds, _, _ = build_one(tmp_path, "tiny:gemma-3")
    assert (
        main(["--data", str(ds), "--out", str(tmp_path / "run"), "--tiny-random", "smolvlm", "--max-steps", "1"]) == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was rendered with Gemma3Processor (gemma-3), but the model is smolvlm" in err[0]


def three_records(tmp_path, photo: bool = False) -> Path:
    """Two records with an image each (different sizes; with `photo` the first a JPEG photo, stored as its bytes, the
    other a PNG) and a text-only one: what one packed row holds."""
    records = []
    for k, (w, h) in enumerate([(120, 90), (64, 96)]):
        uri, _ = (_jpeg if photo and k == 0 else _png)(w, h, k + 1)
        records.append(
            {
                "id": f"i{k}",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": uri}},
                            {"type": "text", "text": "Describe the image."},
                        ],
                    },
                    {"role": "assistant", "content": f"The page shows a red square and {k + 2} banners."},
                ],
            }
        )
    records.append(
        {
            "id": "t",
            "messages": [
                {"role": "user", "content": "Open the page, then type the query."},
                {"role": "assistant", "content": "Done: the page is open."},
            ],
        }
    )
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


PACKABLE = [
    pytest.param(f.name, marks=() if f.name == "mistral-3" else pytest.mark.slow) for f in FAMILIES if not f.pack
]


@pytest.mark.parametrize("name", PACKABLE)
def test_packing_is_exact_where_the_family_allows_it(name, tmp_path):
    """Three samples (two images of different sizes, one text-only) in one step: packed into one row (no padding,
    positions restarting per sample) the step-1 loss equals the padded micro-batch's (rel 1e-5)."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    build(
        BuildConfig(
            inputs=(str(three_records(tmp_path, photo=True)),),
            out=str(tmp_path / "ds"),
            processor=f"tiny:{name}",
            progress=False,
            seq_len=4096,
        )
    )
    assert storages(tmp_path / "ds") == {"orig.jpg", "pdelta.zst"}
    padded = train_one_step(tmp_path / "ds", tmp_path / "padded", name, "--micro-batch-size", "3")
    packed = train_one_step(tmp_path / "ds", tmp_path / "packed", name, "--pack-to", "12000", "--pack-window", "3")
    assert (
        padded["num_samples"] == packed["num_samples"] == 3
        and packed["num_trained_tokens"] == padded["num_trained_tokens"]
    )
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5), (name, packed["loss"], padded["loss"])


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.pack])
def test_packing_is_refused_in_one_line_where_the_attention_cannot_express_it(name, tmp_path, capsys):
    from trainer.train import main

    ds, _, _ = build_one(tmp_path, f"tiny:{name}")
    assert (
        main(
            [
                "--data",
                str(ds),
                "--out",
                str(tmp_path / "run"),
                "--tiny-random",
                name,
                "--pack-to",
                "8192",
                "--max-steps",
                "1",
                "--no-progress",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--pack-to: {name} (" in err[0] and BY_NAME[name].pack in err[0], err


def _decoded(ds):
    from tests.trainer.conftest import read_all_samples
    from trainer.config import TrainConfig
    from trainer.data.datasets import load_image_spec
    from trainer.options import DataOptions

    spec = load_image_spec(DataOptions.of(TrainConfig(data=str(ds), tiny_random="qwen2-vl")), str(ds / "processor"))
    return read_all_samples(ds, spec), spec


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.moe])
def test_moe_padding_never_reaches_the_router_loss_counts_or_grads(name, tmp_path):
    """A mixture-of-experts family with its router's balance loss on (output_router_logits): a micro-batch of two
    samples of different lengths, collated as the trainer does and again with 16 more padding tokens a row, gives
    the same loss, the same expert counts over its real tokens (= the two samples' counts alone) and the same grads;
    the balance loss taken over the padding too would differ."""
    import dataclasses

    from trainer.data.collate import collate
    from trainer.data.datasets import RunData
    from trainer.model import balance_loss, build_model, collate_spec_of, forward_loss, model_inputs, tiny_vocab
    from trainer.options import ModelOptions
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    build(
        BuildConfig(
            inputs=(str(three_records(tmp_path)),), out=str(tmp_path / "ds"), processor=f"tiny:{name}", progress=False
        )
    )
    samples, spec = _decoded(tmp_path / "ds")
    a, b = samples[0], samples[2]  # an image sample and the text-only one: different lengths
    net = build_model(ModelOptions(tiny_random=name, seed=0), tiny_vocab(name, str(tmp_path / "ds" / "processor")))
    net.config.get_text_config().output_router_logits = True
    data = RunData((), [], [], spec, "", str(tmp_path / "ds" / "processor"))
    cspec = collate_spec_of(net, data, str(tmp_path / "ds" / "processor"))

    def more_padding(batch, n=16):
        grow = lambda t, v: torch.nn.functional.pad(t, (0, n), value=v)  # noqa: E731
        return dataclasses.replace(
            batch,
            input_ids=grow(batch.input_ids, cspec.pad_id),
            loss_mask=grow(batch.loss_mask, 0),
            mm_token_type_ids=grow(batch.mm_token_type_ids, 0),
            position_ids=grow(batch.position_ids, 0),
            vision={k: (grow(v, 0) if k in ("token_type_ids",) else v) for k, v in batch.vision.items()},
        )

    def run(batch):
        net.zero_grad()
        loss = forward_loss(net, batch, _patchify(spec, batch))
        loss.backward()
        with torch.no_grad():
            out = net(**model_inputs(net, batch, _patchify(spec, batch)), output_router_logits=True)
        real = batch.real.reshape(-1)
        counts = [
            torch.bincount(r.topk(_top_k(net), dim=-1).indices[real].reshape(-1), minlength=r.shape[-1])
            for r in out.router_logits
        ]
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        return float(loss), counts, grads, out.router_logits

    x = collate([a, b], cspec)
    y = more_padding(x)
    lx, cx, gx, router = run(x)
    ly, cy, gy, _ = run(y)
    assert ly == pytest.approx(lx, rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(cx, cy))
    alone = [run(collate([s], cspec))[1] for s in (a, b)]
    assert all(torch.equal(p, q + r) for p, q, r in zip(cx, *alone))
    assert gx.keys() == gy.keys() and all(float((gx[k] - gy[k]).abs().max()) <= 1e-6 for k in gx)
    from trainer.model import _balance_loss_of

    with torch.no_grad():  # the loss is the model's own with its config: mean cross-entropy + coef x balance loss
        own = net(**model_inputs(net, x, _patchify(spec, x)), labels=x.labels).loss
    assert lx / x.num_trained == pytest.approx(float(own), rel=1e-5)
    if _balance_loss_of(net) is not None:  # the balance loss over the padding as well would differ
        assert float(balance_loss(net, router, torch.ones_like(y.real[:, : x.real.shape[1]]))) != pytest.approx(
            float(balance_loss(net, router, x.real)), rel=1e-6
        )


def _top_k(net) -> int:
    text = net.config.get_text_config()
    return int(text.num_experts_per_tok)


def _patchify(spec, batch):
    """The pixel_values the training step makes on the device (Patchifier.inputs): None where the host made them."""
    from trainer.data.vision import Patchifier

    return Patchifier(spec, "cpu").inputs(batch)[0]


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_lora_adapts_the_language_model_only_and_freezes_the_vision_tower(name):
    """--lora-rank: adapters on the language model's attention and MLP projections of every family (not the vision
    tower, not fused expert weights); the vision tower and projector are frozen."""
    from trainer.model import build_model, tiny_vocab
    from trainer.options import ModelOptions
    from vlmprep.processors.builtin import builtin_dir

    family = BY_NAME[name]
    net = build_model(
        ModelOptions(tiny_random=name, seed=0, lora_rank=4), tiny_vocab(name, str(builtin_dir(f"tiny:{name}")))
    )
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and f".{family.text}." in n for n in trainable), trainable[:5]
    vision = [n for n, _ in net.named_parameters() if any(f".{v}." in f".{n}" for v in family.vision)]
    assert vision and not any(p.requires_grad for n, p in net.named_parameters() if n in vision)


# GLM-4.1V too in make test: the one family that patchifies on the device with a vision tower other than Qwen's.
PLACEHOLDERS = [pytest.param(f.name, marks=() if f.name in (*FAST, "glm-4.1v") else pytest.mark.slow) for f in FAMILIES]


@pytest.mark.parametrize("name", PLACEHOLDERS)
def test_a_micro_batch_without_images_gets_a_placeholder_image_and_the_same_loss(name, tmp_path):
    """Every rank runs the vision tower in every forward (FSDP's all-gathers pair up across ranks): a text-only
    micro-batch gets a black image after row 0's last token, untrained (a family whose host makes the pixels: one its
    processor expands; a family that patchifies on the device: one image token of a 1 x merge x merge grid); the loss
    equals the model's on the text alone, without any image."""
    from trainer.data.collate import collate
    from trainer.data.datasets import RunData
    from trainer.model import build_model, collate_spec_of, forward_loss, model_inputs, tiny_vocab
    from trainer.options import ModelOptions
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    build(
        BuildConfig(
            inputs=(str(three_records(tmp_path)),), out=str(tmp_path / "ds"), processor=f"tiny:{name}", progress=False
        )
    )
    samples, spec = _decoded(tmp_path / "ds")
    text = [s for s in samples if not s.image_index]
    processor = str(tmp_path / "ds" / "processor")
    net = build_model(ModelOptions(tiny_random=name, seed=0), tiny_vocab(name, processor)).eval()
    cspec = collate_spec_of(net, RunData((), [], [], spec, "", processor), processor)
    batch = collate(text, cspec)
    if BY_NAME[name].pixels == "patchify":
        assert batch.filler == 1 and not batch.vision and batch.image_grid_thw.tolist() == [[1, 2, 2]]
    else:
        assert batch.filler == len(cspec.placeholder) > 0 and batch.vision
    assert (
        int(batch.lengths[0]) == text[0].num_tokens + batch.filler and batch.num_trained == text[0].loss_mask[1:].sum()
    )
    pixels = _patchify(spec, batch)
    # the vision tower gets the placeholder's pixels (Gemma 3's normalized here: one image of its stored size; Gemma
    # 4's patchified here: one image of the patch budget)
    assert model_inputs(net, batch, pixels)["pixel_values"] is not None
    if BY_NAME[name].pixels == "normalize":
        assert "pixel_values" not in batch.vision and pixels.shape == (1, 3, *cspec.placeholder_size)
    if BY_NAME[name].pixels == "patches":
        assert "pixel_values" not in batch.vision and pixels.shape == (1, spec.budget.max_patches, 3 * 16 * 16)
    if BY_NAME[name].pixels == "tiles":  # Mllama's: one image of one tile (the black image fits one)
        assert "pixel_values" not in batch.vision and pixels.shape == (1, 1, 4, 3, 560, 560)
    with torch.no_grad():
        ours = float(forward_loss(net, batch, pixels))
        ids = torch.as_tensor(text[0].input_ids).long()[None]
        labels = torch.where(torch.as_tensor(text[0].loss_mask).bool()[None], ids, -100)
        alone = float(net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss)
    assert ours / batch.num_trained == pytest.approx(alone, rel=1e-5)


@pytest.mark.slow  # torchrun, 2 ranks: ~30 s on 2 cores
@pytest.mark.parametrize("name", ["llama-3.2-vision", "gemma-3"])
def test_two_ranks_one_with_only_text_train_without_hanging(name, tmp_path):
    """2 ranks over FSDP2: at step 1 rank 0 reads an image sample while rank 1 reads the text-only one, which gets
    the processor's placeholder image, so both run the vision tower (and Mllama's cross-attention layers) and their
    all-gathers pair up: the run ends with finite losses instead of hanging."""
    import subprocess

    from tests.trainer.conftest import ROOT, TORCHRUN, read_metrics, trainer_env
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    path = three_records(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[2], lines[0], lines[1]]) + "\n")  # text first: shard 0, which rank 1 reads
    build(
        BuildConfig(
            inputs=(str(path),), out=str(tmp_path / "ds"), processor=f"tiny:{name}", progress=False, samples_per_shard=1
        )
    )
    proc = subprocess.run(
        [
            str(TORCHRUN),
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "trainer",
            "--data",
            str(tmp_path / "ds"),
            "--out",
            str(tmp_path / "run"),
            "--tiny-random",
            name,
            "--max-steps",
            "2",
            "--no-shuffle",
            "--no-shuffle-shards",
            "--num-workers",
            "0",
            "--no-progress",
        ],
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["samples_per_rank"] for r in rows][0] == [1, 1] and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_image_tokens_are_counted_as_each_familys_whole_image_unit(name, tmp_path):
    """The build summary, the manifest, `stats` and `inspect` count as image tokens each image's whole unit: every
    token the model replaces with image features (Llama 4's ~150 <|patch|>, not its one <|image|>), every token the
    processor marks as image, and its wrappers, breaks and separators; never user text, never trained."""
    from typer.testing import CliRunner

    from trainer.model import image_token_id, tiny_config, tiny_vocab
    from vlmprep.cli import app
    from vlmprep.shards.manifest import Manifest
    from vlmprep.shards.summary import format_build_summary
    from vlmprep.tools.stats import compute_stats

    ds, _, _ = build_one(tmp_path, f"tiny:{name}")
    manifest = json.loads((ds / "manifest.json").read_text())
    s = shard_sample(ds)
    ids, mm, mask, meta = (s.array("input_ids"), s.array("mm_token_type_ids"), s.array("loss_mask"), s.meta())
    [(a, b)] = [tuple(im["span"]) for im in meta["images"]]
    model_token = image_token_id(type("M", (), {"config": tiny_config(name, tiny_vocab(name, str(ds / "processor")))}))
    inside = np.zeros(len(ids), bool)
    inside[a:b] = True
    assert (ids == model_token).sum() > 0 and not ((ids == model_token) & ~inside).any()
    assert not ((mm == 1) & ~inside).any() and not mask[a:b].any()
    tokenizer = json.loads((ds / "processor" / "tokenizer.json").read_text())
    added = {t["id"] for t in tokenizer["added_tokens"]}
    # No user text: besides added tokens, at most the newlines SmolVLM puts between its tile rows.
    text = {int(i) for i in ids[a:b] if int(i) not in added}
    vocab = {v: k for k, v in tokenizer["model"]["vocab"].items()}
    assert {vocab[i] for i in text} <= {"Ċ", "ĊĊ"}, {vocab[i] for i in text}
    n = b - a
    assert meta["num_image_tokens"] == manifest["totals"]["image_tokens"] == n
    summary = format_build_summary(Manifest.from_json(manifest), ds)
    assert f"images            1 ({n} image tokens)" in summary
    st = compute_stats(ds)
    assert st["image_tokens"] == n and st["mismatches"] == []
    # A tiny processor says what it is for, in the summary and stats' warnings.
    assert f"processor         tiny:{name}: a small vocabulary" in summary
    assert any(w.startswith(f"built with tiny:{name}:") for w in st["warnings"])
    shown = CliRunner().invoke(app, ["inspect", str(ds), "--limit", "1"]).output
    assert re.search(rf"\[image 1: [^\]]* -> {n} tokens\]", shown) and f"image tokens {n} " in shown


BUILTINS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5", "llama-3.2-vision", "llama-4", "mistral-3")


@pytest.mark.slow  # the real vocabularies: 130k-250k rows per tiny model
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_processors_train_each_family_with_its_real_vocabulary(name, tmp_path):
    """As test_each_family_trains_and_its_export_gives_the_same_loss, on `builtin:NAME`: the family's real
    vocabulary and special-token ids (the tiny model sized to them), the step-1 loss equal to the exported model's own
    on apply_chat_template of the raw record."""
    from vlmprep.families import FAMILIES as RENDER_FAMILIES

    family = BY_NAME[name]
    ds, records, images = build_batch(tmp_path, f"builtin:{name}")
    samples = shard_samples(ds)
    row = train_one_step(ds, tmp_path / "run", name, "--micro-batch-size", "3")
    string_content = RENDER_FAMILIES[family.processor_classes[0]].string_content
    loss, ids = own_loss(tmp_path / "run" / "hf", records, images, samples, string_content)
    assert_same_tokens(ids, samples)
    assert row["loss"] == pytest.approx(loss, rel=1e-5), (name, row["loss"], loss)
