"""A dataset trains only the model it was tokenized for (issue 53.6, round 5: families and processors): the manifest
records the model family (Qwen3-VL and Qwen3.5 share a processor class) and the tokenizer's size; the trainer refuses
another family's data in one line, verify and the trainer refuse token ids outside the vocabulary (a processor swapped
for a smaller one ended the trainer in an IndexError traceback)."""

import json
import re

import pytest

from tests.trainer.test_family_training import build_one
from trainer.families import BY_NAME, FAMILIES


def _train(ds, out, name: str) -> int:
    from trainer.train import main

    argv = ["--data", str(ds), "--out", str(out), "--tiny-random", name, "--max-steps", "1"]
    return main([*argv, "--num-workers", "0", "--no-progress", "--device", "cpu"])


def test_the_family_names_are_the_trainers_and_the_tiny_processors():
    """vlmprep's MODEL_FAMILIES (what the manifest records) names each family as the trainer and `tiny:NAME` do."""
    from vlmprep.families import MODEL_FAMILIES
    from vlmprep.processors.tiny import SPECS

    assert set(MODEL_FAMILIES.values()) | {"qwen3.5"} == set(BY_NAME)
    for f in FAMILIES:
        assert {MODEL_FAMILIES[c] for c in f.processor_classes} == {"qwen3-vl" if f.name == "qwen3.5" else f.name}
    for name, spec in SPECS.items():
        assert MODEL_FAMILIES[spec.processor_class] == ("qwen3-vl" if name == "qwen3.5" else name)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The one-record dataset built with tiny:qwen3-vl and with tiny:qwen3.5 (one processor class, two families)."""
    out = {}
    for name in ("qwen3-vl", "qwen3.5"):
        out[name], _, _ = build_one(tmp_path_factory.mktemp(name), f"tiny:{name}")
    return out


def test_the_manifest_records_the_family_and_the_vocabulary(qwen3):
    from vlmprep.processors.load import load_saved_processor

    for name, ds in qwen3.items():
        saved = json.loads((ds / "manifest.json").read_text())["processor"]
        assert saved["class"] == "Qwen3VLProcessor" and saved["family"] == name
        assert saved["vocab_size"] == len(load_saved_processor(ds / "processor").tokenizer)


@pytest.mark.parametrize(("data", "model"), [("qwen3-vl", "qwen3.5"), ("qwen3.5", "qwen3-vl")])
def test_qwen3_vl_data_does_not_train_a_qwen3_5_model_nor_the_reverse(qwen3, tmp_path, capsys, data, model):
    """Both render with Qwen3VLProcessor, so a check of the class let either train the other (exit 0, a model
    trained on another tokenizer's ids): the family the manifest records is compared with the model's."""
    assert _train(qwen3[data], tmp_path / "run", model) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"was rendered with Qwen3VLProcessor ({data}), but the model is {model}" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _smaller_vocabulary(proc) -> int:
    """Rewrites the processor dir's tokenizer without its BPE merges: the byte alphabet, then the same added tokens
    renumbered right after it (what a processor of a smaller vocabulary swapped into the dataset looks like)."""
    tok = json.loads((proc / "tokenizer.json").read_text())
    base = {t: i for t, i in tok["model"]["vocab"].items() if i < 256}
    tok["model"]["vocab"], tok["model"]["merges"] = base, []
    renumber = {a["id"]: len(base) + k for k, a in enumerate(sorted(tok["added_tokens"], key=lambda a: a["id"]))}
    for a in tok["added_tokens"]:
        a["id"] = renumber[a["id"]]
    (proc / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((proc / "tokenizer_config.json").read_text())
    decoder = cfg.get("added_tokens_decoder") or {}
    cfg["added_tokens_decoder"] = {str(renumber[int(k)]): v for k, v in decoder.items()}
    (proc / "tokenizer_config.json").write_text(json.dumps(cfg))
    return len(base) + len(renumber)


def test_a_processor_swapped_for_a_smaller_vocabulary_fails_verify_and_the_trainer_in_one_line(tmp_path, capsys):
    """The shards' ids reach past the swapped tokenizer: `verify` said OK and the trainer's tiny model (sized to that
    tokenizer) ended in an IndexError traceback. verify now loads the saved processor and checks every id against it
    (and the manifest's recorded size against it); the trainer checks each micro-batch's ids against the model's
    embedding rows: one DataError line naming the sample."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    ds, _, _ = build_one(tmp_path, "tiny:qwen2.5-vl")
    size = _smaller_vocabulary(ds / "processor")
    res = CliRunner().invoke(app, ["verify", str(ds)])
    assert res.exit_code == 1 and "tokens, the manifest records" in res.output, res.output
    manifest = json.loads((ds / "manifest.json").read_text())
    del manifest["processor"]["vocab_size"]  # a dataset built before it was recorded, or a manifest edited to match
    (ds / "manifest.json").write_text(json.dumps(manifest))
    res = CliRunner().invoke(app, ["verify", str(ds)])
    assert res.exit_code == 1 and f"outside the saved processor's {size} tokens" in res.output, res.output
    assert _train(ds, tmp_path / "run", "qwen2.5-vl") == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the start-up lines: the first micro-batch is where ids are seen
    assert "Traceback" not in err and last.startswith("trainer: error:") and "sample r (key " in last, err
    assert re.search(rf"holds token id \d+, outside the model's {size} embeddings", last), last


def test_a_dataset_of_the_models_own_vocabulary_passes_both_checks(tmp_path):
    from vlmprep.tools.verify import verify_dataset

    ds, _, _ = build_one(tmp_path, "tiny:qwen2.5-vl")
    assert verify_dataset(ds) == []
    assert _train(ds, tmp_path / "run", "qwen2.5-vl") == 0
