"""vlmprep.clients.collate.Collator gives other trainers the project trainer's batches: equal to trainer/data/collate.py
plus trainer/data/vision.py on the same samples (pixel_values bit for bit, through a DataLoader with workers too), and
docs/other-libraries.md's HF Trainer and TRL SFTTrainer code, run as written, trains 2 steps with the trainer's step-1 loss,
for zstd and `original` (resized at load time) datasets; video batches (pixel_values_videos, video_grid_thw,
second_per_grid_ts) equal the trainer's for Qwen2-VL, Qwen2.5-VL and Qwen3-VL."""

import json
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


# `original` (resize at load time) in make test-all only: make test's time budget; the zstd cases stay.
@pytest.fixture(scope="module", params=["zstd", pytest.param("original", marks=pytest.mark.slow)])
def built(request, tmp_path_factory):
    """A 6-record dataset (2 shards) in one image format, and the project trainer's step-1 loss on its first two
    samples (manifest order, fp32, CPU, the tiny random model)."""
    from scripts.demo_traces import write_traces
    from trainer.train import main
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    tmp = tmp_path_factory.mktemp(f"collate-{request.param}")
    write_traces(
        tmp / "traces.jsonl.zst",
        n=6,
        seed=1,
        min_images=1,
        max_images=2,
        width=224,
        height=160,
        overlong_fraction=0.0,
        text_only_fraction=0.2,
    )
    build(
        BuildConfig(
            inputs=(str(tmp / "traces.jsonl.zst"),),
            out=str(tmp / "ds"),
            processor="builtin:qwen2-vl",
            seq_len=2048,
            samples_per_shard=3,
            progress=False,
            tool_calls="train-content",
            image_format=request.param,
        )
    )
    assert (
        main(
            [
                "--data",
                str(tmp / "ds"),
                "--out",
                str(tmp / "run"),
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "1",
                "--micro-batch-size",
                "2",
                "--no-shuffle",
                "--no-shuffle-shards",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    step1 = json.loads((tmp / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return request.param, tmp / "ds", step1


def _trainer_batches(d: Path, size: int):
    """The project trainer's own batches of the dataset in manifest order: collate + on-device pixel math."""
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.processors import load_image_processor_config
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream
    from trainer.data.vision import ImageSpec, Patchifier

    spec = ImageSpec.from_config(load_image_processor_config(str(d / "processor")))
    samples = list(RankStream(list(resolve_data(str(d)).shards), start=0, spec=spec))
    cspec = CollateSpec(pad_id=0, image_token_id=151655, patch_size=spec.patch_size, merge_size=spec.merge_size)
    for i in range(0, len(samples), size):
        b = collate(samples[i : i + size], cspec)
        yield b, Patchifier(spec, "cpu")(b.images, b.image_index)


def _assert_same_batch(got: dict, want, pixels) -> None:
    L = got["input_ids"].shape[1]
    real = got["attention_mask"].bool()  # padding ids differ: the tokenizer's pad id here, 0 in the trainer
    assert torch.equal(got["labels"], want.labels[:, :L]) and torch.equal(got["attention_mask"], want.attention_mask)
    assert torch.equal(got["input_ids"][real], want.input_ids.long()[:, :L][real])
    assert torch.equal(got["position_ids"], want.position_ids.long()[:, :, :L])
    assert torch.equal(got["mm_token_type_ids"], want.mm_token_type_ids.long()[:, :L])
    assert torch.equal(got["image_grid_thw"], want.image_grid_thw)
    assert got["pixel_values"].dtype == torch.float32 and torch.equal(got["pixel_values"], pixels)


def _key(batch: dict) -> tuple:
    return tuple(batch["input_ids"][0].tolist())


def tiny_model(d):
    """The trainer's --tiny-random qwen2-vl, sized to the dataset's processor as the trainer sizes it."""
    from trainer.model import build_model, tiny_vocab
    from trainer.options import ModelOptions

    return build_model(ModelOptions(tiny_random="qwen2-vl", seed=0), tiny_vocab("qwen2-vl", str(Path(d) / "processor")))


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_collator_batches_equal_the_trainers_through_a_dataloader(built):
    fmt, d, step1 = built
    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator

    loader = torch.utils.data.DataLoader(vlmprep.clients.hf.iterable_dataset(d), batch_size=2, collate_fn=Collator(d))
    got = list(loader)
    want = list(_trainer_batches(d, 2))
    assert len(got) == len(want) == 3 and all(p is not None for _, p in want)  # every batch has an image
    for g, (w, pixels) in zip(got, want):
        _assert_same_batch(g, w, pixels)
    # Workers: each reads whole shards and collates their batches (the processor loaded in the worker).
    ds = vlmprep.clients.hf.iterable_dataset(d)
    in_workers = {
        _key(b): b for b in torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=Collator(d), num_workers=2)
    }
    by_shard = [
        b for i in (0, 1) for b in torch.utils.data.DataLoader(ds.shard(2, i), batch_size=2, collate_fn=Collator(d))
    ]
    assert len(in_workers) == len(by_shard) == 4  # 2 shards of 3 samples: batches of 2 and 1 per shard
    for b in by_shard:
        assert b.keys() == in_workers[_key(b)].keys() and all(torch.equal(b[k], in_workers[_key(b)][k]) for k in b)
    text_only = [b for b in by_shard if "pixel_values" not in b]
    assert len(text_only) == 1 and "image_grid_thw" not in text_only[0]  # the last shard's last sample
    with torch.no_grad():  # the first batch, straight into the model, gives the trainer's step-1 loss
        net = tiny_model(d)
        loss = float(net(**got[0]).loss)
        assert np.isfinite(float(net(**text_only[0]).loss))
    assert loss == pytest.approx(step1["loss"], rel=1e-6)


def test_collator_refuses_another_processors_grids(built, tmp_path):
    fmt, d, _ = built
    if fmt != "zstd":
        pytest.skip("one format is enough")
    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator

    s = next(s for s in vlmprep.clients.hf.iterable_dataset(d) if len(s["images"]))
    s["images"] = [np.ascontiguousarray(np.concatenate([im, im], axis=0)) for im in s["images"]]  # twice as tall
    with pytest.raises(ValueError, match="not the processor these samples were built with"):
        Collator(d)([s])


def _readme_block(marker: str) -> str:
    """docs/other-libraries.md's `<!-- readme-test: python ... -->` block containing `marker`."""
    text = (ROOT / "docs" / "other-libraries.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- readme-test: python[^\n]*-->\n```python\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def _run_readme_block(marker: str, d: Path, out: Path, model=None) -> dict:
    """Run the block as written, with the two inputs substituted: DIR and the model (the trainer's tiny model);
    its output dir `runs/...`, if any, goes under `out`. Returns the block's namespace."""

    code = _readme_block(marker)
    code, n_dir = re.subn(r"^DIR = .*$", "DIR = _DIR", code, flags=re.M)
    code, n_model = re.subn(r"^model = .*$", "model = _MODEL", code, flags=re.M)
    assert n_dir == n_model == 1 and code.count('"runs/') <= 1
    code = code.replace('"runs/', '_OUT + "/')
    ns = {"_DIR": str(d), "_OUT": str(out), "_MODEL": model or tiny_model(d)}
    exec(compile(code, f"docs/other-libraries.md ({marker})", "exec"), ns)
    return ns


def _kept_rows(net) -> list[int]:
    """The rows the model's LM head projects, per forward call (filled as the model runs)."""
    rows: list[int] = []
    net.lm_head.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[:-1].numel()))
    return rows


def _trained_next_tokens(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def test_collator_trained_logits_keep_the_trainers_positions(built):
    """trained_logits=True adds logits_to_keep (the trainer's own selection) and shift_labels (the targets there):
    the model's LM head then projects one row per trained token instead of B x L, and the loss is the trainer's."""
    fmt, d, step1 = built
    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator

    samples = list(vlmprep.clients.hf.iterable_dataset(d))[:2]
    plain, got = Collator(d)(samples), Collator(d, trained_logits=True)(samples)
    assert set(got) - set(plain) == {"logits_to_keep", "shift_labels"}
    assert all(torch.equal(plain[k], got[k]) for k in plain)
    want, _ = next(_trainer_batches(d, 2))
    labels = want.labels.long()
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != -100  # trainer/model.py forward_loss's selection, on the trainer's own batch
    assert got["logits_to_keep"].dtype == torch.bool and torch.equal(got["logits_to_keep"], keep)
    assert torch.equal(got["shift_labels"], labels[:, 1:][keep[:, :-1]]) and bool((got["shift_labels"] >= 0).all())
    net = tiny_model(d)
    rows = _kept_rows(net)
    with torch.no_grad():
        full, kept = net(**plain), net(**got)
    B, L = got["input_ids"].shape
    assert rows == [B * L, _trained_next_tokens(got)] and rows[1] < B * L / 2
    assert kept.logits.shape == (rows[1], net.config.text_config.vocab_size)
    assert float(kept.loss) == pytest.approx(step1["loss"], rel=1e-6)
    assert float(kept.loss) == pytest.approx(float(full.loss), rel=1e-6)


def test_hf_trainer_trains_with_the_readme_code(built, tmp_path):
    """The docs' HF Trainer block (trained_logits=True): step-1 loss = the trainer's, LM head rows = trained tokens."""

    fmt, d, step1 = built
    net = tiny_model(d)
    rows = _kept_rows(net)
    log = _run_readme_block("trainer = Trainer(", d, tmp_path, model=net)["trainer"].state.log_history
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx(step1["loss"], rel=1e-6), (fmt, steps[0]["loss"], step1["loss"])
    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator

    samples = list(vlmprep.clients.hf.iterable_dataset(d))[:4]
    assert rows == [_trained_next_tokens(Collator(d)(samples[i : i + 2])) for i in (0, 2)]


def _energon_samples(d: Path) -> list:
    """Every sample as energon's loader makes it (VlmprepSample from the raw tar members), in manifest order."""
    from vlmprep.clients.energon import VlmprepSample, sample_loader

    out = []
    for shard in json.loads((d / "manifest.json").read_text())["shards"]:
        raw: dict[str, dict] = {}
        with tarfile.open(d / shard["name"]) as tar:
            for ti in tar:
                key, _, member = ti.name.partition(".")
                raw.setdefault(key, {"__key__": key, "__shard__": shard["name"]})[member] = tar.extractfile(ti).read()
        out += [
            VlmprepSample(__key__=k, __restore_key__=(), __subflavors__={}, **sample_loader(r)) for k, r in raw.items()
        ]
    return out


def test_energon_task_encoder_batches_are_the_collators(built):
    """VlmprepTaskEncoder.batch over energon's samples is the Collator's batch over the HF reader's, key for key (so
    a model's loss on it is the trainer's, tested above; energon's loader and a training loop: the slow test below)."""
    pytest.importorskip("megatron.energon")
    fmt, d, _ = built
    if fmt != "zstd":
        pytest.skip("one format is enough")
    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator
    from vlmprep.clients.energon import VlmprepTaskEncoder

    encoder = VlmprepTaskEncoder(d, trained_logits=True)
    assert encoder.decoder is None  # energon's webdataset decoder (may unpickle) is never asked for
    got = encoder.batch(_energon_samples(d)[:2])
    want = Collator(d, trained_logits=True)(list(vlmprep.clients.hf.iterable_dataset(d))[:2])
    assert {"logits_to_keep", "shift_labels", "pixel_values"} <= got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow  # energon's index, loader and 2 workers, 2 optimizer steps (the task encoder's batch stays above)
def test_energon_trains_with_the_docs_code(built, tmp_path):
    """The docs' energon block, run as written: each batch its loader yields is the Collator's batch of the same
    samples (read through vlmprep.clients.hf), and the same loop over the Collator's batches gives the same losses."""
    pytest.importorskip("megatron.energon")
    fmt, d, _ = built
    if fmt != "zstd":
        pytest.skip("one format is enough")
    import vlmprep.clients.hf
    from trainer.model import build_model
    from trainer.options import ModelOptions
    from vlmprep.clients.collate import Collator

    shutil.copytree(d, tmp_path / "ds")  # the block indexes DIR (energon's .nv-meta files)
    d = tmp_path / "ds"
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0))
    seen: list[tuple[dict, float]] = []
    net.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((dict(kwargs), float(out.loss.detach()))), with_kwargs=True
    )
    _run_readme_block("VlmprepTaskEncoder(DIR", d, tmp_path, model=net)
    assert len(seen) == 2
    (lr,) = re.findall(r"AdamW\(model.parameters\(\), lr=([0-9.e-]+)\)", _readme_block("VlmprepTaskEncoder(DIR"))
    by_ids = {tuple(s["input_ids"].tolist()): s for s in vlmprep.clients.hf.iterable_dataset(d)}
    collator = Collator(d, trained_logits=True)
    ref = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0))
    optimizer = torch.optim.AdamW(ref.parameters(), lr=float(lr))
    for batch, loss in seen:
        rows = [by_ids[tuple(ids[m.bool()].tolist())] for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
        want = collator(rows)
        assert len(rows) == 2 and batch.keys() == want.keys()
        assert all(torch.equal(batch[k], want[k]) for k in want)
        ref_loss = ref(**want).loss
        ref_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss == pytest.approx(float(ref_loss), rel=1e-6)


@pytest.mark.slow  # importing TRL and its trainer set-up: ~40 s on 2 busy cores
def test_trl_sft_trainer_trains_with_the_readme_code(built, tmp_path):
    pytest.importorskip("trl")
    fmt, d, step1 = built
    log = _run_readme_block("trainer = SFTTrainer(", d, tmp_path)["trainer"].state.log_history
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx(step1["loss"], rel=1e-6), (fmt, steps[0]["loss"], step1["loss"])


def _video_model(family: str):
    """A tiny random model of the family (fp32, sdpa): the trainer's Qwen2-VL, else the trainer tests' configs."""
    from trainer.model import build_model
    from trainer.options import ModelOptions

    if family == "qwen2-vl":
        return build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)).eval()
    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests.trainer.test_model import FAMILIES

    model_type = family.replace(".", "_").replace("-", "_")
    kw = json.loads(json.dumps(FAMILIES[model_type][1]))
    if model_type == "qwen2_5_vl":
        kw["vision_config"]["tokens_per_second"] = 2
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        model_type,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        **kw,
    )
    return AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def video_collator(video_dataset):
    """family -> a Collator of its video dataset, made once: loading the saved processor is most of a test's time."""
    from vlmprep.clients.collate import Collator

    made = {}
    return lambda family: made.setdefault(family, Collator(video_dataset(family)))


