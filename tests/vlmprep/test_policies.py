"""Masking policies on two families with different templates (Qwen2-VL chatml with a tool role; Gemma 3 with its
system turn folded into the first user turn): every --train-on-eos value, --train-on-roles, weight, --last-turn-only;
plus config validation, the CLI flags and the manifest record."""

import json
import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.support.tiny_processors import load_family_processor
from tests.vlmprep.test_families import png, render, trained_runs
from vlmprep.config import BuildConfig
from vlmprep.render.sample import MaskPolicy


def record(name, *, weight_first_answer=None, weight_first_question=None):
    mid = "tool" if name == "qwen2-vl" else "user"  # Gemma 3's template only alternates user/model
    first_q = {
        "role": "user",
        "content": [{"type": "text", "text": "Look."}, {"type": "image_url", "image_url": png(56, 56, (200, 10, 10))}],
    }
    first_a = {"role": "assistant", "content": "Red."}
    if weight_first_question is not None:
        first_q["weight"] = weight_first_question
    if weight_first_answer is not None:
        first_a["weight"] = weight_first_answer
    second = {
        "role": mid,
        "content": [{"type": "text", "text": "Next."}, {"type": "image_url", "image_url": png(56, 28, (0, 90, 0))}],
    }
    if mid == "tool":
        second["tool_call_id"] = "call_0001"
    return {
        "id": "p",
        "messages": [
            {"role": "system", "content": "Be brief."},
            first_q,
            first_a,
            second,
            {"role": "assistant", "content": "Green."},
        ],
    }


MID = {"qwen2-vl": "tool", "gemma3": "user"}
CASES = {
    "default": ({}, MaskPolicy()),
    "eos-all": ({}, MaskPolicy(train_on_eos="all")),
    "eos-turn": ({}, MaskPolicy(train_on_eos="turn")),
    "eos-last": ({}, MaskPolicy(train_on_eos="last")),
    "eos-none": ({}, MaskPolicy(train_on_eos="none")),
    "roles+mid": ({}, None),  # assistant + the middle turn's role (tool for Qwen2-VL, user for Gemma 3)
    "weight0": (dict(weight_first_answer=0), MaskPolicy()),
    "weight1-user": (dict(weight_first_question=1), MaskPolicy()),
    "last-turn": ({}, MaskPolicy(last_turn_only=True)),
    "last-turn+weight0+no-eos": (dict(weight_first_answer=0), MaskPolicy(last_turn_only=True, train_on_eos="none")),
}
EXPECTED = {
    "qwen2-vl": {
        "default": [(24, 27, "Red.<|im_end|>"), (46, 49, "Green.<|im_end|>")],
        # every turn's end: system, user (after its image), assistant, tool (after its image), assistant
        "eos-all": [
            (6, 7, "<|im_end|>"),
            (19, 20, "<|im_end|>"),
            (24, 27, "Red.<|im_end|>"),
            (41, 42, "<|im_end|>"),
            (46, 49, "Green.<|im_end|>"),
        ],
        "eos-turn": [(24, 27, "Red.<|im_end|>"), (46, 49, "Green.<|im_end|>")],
        "eos-last": [(24, 26, "Red."), (46, 49, "Green.<|im_end|>")],
        "eos-none": [(24, 26, "Red."), (46, 48, "Green.")],
        "roles+mid": [
            (24, 27, "Red.<|im_end|>"),
            (31, 33, "Next."),
            (41, 42, "<|im_end|>"),
            (46, 49, "Green.<|im_end|>"),
        ],
        "weight0": [(46, 49, "Green.<|im_end|>")],
        "weight1-user": [
            (11, 13, "Look."),
            (19, 20, "<|im_end|>"),
            (24, 27, "Red.<|im_end|>"),
            (46, 49, "Green.<|im_end|>"),
        ],
        "last-turn": [(46, 49, "Green.<|im_end|>")],
        "last-turn+weight0+no-eos": [(46, 48, "Green.")],
    },
    "gemma3": {
        "default": [(289, 293, "Red.<end_of_turn>"), (572, 576, "Green.<end_of_turn>")],
        # the system text is folded into the first user turn: it has no end token of its own
        "eos-all": [
            (281, 282, "<end_of_turn>"),
            (289, 293, "Red.<end_of_turn>"),
            (564, 565, "<end_of_turn>"),
            (572, 576, "Green.<end_of_turn>"),
        ],
        "eos-turn": [(289, 293, "Red.<end_of_turn>"), (572, 576, "Green.<end_of_turn>")],
        "eos-last": [(289, 292, "Red."), (572, 576, "Green.<end_of_turn>")],
        "eos-none": [(289, 292, "Red."), (572, 575, "Green.")],
        "roles+mid": [
            (16, 21, "Look."),
            (281, 282, "<end_of_turn>"),
            (289, 293, "Red.<end_of_turn>"),
            (299, 304, "Next."),
            (564, 565, "<end_of_turn>"),
            (572, 576, "Green.<end_of_turn>"),
        ],
        "weight0": [(572, 576, "Green.<end_of_turn>")],
        "weight1-user": [
            (16, 21, "Look."),
            (281, 282, "<end_of_turn>"),
            (289, 293, "Red.<end_of_turn>"),
            (572, 576, "Green.<end_of_turn>"),
        ],
        "last-turn": [(572, 576, "Green.<end_of_turn>")],
        "last-turn+weight0+no-eos": [(572, 575, "Green.")],
    },
}


