"""Export round trip: a trained run's checkpoint -> `python -m trainer export` / `--save-hf` -> transformers
`from_pretrained` gives the trained model's logits on a shard sample, and the exported processor renders that
sample's messages to its stored input_ids. The reference model is rebuilt from the checkpoint independently
(DCP's own dcp_to_torch_save, then load_state_dict)."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from tests.trainer.conftest import ROOT, TORCHRUN, TRACES, read_all_samples, trainer_env
from trainer.data.collate import CollateSpec, collate
from trainer.data.vision import Patchifier
from trainer.model import build_model
from trainer.options import ModelOptions
from trainer.train import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:This DataLoader will create")
TWO_STEPS = ["--max-steps", 2, "--micro-batch-size", 2, "--num-workers", 0, "--no-progress"]


def _train(dataset, out, *extra, model=None):
    argv = [
        "--data",
        dataset,
        "--out",
        out,
        *(["--model", model] if model else ["--tiny-random", "qwen2-vl"]),
        *TWO_STEPS,
        *extra,
    ]
    assert main([str(a) for a in argv]) == 0


def _torchrun(dataset, out, *extra, model=None):
    """The training CLI on 2 ranks (FSDP2 shards every block across them), with --model or --tiny-random."""
    argv = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "trainer",
        "--data",
        dataset,
        "--out",
        out,
        *(["--model", model] if model else ["--tiny-random", "qwen2-vl"]),
        *TWO_STEPS,
        *extra,
    ]
    proc = subprocess.run(
        [str(a) for a in argv], cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


def run_vocab(run):
    """The vocabulary a tiny run's model was sized to (the dataset's processor's), as run.json keeps it."""
    from trainer.export import _vocab, read_run

    return _vocab(read_run(Path(run))[1])


def _export(run, out, *extra) -> int:
    from trainer.export import main as export_main

    return export_main([str(run), "--out", str(out), *map(str, extra)])