@pytest.mark.slow  # make test-all: keeps make test within its budget
@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", pytest.param("qwen3-vl", marks=pytest.mark.slow)])
def test_collator_video_batches_equal_the_trainers(video_dataset, video_collator, family):
    """A mixed batch (a video sample, an image sample, a text sample, two videos around an image): the Collator's
    pixel_values_videos equal the trainer's Patchifier.videos of its own decode (bit for bit) and the video processor's
    own output on the frames read from the tar independently (fp32 <= 1e-6); video_grid_thw and, for Qwen2.5-VL only,
    second_per_grid_ts as the trainer passes them; and a tiny model's loss on the batch equals the trainer's (so
    the model's forward gets what the trainer gives it)."""
    import vlmprep.clients.hf
    from tests.trainer.conftest import read_all_samples
    from tests.vlmprep.clients.test_clients import _stored_videos
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.processors import load_image_processor_config, load_video_processor_config
    from trainer.data.vision import ImageSpec, Patchifier
    from trainer.model import forward_loss

    d = video_dataset(family)
    samples = list(vlmprep.clients.hf.iterable_dataset(d))
    collator = video_collator(family)
    got = collator(samples)
    loc = str(d / "processor")
    spec = ImageSpec.from_config(load_image_processor_config(loc), load_video_processor_config(loc))
    tsamples = read_all_samples(d, spec)
    assert [s.id for s in tsamples] == [s["id"] for s in samples] == ["v", "i", "t", "vi"]
    tok = collator.processor.tokenizer
    want = collate(
        tsamples,
        CollateSpec(
            pad_id=0,
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            patch_size=spec.patch_size,
            merge_size=spec.merge_size,
            videos=True,
        ),
    )
    patchify = Patchifier(spec, "cpu")
    pixels, videos = patchify(want.images, want.image_index), patchify.videos(want.videos)
    _assert_same_batch(got, want, pixels)
    assert got["pixel_values_videos"].dtype == torch.float32 and torch.equal(got["pixel_values_videos"], videos)
    assert torch.equal(got["video_grid_thw"], want.video_grid_thw) and len(want.video_grid_thw) == 3
    if family == "qwen2.5-vl":
        assert got["second_per_grid_ts"].dtype == torch.float32
        assert torch.equal(got["second_per_grid_ts"], want.second_per_grid_ts)
    else:
        assert "second_per_grid_ts" not in got
    stored = [v for s in _stored_videos(d).values() for v in s["videos"]]  # key order = token order of the batch
    vp = collator.processor.video_processor
    own = vp(videos=stored, do_resize=False, do_sample_frames=False, return_tensors="pt")
    assert own["pixel_values_videos"].shape == got["pixel_values_videos"].shape
    assert float((own["pixel_values_videos"] - got["pixel_values_videos"]).abs().max()) <= 1e-6
    net = _video_model(family)
    with torch.no_grad():
        loss = float(net(**got).loss)
        ref = float(forward_loss(net, want, pixels, pixel_values_videos=videos) / want.num_trained)
    assert loss == pytest.approx(ref, rel=1e-6)
    only_video = collator([samples[0]])  # no image in the batch: no image keys, the video ones alone
    assert "pixel_values" not in only_video and torch.equal(only_video["video_grid_thw"], want.video_grid_thw[:1])


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_collator_refuses_another_processors_video_grids(video_dataset, video_collator):
    import vlmprep.clients.hf

    s = next(s for s in vlmprep.clients.hf.iterable_dataset(video_dataset("qwen2-vl")) if s["videos"])
    s["videos"] = [np.ascontiguousarray(np.concatenate([v, v], axis=1)) for v in s["videos"]]  # twice as tall
    with pytest.raises(ValueError, match="video grids .* not the processor these samples were built with"):
        video_collator("qwen2-vl")([s])
