"""vlmprep.clients.collate.Collator gives other trainers the project trainer's batches: equal to trainer/collate.py
plus trainer/vision.py on the same samples (pixel_values bit for bit, through a DataLoader with workers too), and
the README's HF Trainer and TRL SFTTrainer code, run as written, trains 2 steps with the trainer's step-1 loss,
for zstd and `original` (resized at load time) datasets."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


# `original` (resize at load time) in make test-all only: make test's time budget; the zstd cases stay.
@pytest.fixture(scope="module", params=["zstd", pytest.param("original", marks=pytest.mark.slow)])
def built(request, tmp_path_factory):
    """A 6-record dataset (2 shards) in one image format, and the project trainer's step-1 loss on its first two
    samples (manifest order, fp32, CPU, the tiny random model)."""
    from scripts.demo_traces import write_traces
    from trainer.train import main
    from vlmprep.config import BuildConfig
    from vlmprep.build.pipeline import build

    tmp = tmp_path_factory.mktemp(f"collate-{request.param}")
    write_traces(tmp / "traces.jsonl.zst", n=6, seed=1, min_images=1, max_images=2, width=224, height=160,
                 overlong_fraction=0.0, text_only_fraction=0.2)
    build(BuildConfig(inputs=(str(tmp / "traces.jsonl.zst"),), out=str(tmp / "ds"), processor="builtin:qwen2-vl",
                      seq_len=2048, samples_per_shard=3, progress=False, tool_calls="train-content",
                      image_format=request.param))
    assert main(["--data", str(tmp / "ds"), "--out", str(tmp / "run"), "--tiny-random", "qwen2-vl", "--max-steps", "1",
                 "--micro-batch-size", "2", "--no-shuffle", "--no-shuffle-shards", "--num-workers", "0", "--no-progress",
                 "--device", "cpu", "--precision", "fp32"]) == 0
    step1 = json.loads((tmp / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return request.param, tmp / "ds", step1


def _trainer_batches(d: Path, size: int):
    """The project trainer's own batches of the dataset in manifest order: collate + on-device pixel math."""
    from trainer.collate import CollateSpec, collate
    from trainer.data import RankStream
    from trainer.shards import load_image_processor_config, resolve_data
    from trainer.vision import ImageSpec, Patchifier

    spec = ImageSpec.from_config(load_image_processor_config(str(d / "processor")))
    samples = list(RankStream(list(resolve_data(str(d)).shards), start=0, spec=spec))
    cspec = CollateSpec(pad_id=0, image_token_id=151655, patch_size=spec.patch_size, merge_size=spec.merge_size)
    for i in range(0, len(samples), size):
        b = collate(samples[i:i + size], cspec)
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


def test_collator_batches_equal_the_trainers_through_a_dataloader(built):
    fmt, d, step1 = built
    import vlmprep.clients.hf
    from trainer.model import build_model
    from vlmprep.clients.collate import Collator

    loader = torch.utils.data.DataLoader(vlmprep.clients.hf.iterable_dataset(d), batch_size=2,
                                         collate_fn=Collator(d))
    got = list(loader)
    want = list(_trainer_batches(d, 2))
    assert len(got) == len(want) == 3 and all(p is not None for _, p in want)  # every batch has an image
    for g, (w, pixels) in zip(got, want):
        _assert_same_batch(g, w, pixels)
    # Workers: each reads whole shards and collates their batches (the processor loaded in the worker).
    ds = vlmprep.clients.hf.iterable_dataset(d)
    in_workers = {_key(b): b for b in torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=Collator(d),
                                                                   num_workers=2)}
    by_shard = [b for i in (0, 1) for b in torch.utils.data.DataLoader(ds.shard(2, i), batch_size=2,
                                                                        collate_fn=Collator(d))]
    assert len(in_workers) == len(by_shard) == 4  # 2 shards of 3 samples: batches of 2 and 1 per shard
    for b in by_shard:
        assert b.keys() == in_workers[_key(b)].keys() and all(torch.equal(b[k], in_workers[_key(b)][k]) for k in b)
    text_only = [b for b in by_shard if "pixel_values" not in b]
    assert len(text_only) == 1 and "image_grid_thw" not in text_only[0]  # the last shard's last sample
    with torch.no_grad():  # the first batch, straight into the model, gives the trainer's step-1 loss
        net = build_model(tiny_random="qwen2-vl", seed=0)
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
    """The README's `<!-- readme-test: python ... -->` block containing `marker`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- readme-test: python[^\n]*-->\n```python\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def _run_readme_block(marker: str, d: Path, out: Path) -> list[dict]:
    """Run the block as written, with the two inputs substituted: DIR and the model (the trainer's tiny model)."""
    from trainer.model import build_model

    code = _readme_block(marker)
    code, n_dir = re.subn(r"^DIR = .*$", "DIR = _DIR", code, flags=re.M)
    code, n_model = re.subn(r"^model = .*$", "model = _MODEL", code, flags=re.M)
    assert n_dir == n_model == 1 and code.count('"runs/') == 1
    code = code.replace('"runs/', '_OUT + "/')
    ns = {"_DIR": str(d), "_OUT": str(out), "_MODEL": build_model(tiny_random="qwen2-vl", seed=0)}
    exec(compile(code, f"README.md ({marker})", "exec"), ns)
    return ns["trainer"].state.log_history


def test_hf_trainer_trains_with_the_readme_code(built, tmp_path):
    fmt, d, step1 = built
    log = _run_readme_block("trainer = Trainer(", d, tmp_path)
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx(step1["loss"], rel=1e-6), (fmt, steps[0]["loss"], step1["loss"])


@pytest.mark.slow  # importing TRL and its trainer set-up: ~40 s on 2 busy cores
def test_trl_sft_trainer_trains_with_the_readme_code(built, tmp_path):
    pytest.importorskip("trl")
    fmt, d, step1 = built
    log = _run_readme_block("trainer = SFTTrainer(", d, tmp_path)
    steps = [e for e in log if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert steps[0]["loss"] == pytest.approx(step1["loss"], rel=1e-6), (fmt, steps[0]["loss"], step1["loss"])