def _reference(run, tmp_path, *, model: str = "", lora_rank: int = 0):
    """The checkpoint's model, rebuilt without trainer/export.py: DCP -> torch.save file -> load_state_dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from trainer.checkpoint import latest_checkpoint

    path = tmp_path / "reference.pt"
    dcp_to_torch_save(str(latest_checkpoint(run)), str(path))
    net = build_model(
        ModelOptions(model=model, tiny_random="" if model else "qwen2-vl", lora_rank=lora_rank), run_vocab(run)
    )
    net.load_state_dict(torch.load(path, weights_only=True)["model"], strict=True)
    return net.eval()


@pytest.fixture(scope="module")
def sample(dataset, image_spec):
    """A shard sample with images, and its record's messages as the processor's apply_chat_template takes them."""
    from scripts.demo_traces import generate_traces
    from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
    from vlmprep.processors.load import load_saved_processor
    from vlmprep.render.sample import RenderContext
    from vlmprep.types import Source

    s = next(s for s in read_all_samples(dataset, image_spec) if len(s.image_index) >= 2)
    record = next(r for r in generate_traces(**TRACES) if r["id"] == s.id)
    conv = normalize_record(record, Source("/tmp/traces.jsonl", 1), NormalizeOptions())
    msgs = RenderContext(load_saved_processor(dataset / "processor")).messages(conv)  # as the build passed them
    pil = iter([Image.open(io.BytesIO(im.data)) for im in conv.images])
    for m in msgs:
        for part in m["content"] if isinstance(m["content"], list) else []:
            if part["type"] == "image":
                part["image"] = next(pil)
    return s, msgs


def _trained_logits(net, sample, image_spec) -> torch.Tensor:
    """What training feeds the model: the collated shard sample, stored MRoPE positions, on-device pixel math."""
    s, _ = sample
    b = collate([s], CollateSpec(pad_id=0, image_token_id=151655, patch_size=14, merge_size=2)).to("cpu")
    with torch.no_grad():
        return (
            net(
                input_ids=b.input_ids,
                attention_mask=b.attention_mask,
                position_ids=b.position_ids,
                mm_token_type_ids=b.mm_token_type_ids,
                pixel_values=Patchifier(image_spec, "cpu")(b.images, b.image_index),
                image_grid_thw=b.image_grid_thw,
                use_cache=False,
            )
            .logits[0]
            .float()
        )


def _render(export_dir, sample) -> dict:
    """What a user of the export does first: its processor renders the messages, the way training saw them."""
    from transformers import AutoProcessor

    s, msgs = sample
    processor = AutoProcessor.from_pretrained(str(export_dir), local_files_only=True)
    inputs = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == s.input_ids.tolist()
    return inputs


def _served_logits(export_dir, inputs, *, dtype=torch.float32) -> torch.Tensor:
    """The export's model on the processor's output; it computes its own MRoPE positions."""
    from transformers import AutoModelForImageTextToText

    net = AutoModelForImageTextToText.from_pretrained(
        str(export_dir), local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        return net(**inputs).logits[0].float()


def _keys(path) -> dict[str, tuple]:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def run1(dataset, tmp_path_factory):
    """One rank, two steps, --save-hf in fp32."""
    out = tmp_path_factory.mktemp("export") / "run"
    _train(dataset, out, "--save-hf", "--export-dtype", "fp32")
    return out


@pytest.fixture(scope="module")
def run1_ref(run1, sample, image_spec, tmp_path_factory) -> torch.Tensor:
    return _trained_logits(_reference(run1, tmp_path_factory.mktemp("ref")), sample, image_spec)


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_save_hf_export_loads_with_transformers_and_gives_the_trained_logits(run1, run1_ref, sample, image_spec):
    hf = run1 / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "processor_config.json"} <= {
        p.name for p in hf.iterdir()
    }
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"] and config["use_cache"] is True
    assert float((_served_logits(hf, _render(hf, sample)) - run1_ref).abs().max()) <= 1e-6
    # The weights did train: an untrained model is far from them.
    untrained = _trained_logits(
        build_model(ModelOptions(tiny_random="qwen2-vl"), run_vocab(run1)).eval(), sample, image_spec
    )
    assert float((untrained - run1_ref).abs().max()) > 1e-3


@pytest.mark.slow  # make-test budget; the fp32 round trip stays
def test_bf16_export_is_the_fp32_weights_rounded(run1, run1_ref, sample, tmp_path):
    assert _export(run1, tmp_path / "bf16") == 0  # bf16 is the default
    fp32, bf16 = _keys(run1 / "hf" / "model.safetensors"), _keys(tmp_path / "bf16" / "model.safetensors")
    assert fp32.keys() == bf16.keys() and {v[1] for v in bf16.values()} == {"BF16"}
    with (
        safe_open(str(run1 / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as b,
    ):
        assert all(torch.equal(a.get_tensor(k).to(torch.bfloat16), b.get_tensor(k)) for k in fp32)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    got = _served_logits(tmp_path / "bf16", _render(tmp_path / "bf16", sample), dtype=torch.bfloat16)
    assert float((got - run1_ref).abs().max()) <= 0.02 * float(run1_ref.abs().max())  # observed ~0.004


def _error(capsys, *argv) -> str:
    assert _export(*argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer export: error: "), err
    return err[0]


def test_export_user_errors_are_one_line(run1, tmp_path, capsys):
    (tmp_path / "empty_run").mkdir()
    assert "not a trainer run dir" in _error(capsys, tmp_path / "empty_run", tmp_path / "x")
    assert "no checkpoint for step 7 (kept: step-00000002)" in _error(capsys, run1, tmp_path / "x", "--step", 7)
    assert "--adapter-only" in _error(capsys, run1, tmp_path / "x", "--adapter-only")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "exists and is not empty" in _error(capsys, run1, tmp_path / "full")
    assert "not an earlier export" in _error(capsys, run1, tmp_path / "full", "--overwrite")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()
    # An earlier export is replaced with --overwrite, and an explicit step is exported.
    assert _export(run1, tmp_path / "again", "--step", 2) == 0
    assert _export(run1, tmp_path / "again", "--overwrite") == 0
    assert json.loads((tmp_path / "again" / "export.json").read_text())["checkpoint"] == "step-00000002"


def test_python_m_trainer_export_is_the_export_cli(run1, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(run1), "--out", str(tmp_path / "x"), "--step", "9"],
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"trainer export: error: {run1}: no checkpoint for step 9 (kept: step-00000002)"
    ]


def test_export_copies_only_the_processors_own_files(run1, tmp_path, capsys):
    """A private key and other stray files in the processor dir stay behind (docs/untrusted-datasets.md). A dir the
    user names may link out, as a Hugging Face cache snapshot links every file into blobs/: the export holds the
    files' contents; a dataset's own processor may not (tests/test_untrusted_datasets.py)."""
    proc = tmp_path / "proc"
    shutil.copytree(
        run1 / "hf",
        proc,
        ignore=lambda d, names: [
            n for n in names if n != "export.json" and n.startswith(("model", "config", "generation"))
        ],
    )
    own = {p.name for p in proc.iterdir()} - {"export.json"}
    for stray in ("id_ed25519", "notes.txt", "evil.py", "export.json"):
        (proc / stray).write_text("not the processor's")
    (proc / "config.json").write_text('{"architectures": ["Stray"]}')
    assert _export(run1, tmp_path / "x", "--processor", proc) == 0
    model = {p.name for p in (run1 / "hf").iterdir()} - own
    assert {p.name for p in (tmp_path / "x").iterdir()} == own | model
    assert json.loads((tmp_path / "x" / "config.json").read_text())["architectures"] != ["Stray"]
    snapshot, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    blobs.mkdir()
    snapshot.mkdir()
    for name in own:
        shutil.copy(proc / name, blobs / name)
        (snapshot / name).symlink_to(blobs / name)
    assert _export(run1, tmp_path / "y", "--processor", snapshot) == 0
    for name in own:
        exported = tmp_path / "y" / name
        assert not exported.is_symlink() and exported.read_bytes() == (proc / name).read_bytes(), name


def test_export_refuses_a_manifest_processor_outside_the_dataset(run1, dataset, tmp_path, capsys):
    """The run's dataset names its processor by an absolute path (next to a private key): nothing is exported."""
    keys = tmp_path / "keys"
    shutil.copytree(dataset / "processor", keys)
    (keys / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    data = tmp_path / "data"
    shutil.copytree(dataset, data, ignore=shutil.ignore_patterns("processor"))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["processor"]["dir"] = str(keys)
    (data / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    shutil.copytree(run1, run, ignore=shutil.ignore_patterns("hf"))
    config = (run / "config.toml").read_text()
    (run / "config.toml").write_text(
        config.replace(f"data = {json.dumps(str(dataset))}\n", f"data = {json.dumps(str(data))}\n")
    )
    assert str(data) in (run / "config.toml").read_text()
    err = _error(capsys, run, tmp_path / "x")
    assert str(data / "manifest.json") in err and repr(str(keys)) in err and "processor dir" in err, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()


@pytest.mark.slow  # torchrun 2 ranks: ~60 s on 2 cores
def test_two_rank_fsdp_checkpoint_exports_offline(dataset, sample, image_spec, tmp_path):
    run = tmp_path / "run"
    _torchrun(dataset, run, "--save-hf", "--export-dtype", "fp32")  # rank 0 exports RUN/hf at the end
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(run), "--out", str(tmp_path / "hf"), "--dtype", "fp32"],
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Same bytes from the training process (in a process group) and the offline CLI.
    assert (run / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    ref = _trained_logits(_reference(run, tmp_path), sample, image_spec)
    assert float((_served_logits(tmp_path / "hf", _render(tmp_path / "hf", sample)) - ref).abs().max()) <= 1e-6


@pytest.mark.slow  # torchrun 2 ranks: ~60 s on 2 cores
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_lora_run_exports_merged_weights_and_the_adapter_alone(dataset, sample, image_spec, tmp_path):
    from peft import PeftModel

    run = tmp_path / "run"
    _torchrun(dataset, run, "--lora-rank", 4, "--lr", 1e-3)
    assert _export(run, tmp_path / "merged", "--dtype", "fp32") == 0
    ref = _trained_logits(_reference(run, tmp_path, lora_rank=4), sample, image_spec)
    assert not any("lora" in k for k in _keys(tmp_path / "merged" / "model.safetensors"))
    assert float((_served_logits(tmp_path / "merged", _render(tmp_path / "merged", sample)) - ref).abs().max()) <= 1e-6
    untrained = _trained_logits(
        build_model(ModelOptions(tiny_random="qwen2-vl"), run_vocab(run)).eval(), sample, image_spec
    )
    assert float((untrained - ref).abs().max()) > 1e-3  # the adapters moved the logits

    assert _export(run, tmp_path / "adapter", "--dtype", "fp32", "--adapter-only") == 0
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    base = build_model(ModelOptions(tiny_random="qwen2-vl"), run_vocab(run))  # LoRA froze the base: the initial model
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert float((_trained_logits(adapted, sample, image_spec) - ref).abs().max()) <= 1e-6


@pytest.mark.slow  # torchrun 2 ranks: ~60 s on 2 cores
def test_model_dir_run_exports_the_same_class_and_keys_as_its_base(dataset, sample, image_spec, tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from tests.conftest import tiny_qwen2vl_config

    base = tmp_path / "base"
    torch.manual_seed(3)
    Qwen2VLForConditionalGeneration(tiny_qwen2vl_config(use_cache=True)).save_pretrained(str(base))
    run = tmp_path / "run"
    _torchrun(dataset, run, model=base)
    assert _export(run, tmp_path / "hf", "--dtype", "fp32") == 0
    exported, original = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", base))
    assert exported["architectures"] == original["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert exported["model_type"] == original["model_type"]
    assert exported.get("use_cache", True) == original.get("use_cache", True)  # training's use_cache=False undone
    assert _keys(tmp_path / "hf" / "model.safetensors") == _keys(base / "model.safetensors")
    ref = _trained_logits(_reference(run, tmp_path, model=str(base)), sample, image_spec)
    assert float((_served_logits(tmp_path / "hf", _render(tmp_path / "hf", sample)) - ref).abs().max()) <= 1e-6
