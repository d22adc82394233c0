"""Reject messages and fix lines say what would help (issue 53.5): an image Llama 4's Hub template drops from a user
message beside tools names the bundled template that renders it (not "move the image to a user message", where it
already is)."""

import json
from pathlib import Path

from PIL import Image

from vlmprep.builder.pipeline import build
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
