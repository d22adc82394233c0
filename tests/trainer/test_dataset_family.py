"""A dataset trains only the model it was tokenized for (issue 53.6, round 5: families and processors): the manifest
records the model family (Qwen3-VL and Qwen3.5 share a processor class) and the tokenizer's size; the trainer refuses
another family's data in one line, verify and the trainer refuse token ids outside the vocabulary (a processor swapped
for a smaller one ended the trainer in an IndexError traceback)."""

import json

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


def test_the_manifest_records_the_family(qwen3):
    for name, ds in qwen3.items():
        saved = json.loads((ds / "manifest.json").read_text())["processor"]
        assert saved["class"] == "Qwen3VLProcessor" and saved["family"] == name


@pytest.mark.parametrize(("data", "model"), [("qwen3-vl", "qwen3.5"), ("qwen3.5", "qwen3-vl")])
def test_qwen3_vl_data_does_not_train_a_qwen3_5_model_nor_the_reverse(qwen3, tmp_path, capsys, data, model):
    """Both render with Qwen3VLProcessor, so a check of the class let either train the other (exit 0, a model
    trained on another tokenizer's ids): the family the manifest records is compared with the model's."""
    assert _train(qwen3[data], tmp_path / "run", model) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"was rendered with Qwen3VLProcessor ({data}), but the model is {model}" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
