"""Reject messages and fix lines say what would help (issue 53.5): an image Llama 4's Hub template drops from a user
message beside tools names the bundled template that renders it (not "move the image to a user message", where it
already is), and a build whose lost turns sit in one-image records (LLaVA-OneVision) is told to raise --seq-len, not
to pass --keep-images, which drops older images and cannot shorten such a record."""

import json
from pathlib import Path

import pytest
from PIL import Image

from vlmprep.builder.pipeline import build
from vlmprep.builder.workers import BuildError
from vlmprep.config import BuildConfig
from vlmprep.families import FAMILIES
from vlmprep.processors.load import bundled_templates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click at a point.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
]


def _records(path: Path, recs: list[dict]) -> Path:
    Image.new("RGB", (64, 64), (200, 10, 10)).save(path.parent / "red.png")
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _rejects(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]


def test_each_family_names_its_bundled_templates_and_every_template_has_a_family():
    named = {t for f in FAMILIES.values() for t in f.templates}
    assert sorted(named) == bundled_templates() and all(f.templates for f in FAMILIES.values())


def test_an_image_llama4s_template_drops_beside_tools_names_the_template_that_renders_it(tmp_path):
    """tiny:llama-4 (the Hub template): with tools, the first user message is printed as text beside the tool list,
    so its image is dropped. The reject names that, and the bundled llama4_llama_models, which renders it: rebuilt
    with it, the record lands. Before: "move the image to a user message" for an image already in one."""
    image = {"type": "image_url", "image_url": {"url": "red.png"}}
    user = {"role": "user", "content": [image, {"type": "text", "text": "Click the red square."}]}
    rec = {"id": "t", "tools": TOOLS, "messages": [user, {"role": "assistant", "content": "Done."}]}
    inp = _records(tmp_path / "in.jsonl", [rec])
    kw = dict(processor="tiny:llama-4", progress=False, allow_empty=True, min_turn_coverage=0)
    build(BuildConfig(inputs=(str(inp),), out=str(tmp_path / "hub"), **kw))
    (reject,) = _rejects(tmp_path / "hub")
    assert reject["reason"] == "image_count_mismatch"
    msg = reject["message"]
    assert "move the image to a user message" not in msg
    assert msg.startswith("messages[0] (user): the chat template prints this message as text beside the tool list")
    assert msg.endswith(
        "pass --chat-template llama4_llama_models (bundled; it renders them), or give the images in a later user "
        "message"
    )
    res = build(BuildConfig(inputs=(str(inp),), out=str(tmp_path / "fixed"), chat_template="llama4_llama_models", **kw))
    assert res.manifest.totals["samples"] == 1 and not res.manifest.rejects


SEQ_LEN = 2048


def _llava(tmp_path: Path, name: str, images: int):
    """tiny:llava-onevision over 4 records of `images` images each (an image and a question per user turn, then
    the answer); 2 of them answer a question far over --seq-len 2048, which costs that turn."""
    image = {"type": "image_url", "image_url": {"url": "red.png"}}
    recs = []
    for i in range(4):
        msgs = []
        for k in range(images):
            ask = "What is it? " + ("and more " * 1500 if i % 2 and k == images - 1 else "")
            msgs += [{"role": "user", "content": [image, {"type": "text", "text": ask}]}]
            msgs += [{"role": "assistant", "content": f"Red {k}."}]
        recs.append({"id": f"r{i}", "messages": msgs})
    inp = _records(tmp_path / f"{name}.jsonl", recs)
    cfg = BuildConfig(
        inputs=(str(inp),), out=str(tmp_path / name), processor="tiny:llava-onevision", seq_len=SEQ_LEN, progress=False
    )
    with pytest.raises(BuildError) as e:
        build(cfg)
    return str(e.value)


def test_turns_lost_in_one_image_records_are_told_to_raise_seq_len_not_to_keep_fewer_images(tmp_path):
    """Two of four one-image records lose their turn to --seq-len (LLaVA-OneVision makes a 64x64 image 1485
    tokens): the coverage line's fix is --seq-len, naming why --keep-images cannot help (it suggested `--keep-images
    last:3` before). Records of three images losing their last turn are still pointed at --keep-images."""
    msg = _llava(tmp_path, "one", images=1)
    assert "turn coverage 50.0% < --min-turn-coverage 0.95" in msg, msg
    assert (
        "fix: raise --seq-len (2 of the 2 turns lost are in records holding at most one image, which --keep-images "
        "cannot shorten); the dataset is written" in msg
    ), msg
    assert "--keep-images last" not in msg
    msg = _llava(tmp_path, "three", images=3)
    assert "fix: pass --keep-images last:3 to drop older screenshots, or raise --seq-len" in msg, msg


def test_the_fix_lines_leave_keep_images_out_where_it_cannot_help():
    """The manifest's turns_lost_single_image decides it, for the coverage line (split and truncate) and for the
    reject fix of turn_too_long (a build that wrote 0 samples); a dataset built before it (no such count) is told as
    before."""
    from tests.vlmprep.conftest import a_manifest
    from vlmprep.shards.summary import coverage_problem, reject_fix

    def manifest(long_traces, single, **lost):
        totals = {f"turns_lost_{k}": v for k, v in lost.items()} | (
            {"turns_lost_single_image": single} if single else {}
        )
        turns = {"trained_assistant_turns": 1, "lost": {"truncated": lost.get("truncated", 0)}}
        turns["lost"]["turn_too_long"] = lost.get("too_long", 0)
        return a_manifest(turns=turns, totals=totals, config={"seq_len": 2048, "long_traces": long_traces})

    msg = coverage_problem(manifest("truncate", 3, truncated=3), 0.95)
    assert msg.endswith("fix: drop --long-traces truncate (split, the default, trains every turn in step samples)")
    msg = coverage_problem(manifest("truncate", 0, truncated=3), 0.95)
    assert msg.endswith(
        "(split, the default, trains every turn in step samples), or pass --keep-images last:3 so that traces fit"
    )
    assert reject_fix("turn_too_long", manifest("split", 3, too_long=3)) == (
        "raise --seq-len (3 of the 3 turns lost are in records holding at most one image, which --keep-images cannot "
        "shorten)"
    )
    assert reject_fix("turn_too_long", manifest("split", 0, too_long=3)).endswith(
        "--keep-images last:N to drop older screenshots"
    )
