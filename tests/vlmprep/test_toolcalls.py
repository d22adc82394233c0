"""Agent traces whose assistant turns act through tool_calls: rejected by default where the template cannot render
them (Qwen2-VL), trained with the call JSON under a tool-aware --chat-template, dropped from the loss on request,
and trained natively where the template renders tool calls (Qwen3-VL)."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.tiny_processors import load_family_processor
from tests.vlmprep.test_families import png, render, trained_runs
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.render.sample import MaskPolicy
from vlmprep.types import RecordError

TOOLS_TEMPLATE = Path(__file__).parents[2] / "vlmprep" / "templates" / "qwen2_vl_tools.jinja"
TRACE = {
    "id": "agent",
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "click",
                "description": "Click at a point.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
            },
        }
    ],
    "messages": [
        {"role": "system", "content": "You are a browser agent."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Find the price."},
                {"type": "image_url", "image_url": png(56, 56, (200, 10, 10))},
            ],
        },
        {
            "role": "assistant",
            "content": "I will search.",
            "tool_calls": [
                {
                    "id": "call_0001",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"query": "espresso grinder"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_0001",
            "content": [
                {"type": "text", "text": "Results shown."},
                {"type": "image_url", "image_url": png(112, 56, (0, 90, 0))},
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_0002", "type": "function", "function": {"name": "click", "arguments": {"x": 12, "y": 30}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_0002", "content": "Clicked."},
        {"role": "assistant", "content": "The grinder costs $500."},
    ],
}

SEARCH = 'I will search.\n<tool_call>\n{"name": "search", "arguments": {"query": "espresso grinder"}}\n</tool_call><|im_end|>'
CLICK = '<tool_call>\n{"name": "click", "arguments": {"x": 12, "y": 30}}\n</tool_call><|im_end|>'
ANSWER = "The grinder costs $500.<|im_end|>"


def online_ids(processor, ctx, conv, images):
    msgs = ctx.messages(conv)
    pil = iter([Image.open(io.BytesIO(im.source.data)) for im in images])
    for m in msgs:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image":
                    part["image"] = next(pil)
    out = processor.apply_chat_template(
        msgs, chat_template=ctx.chat_template, tools=conv.tools, tokenize=True, return_dict=True, return_tensors="np"
    )
    return out["input_ids"][0]


def test_rejected_by_default_on_qwen2_vl():
    with pytest.raises(RecordError) as e:
        render(TRACE, load_family_processor("qwen2-vl"))
    assert e.value.reason == "tool_calls_not_rendered" and "messages[2]" in e.value.message


def test_tool_aware_template_trains_the_call_json():
    p = load_family_processor("qwen2-vl")
    conv, images, ctx, s = render(TRACE, p, chat_template=TOOLS_TEMPLATE.read_text())
    assert s.unrendered_tool_calls == 0
    assert trained_runs(s, p.tokenizer) == [(171, 201, SEARCH), (223, 255, CLICK), (266, 275, ANSWER)]
    np.testing.assert_array_equal(s.input_ids, online_ids(p, ctx, conv, images))
    # For records without tools or tool calls the tool-aware template renders exactly like the official one.
    plain = {"messages": [m for m in TRACE["messages"][:2]] + [{"role": "assistant", "content": "Sure."}]}
    official = render(plain, p)[3]
    assert np.array_equal(official.input_ids, render(plain, p, chat_template=TOOLS_TEMPLATE.read_text())[3].input_ids)


def test_drop_from_loss_keeps_the_record_but_masks_those_turns():
    p = load_family_processor("qwen2-vl")
    conv, images, ctx, s = render(TRACE, p, MaskPolicy(tool_calls="drop-from-loss"))
    assert s.unrendered_tool_calls == 2
    assert [r[2] for r in trained_runs(s, p.tokenizer)] == [ANSWER]


def test_qwen3_vl_renders_tool_calls_natively():
    p = load_family_processor("qwen3-vl")
    conv, images, ctx, s = render(TRACE, p)
    assert s.unrendered_tool_calls == 0
    assert trained_runs(s, p.tokenizer) == [(222, 247, SEARCH), (337, 364, CLICK), (378, 387, ANSWER)]
    np.testing.assert_array_equal(s.input_ids, online_ids(p, ctx, conv, images))


def test_a_template_that_drops_the_arguments_is_not_trusted():
    lossy = TOOLS_TEMPLATE.read_text().replace(
        "{% if tool_call['arguments'] is string %}{{ tool_call['arguments'] }}{% else %}{{ tool_call['arguments'] | tojson }}{% endif %}",
        "{}",
    )
    assert lossy != TOOLS_TEMPLATE.read_text()
    with pytest.raises(RecordError) as e:
        render(TRACE, load_family_processor("qwen2-vl"), chat_template=lossy)
    assert e.value.reason == "tool_calls_not_rendered"


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_build_rejects_then_trains_with_the_chat_template_flag(tmp_path):
    inp = tmp_path / "trace.jsonl"
    inp.write_text(json.dumps(TRACE) + "\n")

    def run(out, **kw):
        return build(BuildConfig(inputs=(str(inp),), out=str(tmp_path / out), progress=False, **kw)).manifest

    assert run("default", allow_empty=True).rejects == {"tool_calls_not_rendered": 1}
    m = run("tools", chat_template=str(TOOLS_TEMPLATE))
    assert m.totals["samples"] == 1 and m.config["chat_template"] == str(TOOLS_TEMPLATE)
    # The dataset carries the template that rendered it.
    assert (tmp_path / "tools" / "processor" / "chat_template.jinja").read_text() == TOOLS_TEMPLATE.read_text()
    m = run("drop", tool_calls="drop-from-loss")
    assert m.totals["samples"] == 1 and m.totals["unrendered_tool_call_turns"] == 2


# Arguments as the user wrote them: number forms, duplicate keys, escapes and spacing a re-serialization would change.
RAW_ARGS = [
    '{"q":"cats","n":1e5}',
    '{"a": 1, "a": 2, "s": "caf\\u00e9\\n\\"x\\""}',
    '{ "nested" : {"k" : [1.50, true]} }',
]


def verbatim_record(arguments):
    return {
        "id": "verbatim",
        "messages": [
            {"role": "user", "content": "Search for cats."},
            {
                "role": "assistant",
                "content": "Searching.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": a}}
                    for a in arguments
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "3 results."},
            {"role": "assistant", "content": "Found them."},
        ],
    }


def record_ids(processor, rec, chat_template=None):
    """apply_chat_template on the user's own record (its messages as given: no vlmprep conversion)."""
    kw = {"chat_template": chat_template} if chat_template else {}
    return np.asarray(
        processor.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, **kw)["input_ids"]
    ).reshape(-1)


