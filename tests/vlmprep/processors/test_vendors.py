"""Real-vocabulary builtins checked against the vendors' own reference encoders: builtin:mistral-3 against
mistral-common's encode_chat_completion and Tekkenizer, builtin:llama-3.2-vision and builtin:llama-4 against
llama-models' ChatFormat and tiktoken Tokenizer: tokens of a fixed conversation set (images expanded the same way),
tokenizer parity on >= 1M characters of mixed scripts, official ids, masks on the real vocabularies, every
difference from the Hugging Face templates pinned, and `vlmprep build --processor builtin:NAME` end to end."""

import base64
import functools
import importlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vlmprep
from tests.vlmprep.processors.test_builtin import PARITY_TEXTS, random_texts
from tests.vlmprep.test_families import render, trained_runs
from vlmprep.processors.builtin import build_builtin_processor
from vlmprep.shards.reader import iter_dataset

IMAGES = {
    "red": (56, 56, (200, 10, 10)),
    "wide": (300, 90, (0, 90, 0)),
    "big": (3000, 1000, (10, 10, 200)),
    "tall": (90, 400, (120, 120, 0)),
}


def png(name):
    w, h, color = IMAGES[name]
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def text(t):
    return {"type": "text", "text": t}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "Click at a point on the screen.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web \u2014 in any language.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]

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
        {"role": "assistant", "content": "def f(x):\n    return x  # indented\n\n\tdone \t  "},
        {"role": "user", "content": [png("red")]},
        {
            "role": "assistant",
            "content": "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 \U0001f468\u200d\U0001f469\u200d\U0001f467",
        },
    ],
    "tool_calls": [
        {"role": "system", "content": "You are a browser agent."},
        {"role": "user", "content": [text("Find the price of the grinder."), png("wide")]},
        {
            "role": "assistant",
            "content": "I will search.",
            "tool_calls": [
                {
                    "id": "a1b2c3d4e",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "espresso grinder \u00e9\u00e8"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "Results: 3 shops."},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "Zz9Yy8Xx7",
                    "type": "function",
                    "function": {"name": "click", "arguments": '{"x": 12, "y": 30}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "Zz9Yy8Xx7", "content": '{"clicked": true}'},
        {"role": "assistant", "content": "The grinder costs $500."},
        {"role": "user", "content": "Thanks! Now open the cart."},
        {
            "role": "assistant",
            "content": "Opening it.",
            "tool_calls": [
                {"id": "q1w2e3r4t", "type": "function", "function": {"name": "click", "arguments": '{"x": 1, "y": 2}'}}
            ],
        },
    ],
    # A browser-agent step: the screenshot comes back in the tool result (llama-models takes images in any role;
    # mistral-common takes only text there, so its template refuses this record).
    "tool_screenshot": [
        {"role": "user", "content": "Open example.com and tell me the headline."},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "n4v1g4t3x",
                    "type": "function",
                    "function": {"name": "navigate", "arguments": '{"url": "https://example.com"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "n4v1g4t3x", "content": [text("Page loaded."), png("wide")]},
        {"role": "assistant", "content": 'The headline is "Example Domain".'},
    ],
    # Parallel tool calls: ChatFormat encodes each call on its own (`}}` then `{"`, never `}}{`), mistral-common all
    # calls as one JSON array.
    "parallel_tool_calls": [
        {"role": "user", "content": [text("Search both grinders, then click the results."), png("red")]},
        {
            "role": "assistant",
            "content": "Searching both.",
            "tool_calls": [
                {
                    "id": "p1a2r3a4l",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "grinder A"}'},
                },
                {
                    "id": "l5e6l7c8a",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "grinder B"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "p1a2r3a4l", "content": "A: $500."},
        {"role": "tool", "tool_call_id": "l5e6l7c8a", "content": "B: $300."},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1l2i3c4k", "type": "function", "function": {"name": "click", "arguments": '{"x": 1, "y": 2}'}},
                {
                    "id": "c5l6i7c8k",
                    "type": "function",
                    "function": {"name": "click", "arguments": '{"x": 3, "y": {"z": 4}}'},
                },
                {"id": "c9l0i1c2k", "type": "function", "function": {"name": "click", "arguments": '{"x": 5, "y": 6}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1l2i3c4k", "content": "ok"},
        {"role": "tool", "tool_call_id": "c5l6i7c8k", "content": "ok"},
        {"role": "tool", "tool_call_id": "c9l0i1c2k", "content": "ok"},
        {"role": "assistant", "content": "A costs $500, B $300."},
    ],
    "multi_text_parts": [
        {"role": "system", "content": [text("Rule one."), text("Rule two.")]},
        {
            "role": "user",
            "content": [text("First part."), text("Second part."), png("red"), text("After."), png("tall")],
        },
        {"role": "assistant", "content": "OK."},
    ],
}
TOOL_RECORDS = {"tool_calls", "parallel_tool_calls"}


@functools.lru_cache(maxsize=None)
def parity_corpus(min_chars=1_000_000, seed=18):
    """>= 1M characters of mixed scripts, code, whitespace runs and emoji: PARITY_TEXTS and random mixed-script
    pieces (test_builtin.random_texts) glued into ~600-character documents."""
    rng = random.Random(seed)
    pool = PARITY_TEXTS + random_texts(6000, seed=seed)
    docs, total = list(PARITY_TEXTS), sum(map(len, PARITY_TEXTS))
    while total < min_chars:
        doc = "".join(
            rng.choice(pool) + rng.choice(["", " ", "\n", "\n\n", "  ", "\t"]) for _ in range(rng.randint(10, 40))
        )
        docs.append(doc)
        total += len(doc)
    return tuple(docs)


def record(name):
    return {"id": name, "messages": CONVERSATIONS[name], **({"tools": TOOLS} if name in TOOL_RECORDS else {})}


# ---- fixtures: each builtin built once per session; the vendor references ----------------------------------------


@pytest.fixture(scope="session")
def vendor_cache():
    from vlmprep.processors.builtin import default_cache_dir

    return default_cache_dir()  # the session's private cache (tests/conftest.py), which `build` uses too


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

    from vlmprep.processors.mistral import tekken_resource

    data = json.loads(tekken_resource().read_text(encoding="utf-8"))
    data["config"]["version"] = "v7"
    data["image"] = {"image_patch_size": 14, "max_image_size": 1540, "spatial_merge_size": 2}
    path = tmp_path_factory.mktemp("mistral-ref") / "tekken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    # Only the tokens are compared: skip the pixel transform (it needs opencv), keep the token count it derives.
    patch = pytest.MonkeyPatch()
    patch.setattr(mimage, "transform_image", lambda image, size: np.zeros((3, size[1], size[0]), np.float32))
    yield MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)
    patch.undo()


def mistral_tokens(reference, rec):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    req = ChatCompletionRequest.from_openai(json.loads(json.dumps(rec["messages"])), tools=rec.get("tools"))
    return reference.encode_chat_completion(req).tokens


# ---- builtin:mistral-3 ----------------------------------------------------------------------------------------------


MISTRAL_PARITY = [n for n in CONVERSATIONS if n != "tool_screenshot"]


@pytest.mark.parametrize("name", MISTRAL_PARITY)
def test_mistral3_matches_mistral_common_on_fixed_conversations(mistral3, mistral_reference, name):
    rec = record(name)
    *_, sample = render(rec, mistral3)
    want = mistral_tokens(mistral_reference, rec)
    got = sample.input_ids.tolist()
    assert got == want, mistral3.tokenizer.decode(got) + "\n!=\n" + mistral3.tokenizer.decode(want)


MISTRAL_RUNS = {
    "tool_calls": [
        'I will search.[TOOL_CALLS][{"name": "search", "arguments": {"q": "espresso grinder \u00e9\u00e8"}, "id": "a1b2c3d4e"}]</s>',
        '[TOOL_CALLS][{"name": "click", "arguments": {"x": 12, "y": 30}, "id": "Zz9Yy8Xx7"}]</s>',
        "The grinder costs $500.</s>",
        'Opening it.[TOOL_CALLS][{"name": "click", "arguments": {"x": 1, "y": 2}, "id": "q1w2e3r4t"}]</s>',
    ],
    # mistral-common strips trailing spaces (only spaces) from assistant text; the mask follows the rendered text.
    "no_system_whitespace_big_image": [
        "def f(x):\n    return x  # indented\n\n\tdone \t</s>",
        "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 "
        "\U0001f468\u200d\U0001f469\u200d\U0001f467</s>",
    ],
}


@pytest.mark.parametrize("name", list(MISTRAL_RUNS))
def test_mistral3_masks_train_assistant_text_calls_and_eos(mistral3, name):
    *_, sample = render(record(name), mistral3)
    assert [t for _, _, t in trained_runs(sample, mistral3.tokenizer)] == MISTRAL_RUNS[name]


def test_mistral3_refuses_an_image_in_a_tool_result(mistral3, mistral_reference):
    # mistral-common has no form for it (tool content is text only); the template refuses rather than invent one.
    with pytest.raises(Exception, match="only text in a tool result"):
        render(record("tool_screenshot"), mistral3)
    from mistral_common.exceptions import InvalidToolMessageException

    with pytest.raises(InvalidToolMessageException, match="Unexpected content chunk types in tool message"):
        mistral_tokens(mistral_reference, record("tool_screenshot"))


def test_mistral3_tokenizer_matches_tekkenizer_on_1m_chars(mistral3, mistral_reference):
    tekken = mistral_reference.instruct_tokenizer.tokenizer
    docs = parity_corpus()
    assert sum(map(len, docs)) >= 1_000_000
    got = mistral3.tokenizer(list(docs), add_special_tokens=False)["input_ids"]
    bad = [i for i, d in enumerate(docs) if got[i] != tekken.encode(d, bos=False, eos=False)]
    assert not bad, ascii(docs[bad[0]][:200])


def test_mistral3_special_tokens_at_official_ids(mistral3, mistral_reference):
    from vlmprep.processors.mistral import SPECIAL_IDS

    tok, tekken = mistral3.tokenizer, mistral_reference.instruct_tokenizer.tokenizer
    assert len(tok) == tekken.n_words == 131072
    for token, token_id in SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(token) == token_id == tekken.get_special_token(token), token
        assert tok.encode(token, add_special_tokens=False) == [token_id]
    assert tok.convert_ids_to_tokens(999) == "<SPECIAL_999>" and tekken.id_to_piece(999) == "<SPECIAL_999>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, 11)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # the template writes <s> itself
    assert (mistral3.image_token, mistral3.image_break_token, mistral3.image_end_token) == (
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    )


def test_mistral3_hf_template_differs_from_mistral_common(mistral3, mistral_reference):
    """The Hub template (vlmprep/templates/mistral3.jinja, via --chat-template) against mistral-common: each
    difference pinned. The builtin defaults to mistral-common's format (mistral3_mistral_common.jinja)."""
    import datetime

    from vlmprep.processors.mistral import HF_TEMPLATE, read_template
    from vlmprep.types import RecordError

    hf = read_template(HF_TEMPLATE)
    dec = mistral3.tokenizer.decode

    # 1. No system message: the Hub template injects its default system prompt with today's date; mistral-common none.
    rec = record("no_system_whitespace_big_image")
    *_, s = render(rec, mistral3, chat_template=hf)
    text = dec(s.input_ids.tolist())
    assert text.startswith("<s>[SYSTEM_PROMPT]You are Mistral Small 3, a Large Language Model")
    assert f"The current date is {datetime.date.today():%Y-%m-%d}." in text
    assert dec(mistral_tokens(mistral_reference, rec)).startswith("<s>[INST][IMG]")
    # 2. A user turn [text, image]: mistral-common moves the image first, the Hub template keeps the order;
    # 3. trailing spaces of assistant text: mistral-common strips them, the Hub template keeps them.
    assert "[INST]  leading spaces," in text and "[IMG_END][/INST]def f(x)" in text and "\tdone \t  </s>" in text
    ref = dec(mistral_tokens(mistral_reference, rec))
    assert "[INST][IMG]" in ref and "[IMG_END]  leading spaces," in ref and "\tdone \t</s>" in ref
    # 4. Adjacent text parts: mistral-common joins them with a blank line; the Hub template keeps only the first
    # part of a system message (vlmprep refuses the record: the template drops text).
    with pytest.raises(RecordError, match="drops this message's text"):
        render(record("multi_text_parts"), mistral3, chat_template=hf)
    assert "[SYSTEM_PROMPT]Rule one.\n\nRule two.[/SYSTEM_PROMPT]" in dec(
        mistral_tokens(mistral_reference, record("multi_text_parts"))
    )
    # 5. Tool calls: the Hub template drops the text of a turn that calls tools (refused) and prints other formats:
    # a space after [AVAILABLE_TOOLS] and [TOOL_CALLS], v3-style tool results (content printed with |string, so a
    # list of parts comes out as its Python repr: vlmprep's parts never render right there).
    with pytest.raises(RecordError, match="drops this message's text"):
        render(record("tool_calls"), mistral3, chat_template=hf)
    msgs = json.loads(json.dumps(CONVERSATIONS["tool_calls"]))
    msgs[1]["content"] = "Find the price of the grinder."
    for m in msgs:
        if m.get("tool_calls"):
            m.pop("content", None)
    ref = dec(mistral_tokens(mistral_reference, {"messages": msgs, "tools": TOOLS}))
    for m in msgs:
        for tc in m.get("tool_calls", []):
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    text = mistral3.apply_chat_template(msgs, tools=TOOLS, chat_template=hf, tokenize=False)
    assert '[AVAILABLE_TOOLS] [{"type": "function"' in text and '[AVAILABLE_TOOLS][{"type": "function"' in ref
    assert '[TOOL_CALLS] [{"name": "search"' in text and '[TOOL_CALLS][{"name": "search"' in ref
    assert '[TOOL_RESULTS] {"content": Results: 3 shops., "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]' in text
    assert "[TOOL_RESULTS]a1b2c3d4e[TOOL_CONTENT]Results: 3 shops.[/TOOL_RESULTS]" in ref


def test_mistral3_image_downscale_rounding_differs_from_mistral_common(mistral3, mistral_reference):
    """An image over 1540 px is scaled down before the 28 px grid: mistral-common rounds the scaled side,
    PixtralImageProcessor floors it. They disagree only when the scaled side lands in [28k + 0.5, 28k + 1): here
    3000x1092 -> 1540 x 560.56, 21 rows for mistral-common (561 px), 20 for transformers (560 px). Pinned, not
    papered over: the stored pixels must be what the processor makes, so vlmprep follows transformers here."""

    def rec_of(w, h):
        IMAGES["rounding"] = (w, h, (0, 0, 0))
        return {
            "id": "rounding",
            "messages": [{"role": "user", "content": [png("rounding")]}, {"role": "assistant", "content": "Black."}],
        }

    rec = rec_of(3000, 1092)
    *_, s = render(rec, mistral3)
    ids, ref = s.input_ids.tolist(), mistral_tokens(mistral_reference, rec)
    breaks = mistral3.tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
    rows = lambda t: sum(t.count(b) for b in breaks)  # noqa: E731
    assert (rows(ids), rows(ref)) == (20, 21)
    assert ids.count(10) == 20 * 55 and ref.count(10) == 21 * 55
    # Off the boundary they agree (the fixed set has a 3000x1000 image).
    rec = rec_of(3000, 1100)
    *_, s = render(rec, mistral3)
    assert s.input_ids.tolist() == mistral_tokens(mistral_reference, rec)


# ---- builtin:llama-3.2-vision ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama32(vendor_cache):
    return build_builtin_processor("llama-3.2-vision", vendor_cache)


def raw_messages(messages):
    """OpenAI-format messages -> llama-models RawMessages (images as the PNG bytes of their data URLs)."""
    from llama_models.datatypes import RawMediaItem, RawMessage, RawTextItem, ToolCall

    def item(part):
        if part["type"] == "text":
            return RawTextItem(text=part["text"])
        url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
        return RawMediaItem(data=base64.b64decode(url.split(",", 1)[1]))

    out = []
    for m in messages:
        content = m.get("content") or ""
        calls = [
            ToolCall(
                call_id=tc["id"], tool_name=tc["function"]["name"], arguments=json.loads(tc["function"]["arguments"])
            )
            for tc in m.get("tool_calls", [])
        ]
        out.append(
            RawMessage(
                role=m["role"],
                content=content if isinstance(content, str) else [item(p) for p in content],
                tool_calls=calls,
            )
        )
    return out


@pytest.fixture(scope="session")
def llama32_format():
    """llama-models' Llama 3 ChatFormat (its tiktoken Tokenizer; images are one <|image|> token each)."""
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    return ChatFormat(Tokenizer.get_instance())


def chat_format_tokens(fmt, rec):
    """ChatFormat.encode_dialog_prompt (Llama 3 or 4) without the assistant header it appends for generation."""
    tokens = fmt.encode_dialog_prompt(raw_messages(rec["messages"])).tokens
    header = fmt._encode_header("assistant")
    assert tokens[-len(header) :] == header
    return tokens[: -len(header)]


LLAMA_PARITY = [
    "system_images_cjk_emoji",
    "no_system_whitespace_big_image",
    "tool_calls",
    "tool_screenshot",
    "parallel_tool_calls",
]


def test_llama32_special_tokens_at_official_ids(llama32):
    from llama_models.llama3.tokenizer import Tokenizer

    ref, tok = Tokenizer.get_instance(), llama32.tokenizer
    assert len(tok) == ref.n_words + 1 == 128257  # + <|image|> at 128256
    same = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_right_pad_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    for t in same:
        assert tok.convert_tokens_to_ids(t) == ref.special_tokens[t] and tok.encode(t, add_special_tokens=False) == [
            ref.special_tokens[t]
        ]
    # llama-models keeps <|image|> at 128011 internally and emits 128256 (the HF id) in ChatFormat's tokens.
    assert (
        llama32.image_token_id == tok.convert_tokens_to_ids("<|image|>") == 128256
        and ref.special_tokens["<|image|>"] == 128011
    )
    assert tok.convert_ids_to_tokens([128005, 128011, 128255]) == [
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|reserved_special_token_247|>",
    ]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (128000, 128009, 128004)
    assert tok.encode("hi") == [128000, 6151]  # as the official tokenizer.json: encode() adds <|begin_of_text|>


def test_llama32_hf_template_and_text_part_boundaries_differ_from_chat_format(llama32, llama32_format):
    """Each difference from llama-models' ChatFormat, pinned. The builtin renders ChatFormat's format
    (llama3_2_vision_llama_models.jinja); the Hub template is vlmprep/templates/llama3_2_vision.jinja."""
    from vlmprep.processors.llama import read_template
    from vlmprep.types import RecordError

    hf = read_template("llama3_2_vision.jinja")
    dec = llama32.tokenizer.decode
    # 1. Images next to a system message: the Hub template refuses them, ChatFormat encodes them.
    with pytest.raises(Exception, match="incompatible with system messages"):
        render(record("system_images_cjk_emoji"), llama32, chat_template=hf)
    # 2. Text only: the Hub template adds a system turn with a knowledge cutoff and today's date; ChatFormat none.
    rec = {"id": "t", "messages": [{"role": "user", "content": "Hi  "}, {"role": "assistant", "content": "Hello"}]}
    *_, s = render(rec, llama32, chat_template=hf)
    assert dec(s.input_ids.tolist()).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: "
    )
    *_, s = render(rec, llama32)
    assert s.input_ids.tolist() == chat_format_tokens(llama32_format, rec)
    assert dec(s.input_ids.tolist()) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi  <|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
    )
    # 3. Tool calls: the Hub template replaces the turn by {"name", "parameters"} (its text is dropped: refused);
    # ChatFormat prints the text, then {"type": "function", "name", "parameters"} with json.dumps' ASCII escapes.
    rec = {"id": "calls", "messages": [m for m in CONVERSATIONS["tool_calls"] if m["role"] != "system"]}
    rec["messages"][0] = {"role": "user", "content": "Find the price of the grinder."}
    with pytest.raises(RecordError, match="drops this message's text"):
        render(rec, llama32, chat_template=hf)
    # 4. Adjacent text parts of one message: ChatFormat encodes each part on its own, a rendered template joins them,
    # so BPE may merge across the seam ("one." + "Rule" -> "one", ".Rule"). Same text, different ids at the seam:
    # not reproducible by any template; vlmprep keeps the joined encoding (the one the model sees at inference).
    rec = record("multi_text_parts")
    *_, s = render(rec, llama32)
    got, want = s.input_ids.tolist(), chat_format_tokens(llama32_format, rec)
    assert got != want and dec(got) == dec(want)
    toks = llama32.tokenizer.convert_ids_to_tokens
    assert toks(got)[5:10] == ["Rule", "\u0120one", ".Rule", "\u0120two", "."]
    assert toks(want)[5:11] == ["Rule", "\u0120one", ".", "Rule", "\u0120two", "."]


# ---- builtin:llama-4 ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama4(vendor_cache):
    return build_builtin_processor("llama-4", vendor_cache)


@pytest.fixture(scope="session")
def llama4_format():
    """llama-models' Llama 4 ChatFormat with Llama-4-Scout's vision args (336 px tiles, 14 px patches, shuffle 0.5)."""
    from llama_models.llama4.args import Size, VisionArgs
    from llama_models.llama4.chat_format import ChatFormat
    from llama_models.llama4.tokenizer import Tokenizer

    args = VisionArgs(
        image_size=Size(height=336, width=336),
        patch_size=Size(height=14, width=14),
        dim=1408,
        n_layers=34,
        n_heads=16,
        mlp_ratio=4.0,
        output_dim=4096,
        pixel_shuffle_ratio=0.5,
    )
    return ChatFormat(Tokenizer.get_instance(), vision_args=args)


# ---- both Llama builtins against llama-models: one test per check, parametrized by builtin ----------------------------

LLAMAS = {  # builtin -> (processor fixture, ChatFormat fixture, llama-models module, end of a call turn, of a text turn)
    "llama-3.2-vision": ("llama32", "llama32_format", "llama3", "<|eot_id|>", "<|eot_id|>"),
    "llama-4": ("llama4", "llama4_format", "llama4", "<|eom|>", "<|eot|>"),
}


@pytest.mark.parametrize("name", LLAMA_PARITY)
@pytest.mark.parametrize("builtin", list(LLAMAS))
def test_llama_matches_llama_models_chat_format_on_fixed_conversations(request, builtin, name):
    processor = request.getfixturevalue(LLAMAS[builtin][0])
    rec = record(name)
    *_, sample = render(rec, processor)
    want = chat_format_tokens(request.getfixturevalue(LLAMAS[builtin][1]), rec)
    got = sample.input_ids.tolist()
    assert got == want, processor.tokenizer.decode(got) + "\n!=\n" + processor.tokenizer.decode(want)


@pytest.mark.parametrize("builtin", list(LLAMAS))
def test_llama_masks_train_assistant_text_calls_and_turn_ends(request, builtin):
    processor, call_end, text_end = request.getfixturevalue(LLAMAS[builtin][0]), *LLAMAS[builtin][3:]
    *_, sample = render(record("tool_calls"), processor)
    assert [t for _, _, t in trained_runs(sample, processor.tokenizer)] == [
        'I will search.{"type": "function", "name": "search", "parameters": {"q": "espresso grinder \\u00e9\\u00e8"}}'
        + call_end,
        '{"type": "function", "name": "click", "parameters": {"x": 12, "y": 30}}' + call_end,
        "The grinder costs $500." + text_end,
        'Opening it.{"type": "function", "name": "click", "parameters": {"x": 1, "y": 2}}' + call_end,
    ]


@pytest.mark.parametrize("builtin", list(LLAMAS))
def test_llama_tokenizer_matches_llama_models_on_1m_chars(request, builtin):
    processor = request.getfixturevalue(LLAMAS[builtin][0])
    ref = importlib.import_module(f"llama_models.{LLAMAS[builtin][2]}.tokenizer").Tokenizer.get_instance()
    docs = parity_corpus()
    got = processor.tokenizer(list(docs), add_special_tokens=False)["input_ids"]
    bad = [i for i, d in enumerate(docs) if got[i] != ref.encode(d, bos=False, eos=False)]
    assert not bad, ascii(docs[bad[0]][:200])


def test_llama4_parallel_tool_calls_are_encoded_each_on_its_own(llama4, llama4_format):
    """Two calls in one turn: ChatFormat encodes `...}}` and `{"type"...` apart; one tokenizer call over the joined
    string would merge `}}{` across the seam. The template breaks there, the tokenizer drops the break, so render and
    the processor's own apply_chat_template both give ChatFormat's tokens, and the trained run decodes without it."""
    from vlmprep.processors.llama import TOKEN_BREAK

    rec = record("parallel_tool_calls")
    conv, _, ctx, sample = render(rec, llama4)
    got, toks = sample.input_ids.tolist(), llama4.tokenizer.convert_ids_to_tokens
    assert got == chat_format_tokens(llama4_format, rec)
    assert "}}{" not in toks(got) and toks(got).count('{"') == 5
    assert ctx.render_text(ctx.messages(conv), conv.tools).count(TOKEN_BREAK) == 5
    assert [t for _, _, t in trained_runs(sample, llama4.tokenizer)][:2] == [
        'Searching both.{"type": "function", "name": "search", "parameters": {"q": "grinder A"}}'
        '{"type": "function", "name": "search", "parameters": {"q": "grinder B"}}<|eom|>',
        '{"type": "function", "name": "click", "parameters": {"x": 1, "y": 2}}{"type": "function", "name": "click", '
        '"parameters": {"x": 3, "y": {"z": 4}}}{"type": "function", "name": "click", "parameters": {"x": 5, "y": 6}}<|eom|>',
    ]
    # Text holding the break would be dropped by the tokenizer: refused, in message text and in call arguments.
    from vlmprep.types import RecordError

    for where in ("content", "arguments"):
        bad = json.loads(json.dumps(rec))
        if where == "content":
            bad["messages"][-1]["content"] = "A" + TOKEN_BREAK + "B"
        else:
            bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps(
                {"q": TOKEN_BREAK}, ensure_ascii=False
            )
        with pytest.raises(RecordError) as e:
            render(bad, llama4)
        assert e.value.reason in ("sentinel_in_text", "special_token_in_text"), where


def test_llama_patterns_and_special_ids_are_llama_models(llama4, llama32):
    from llama_models.llama3.tokenizer import Tokenizer as Tokenizer3
    from llama_models.llama4.tokenizer import Tokenizer as Tokenizer4

    from vlmprep.processors.llama import LLAMA3_PATTERN, LLAMA4_PATTERN

    assert (LLAMA3_PATTERN, LLAMA4_PATTERN) == (Tokenizer3.pat_str, Tokenizer4.O200K_PATTERN)
    ref, tok = Tokenizer4.get_instance(), llama4.tokenizer
    assert len(tok) == ref.n_words == 202048
    assert {t: tok.convert_tokens_to_ids(t) for t in ref.special_tokens} == ref.special_tokens
    assert tok.encode("<|header_start|>", add_special_tokens=False) == [200005]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (200000, 200008, 200018)
    assert tok.encode("hi") == [200000, 5703]  # as the official tokenizer.json: encode() adds <|begin_of_text|>
    assert (llama4.image_token, llama4.start_of_img_token, llama4.end_of_img_token) == (
        "<|image|>",
        "<|image_start|>",
        "<|image_end|>",
    )


def test_llama4_hf_template_differs_from_chat_format_only_in_tools_and_system_parts(llama4, llama4_format):
    """The Hub template (vlmprep/templates/llama4.jinja, via --chat-template) against ChatFormat, pinned."""
    from vlmprep.processors.llama import read_template
    from vlmprep.types import RecordError

    hf = read_template("llama4.jinja")
    # Plain text and images: the same tokens (images expanded identically by the processor and ChatFormat).
    for name in ("system_images_cjk_emoji", "no_system_whitespace_big_image"):
        *_, s = render(record(name), llama4, chat_template=hf)
        assert s.input_ids.tolist() == chat_format_tokens(llama4_format, record(name)), name
    # A system message of several parts: the Hub template keeps the first part only (refused: text dropped).
    with pytest.raises(RecordError, match="drops this message's text"):
        render(record("multi_text_parts"), llama4, chat_template=hf)
    # Tool calls: the Hub template drops the turn's text (refused), prints the call inside empty python tags
    # without "type", the result as a JSON string, and closes both with <|eot|>; ChatFormat uses <|eom|>.
    with pytest.raises(RecordError, match="drops this message's text"):
        render(record("tool_calls"), llama4, chat_template=hf)
    msgs = [
        {"role": "user", "content": "Find it."},
        {
            "role": "assistant",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "click", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "tool_call_id": "x", "content": "ok"},
        {"role": "assistant", "content": "Done."},
    ]
    assert llama4.apply_chat_template(msgs, chat_template=hf, tokenize=False).endswith(
        '<|python_start|><|python_end|>{"name": "click", "parameters": {"x": 1}}<|eot|>'
        '<|header_start|>ipython<|header_end|>\n\n"ok"<|eot|><|header_start|>assistant<|header_end|>\n\nDone.<|eot|>'
    )
    for m in msgs[1:2]:
        m["tool_calls"][0]["function"]["arguments"] = json.dumps(m["tool_calls"][0]["function"]["arguments"])
    assert llama4.tokenizer.decode(chat_format_tokens(llama4_format, {"messages": msgs})).endswith(
        '<|header_end|>\n\n{"type": "function", "name": "click", "parameters": {"x": 1}}<|eom|>'
        "<|header_start|>ipython<|header_end|>\n\nok<|eom|><|header_start|>assistant<|header_end|>\n\nDone.<|eot|>"
    )


# ---- every vendor builtin: `vlmprep build --processor builtin:NAME` end to end ---------------------------------------

BUILDS = {  # builtin -> (processor class, default template, fixed conversations with 0 token differences)
    "mistral-3": ("PixtralProcessor", "mistral3_mistral_common.jinja", MISTRAL_PARITY),
    "llama-3.2-vision": ("MllamaProcessor", "llama3_2_vision_llama_models.jinja", LLAMA_PARITY),
    "llama-4": ("Llama4Processor", "llama4_llama_models.jinja", LLAMA_PARITY),
}


def vendor_tokens(request, name, rec):
    if name == "mistral-3":
        return mistral_tokens(request.getfixturevalue("mistral_reference"), rec)
    if name in LLAMAS:
        return chat_format_tokens(request.getfixturevalue(LLAMAS[name][1]), rec)
    raise AssertionError(name)


@pytest.mark.slow  # a `vlmprep build` subprocess per vendor; the fixed-set parity tests above run in make test
@pytest.mark.parametrize("name", list(BUILDS))
def test_cli_build_end_to_end_matches_the_vendor(request, name, tmp_path):
    from transformers import AutoProcessor
    from typer.testing import CliRunner

    from vlmprep.cli import app
    from vlmprep.tools.verify import verify_dataset

    cls, template, convs = BUILDS[name]
    inp = tmp_path / "records.jsonl"
    inp.write_text("".join(json.dumps(record(n)) + "\n" for n in convs))
    out = tmp_path / "shards"
    res = CliRunner().invoke(
        app,
        [
            "build",
            "--in",
            str(inp),
            "--out",
            str(out),
            "--processor",
            f"builtin:{name}",
            "--seq-len",
            "4096",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == len(convs) and not manifest["rejects"]
    assert manifest["processor"]["class"] == cls
    again = AutoProcessor.from_pretrained(str(out / "processor"), local_files_only=True)
    assert type(again).__name__ == cls
    assert again.chat_template == (Path(vlmprep.__file__).parent / "templates" / template).read_text(encoding="utf-8")
    stored = {s.meta()["id"]: s for s in iter_dataset(out)}
    for conv in convs:
        assert stored[conv].array("input_ids").tolist() == vendor_tokens(request, name, record(conv)), conv
    assert verify_dataset(out) == []


@pytest.mark.parametrize("name", list(BUILDS))
def test_builtin_matches_its_own_apply_chat_template(request, name):
    """P for the vendor builtins: render equals the processor's own apply_chat_template (PIL images in the parts)."""
    fixture = {"mistral-3": "mistral3", "llama-3.2-vision": "llama32", "llama-4": "llama4"}[name]
    processor = request.getfixturevalue(fixture)
    for conv_name in BUILDS[name][2]:
        conv, images, ctx, s = render(record(conv_name), processor)
        msgs, pil = ctx.messages(conv), iter([Image.open(io.BytesIO(im.source.data)) for im in images])
        for m in msgs:
            for part in m["content"] if isinstance(m["content"], list) else []:
                if part["type"] == "image":
                    part["image"] = next(pil)
        ref = processor.apply_chat_template(
            msgs,
            tools=conv.tools,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"return_mm_token_type_ids": True},
        )
        np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0].numpy(), err_msg=conv_name)
        mm = ref.get("mm_token_type_ids")
        if mm is not None:
            np.testing.assert_array_equal(s.mm_token_type_ids, mm[0].numpy(), err_msg=conv_name)


# ---- real agent trajectories (../shared/data/real_traces, beside the checkout in CI) --------------------------------

REAL_TRACES = Path(__file__).resolve().parents[4] / "shared" / "data" / "real_traces"


def real_records(name):
    """The real records of one source, image paths inlined as data URIs (both sides then read the same bytes)."""
    path = REAL_TRACES / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (the project's shared data sits beside the checkout)")

    def inline(part):
        if part.get("type") == "image_url":
            ref = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
            data = base64.b64encode((REAL_TRACES / ref).read_bytes()).decode()
            return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
        return part

    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for rec in recs:
        for m in rec["messages"]:
            if isinstance(m.get("content"), list):
                m["content"] = [inline(p) for p in m["content"]]
    return recs


@pytest.mark.slow  # 6 real trajectories of ~10 full-HD screenshots, tiled: ~30 s
def test_llama4_matches_chat_format_on_real_opencua_trajectories(llama4, llama4_format):
    """OpenCUA desktop-agent trajectories, several with two tool calls in one assistant turn (issue 22: 5 of 30
    such records differed before each call was encoded on its own)."""
    recs = real_records("opencua")
    parallel = sum(any(len(m.get("tool_calls") or []) > 1 for m in r["messages"]) for r in recs)
    assert parallel >= 2, "the fixture must hold turns with parallel tool calls"
    for rec in recs:
        *_, sample = render(rec, llama4)
        assert sample.input_ids.tolist() == chat_format_tokens(llama4_format, rec), rec["id"]