@pytest.mark.parametrize("name", ["qwen2-vl", "gemma3"])
@pytest.mark.parametrize("case", list(CASES))
def test_policy_masks_are_literal(name, case):
    processor = load_family_processor(name)
    kw, policy = CASES[case]
    if policy is None:
        policy = MaskPolicy(train_on_roles=frozenset({"assistant", MID[name]}))
    conv, images, ctx, s = render(record(name, **kw), processor, policy)
    runs = trained_runs(s, processor.tokenizer)
    assert runs == EXPECTED[name][case]
    # Never a header, image or other scaffolding: each run is a message's text, its end token, or both.
    texts = {m.text for m in conv.messages}
    for a, b, text in runs:
        body = text
        for e in ctx.eot_ids.values():
            body = body.removesuffix(e)
        assert body in texts | {""} and not s.mm_token_type_ids[a:b].any()


def test_policy_validation():
    with pytest.raises(ValueError, match="train_on_eos"):
        MaskPolicy(train_on_eos="sometimes")
    with pytest.raises(ValueError, match="train_on_roles"):
        MaskPolicy(train_on_roles=frozenset({"assistent"}))
    with pytest.raises(ValueError, match="--train-on-roles assistant,tool"):
        BuildConfig(inputs=("x",), out="o", train_on_roles=("robot",))
    with pytest.raises(ValueError, match="train_on_eos"):
        BuildConfig(inputs=("x",), out="o", train_on_eos="never")
    with pytest.raises(ValueError, match="tool_calls"):
        BuildConfig(inputs=("x",), out="o", tool_calls="ignore")
    with pytest.raises(ValueError, match="--chat-template"):
        BuildConfig(inputs=("x",), out="o", chat_template="/nonexistent.jinja")
    with pytest.raises(ValueError, match="--role-boundaries"):
        BuildConfig(inputs=("x",), out="o", role_boundaries="/nonexistent.toml")


def test_cli_flags_reach_the_shards_and_the_manifest(tmp_path, qwen2vl_processor):
    from vlmprep.cli import app

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(record("qwen2-vl")) + "\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "build",
            "--in",
            str(inp),
            "--out",
            str(out),
            "--no-progress",
            "--train-on-roles",
            "assistant,tool",
            "--train-on-eos",
            "last",
            "--last-turn-only",
        ],
    )
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "manifest.json").read_text())["config"]
    assert (cfg["train_on_roles"], cfg["train_on_eos"], cfg["last_turn_only"], cfg["tool_calls"]) == (
        ["assistant", "tool"],
        "last",
        True,
        "reject",
    )
    with tarfile.open(out / "shard-000000.tar") as tf:
        arrays = {m.name.split(".", 1)[1]: tf.extractfile(m).read() for m in tf.getmembers()}
    import io

    ids = np.load(io.BytesIO(arrays["input_ids.npy"]))
    mask = np.load(io.BytesIO(arrays["loss_mask.npy"])).astype(bool)
    assert qwen2vl_processor.tokenizer.decode(ids[mask].tolist()) == "Green.<|im_end|>"
    bad = CliRunner().invoke(app, ["build", "--in", str(inp), "--out", str(out), "--train-on-eos", "maybe"])
    assert bad.exit_code == 2 and "'maybe' is not one of" in bad.output  # refused at parse time