@pytest.fixture(scope="module")
def qwen3vl():
    from vlmprep.processors.load import load_processor

    return load_processor("builtin:qwen3-vl")


@pytest.mark.parametrize("form", ["string", "object"])
def test_qwen3_vl_arguments_render_exactly_as_the_template_does_on_the_record(form, qwen3vl):
    args = RAW_ARGS if form == "string" else [json.loads(a) for a in RAW_ARGS]
    rec = verbatim_record(args)
    conv, _, ctx, s = render(rec, qwen3vl)
    np.testing.assert_array_equal(s.input_ids, record_ids(qwen3vl, rec))
    trained = "".join(r[2] for r in trained_runs(s, qwen3vl.tokenizer))
    for a in args:
        printed = a if form == "string" else json.dumps(a, ensure_ascii=False)
        assert f'"arguments": {printed}}}' in trained
    if form == "string":
        assert '{"q":"cats","n":1e5}' in trained and "100000.0" not in trained


def test_qwen2_vl_tools_template_prints_the_string_verbatim(qwen2vl_processor):
    tmpl = TOOLS_TEMPLATE.read_text()
    rec = verbatim_record(RAW_ARGS)
    conv, _, ctx, s = render(rec, qwen2vl_processor, chat_template=tmpl)
    np.testing.assert_array_equal(s.input_ids, record_ids(qwen2vl_processor, rec, tmpl))
    trained = "".join(r[2] for r in trained_runs(s, qwen2vl_processor.tokenizer))
    assert all(a in trained for a in RAW_ARGS)


def test_a_template_that_walks_argument_keys_gets_the_parsed_object(qwen3vl):
    # Qwen3.5's template iterates `arguments|items`: apply_chat_template fails on the string, so vlmprep passes the
    # object. (Its template on the Qwen3-VL processor: same mechanism, without loading a third vocabulary.)
    tmpl = (TOOLS_TEMPLATE.parent / "qwen3_5.jinja").read_text()
    rec = verbatim_record(['{"q": "cats", "n": 2}'])
    with pytest.raises(TypeError, match="mapping"):
        record_ids(qwen3vl, rec, tmpl)
    conv, _, ctx, s = render(rec, qwen3vl, chat_template=tmpl)
    assert ctx.parse_arguments and not render(rec, qwen3vl)[2].parse_arguments
    parsed = json.loads(json.dumps(rec))
    parsed["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"q": "cats", "n": 2}
    np.testing.assert_array_equal(s.input_ids, record_ids(qwen3vl, parsed, tmpl))
    assert "<parameter=q>\ncats\n</parameter>" in "".join(r[2] for r in trained_runs(s, qwen3vl.tokenizer))


def test_legacy_function_call_and_refusal_match_the_template_on_todays_format(qwen3vl):
    from tests.vlmprep.test_normalize import LEGACY, MODERN

    conv, _, ctx, s = render(LEGACY, qwen3vl)
    np.testing.assert_array_equal(s.input_ids, record_ids(qwen3vl, MODERN))
    assert '"arguments": {"city":"Paris"}}' in "".join(r[2] for r in trained_runs(s, qwen3vl.tokenizer))
    refusal = {
        "messages": [
            {"role": "user", "content": "Do a bad thing."},
            {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        ]
    }
    conv, _, ctx, s = render(refusal, qwen3vl)
    as_content = {"messages": [refusal["messages"][0], {"role": "assistant", "content": "I can't help with that."}]}
    np.testing.assert_array_equal(s.input_ids, record_ids(qwen3vl, as_content))
    assert [r[2] for r in trained_runs(s, qwen3vl.tokenizer)] == ["I can't help with that.<|im_end|>"]


def test_nulls_inside_arguments_and_tools_are_values(qwen3vl):
    # Null fields of the record are absent (Arrow schema unification), but inside an arguments object or a tool
    # spec the template prints them: kept, so the ids equal apply_chat_template on the record.
    rec = verbatim_record([{"q": "cats", "page": None}])
    rec["tools"] = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": None,
                "parameters": {"type": "object", "properties": {"q": {"type": "string", "default": None}}},
            },
        }
    ]
    conv, _, ctx, s = render(rec, qwen3vl)
    kw = {"tools": rec["tools"]}
    ref = qwen3vl.apply_chat_template(rec["messages"], tokenize=True, return_dict=True, **kw)["input_ids"]
    np.testing.assert_array_equal(s.input_ids, np.asarray(ref).reshape(-1))
    assert '"page": null' in "".join(r[2] for r in trained_runs(s, qwen3vl.tokenizer))
