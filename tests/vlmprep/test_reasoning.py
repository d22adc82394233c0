"""An assistant's reasoning_content (or `reasoning`): passed to the template as the model's own template reads it,
token parity with the processor's apply_chat_template, masks under --reasoning train|context, counted drops, rejects,
and templates that ignore reasoning (a reject or a counted drop, never silent)."""

import base64
import collections
import io
import json

import pytest
from PIL import Image

from tests.support.tiny_processors import load_family_processor
from tests.vlmprep.test_families import render, trained_runs
from vlmprep.config import BuildConfig
from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
from vlmprep.process import Renderer
from vlmprep.render.sample import MaskPolicy
from vlmprep.types import RawRecord, RecordError, Source

RED = Image.new("RGB", (56, 56), (200, 10, 10))
REASONING = "The square fills the image.\nIts pixels are (200, 10, 10): red."


def png_url(im=RED):
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def record(reasoning=REASONING, key="reasoning_content", earlier=None):
    """user (image + question) -> assistant [reasoning] -> user -> assistant with `reasoning` (after the last query)."""
    first = {"role": "assistant", "content": "Red."}
    if earlier is not None:
        first[key] = earlier
    last = {"role": "assistant", "content": "Yes, red."}
    if reasoning is not None:
        last[key] = reasoning
    return {
        "id": "r",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_url()}},
                    {"type": "text", "text": "What colour is it?"},
                ],
            },
            first,
            {"role": "user", "content": "Are you sure?"},
            last,
        ],
    }


def reference_ids(processor, rec, drop=False):
    """The processor's own apply_chat_template on the record's messages, written by hand (PIL image in the part,
    reasoning_content as the model's template reads it): independent of vlmprep's template_messages."""
    msgs = []
    for m in rec["messages"]:
        m = dict(m)
        if isinstance(m["content"], list):
            m["content"] = [{"type": "image", "image": RED} if p["type"] == "image_url" else p for p in m["content"]]
        r = m.pop("reasoning_content", None) or m.pop("reasoning", None)
        if r is not None and not drop:
            m["reasoning_content"] = r
        msgs.append(m)
    out = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="np")
    return out["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def qwen35():
    return load_family_processor("qwen3.5")


@pytest.fixture(scope="module")
def qwen3vl():
    return load_family_processor("qwen3-vl")


def runs(sample, processor):
    return [t for _, _, t in trained_runs(sample, processor.tokenizer)]


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_qwen35_reasoning_equals_apply_chat_template_and_is_trained(qwen35, key):
    rec = record(key=key)
    conv, _, ctx, s = render(rec, qwen35)
    assert conv.messages[3].reasoning == REASONING
    ids = s.input_ids.tolist()
    assert ids == reference_ids(qwen35, rec)
    without = render(record(reasoning=None), qwen35)[3]
    assert len(ids) > len(without.input_ids)  # not the empty think block of a no-thinking turn
    assert runs(s, qwen35) == ["Red.<|im_end|>", REASONING + "\n</think>\n\nYes, red.<|im_end|>"]
    assert s.reasoning_rendered == [3]


def test_qwen35_reasoning_context_renders_it_untrained(qwen35):
    rec = record()
    _, _, _, train = render(rec, qwen35)
    _, _, _, s = render(rec, qwen35, policy=MaskPolicy(reasoning="context"))
    assert s.input_ids.tolist() == train.input_ids.tolist() == reference_ids(qwen35, rec)
    assert runs(s, qwen35) == ["Red.<|im_end|>", "Yes, red.<|im_end|>"]
    # Every token of the reasoning is in the sample and has loss 0 (under train: loss 1).
    r_ids = qwen35.tokenizer(REASONING, add_special_tokens=False)["input_ids"]
    ids = s.input_ids.tolist()
    at = next(k for k in range(len(ids)) if ids[k : k + len(r_ids)] == r_ids)
    assert not s.loss_mask[at : at + len(r_ids)].any() and train.loss_mask[at : at + len(r_ids)].all()


def test_qwen35_reasoning_drop_renders_the_turn_without_it(qwen35):
    rec = record()
    _, _, _, s = render(rec, qwen35, policy=MaskPolicy(reasoning="drop"))
    assert (
        s.input_ids.tolist()
        == reference_ids(qwen35, rec, drop=True)
        == render(record(reasoning=None), qwen35)[3].input_ids.tolist()
    )
    assert REASONING not in qwen35.tokenizer.decode(s.input_ids.tolist())
    assert s.reasoning_rendered == []


def test_qwen35_reasoning_reject(qwen35):
    with pytest.raises(RecordError) as e:
        render(record(), qwen35, policy=MaskPolicy(reasoning="reject"))
    assert e.value.reason == "reasoning_refused" and "messages[3]" in e.value.message
    # A record without reasoning (an empty reasoning_content is none) is not refused.
    render(record(reasoning=""), qwen35, policy=MaskPolicy(reasoning="reject"))


def test_qwen35_reasoning_before_the_last_query_is_left_out_by_the_template(qwen35):
    """Qwen3.5 prints reasoning only for turns after the last user query: the earlier turn's reasoning is not in the
    processor's render, so not in the sample; that turn trains on its answer; the loss is counted, not rejected."""
    rec = record(earlier="First look: a red square.")
    _, _, _, s = render(rec, qwen35)
    assert s.input_ids.tolist() == reference_ids(qwen35, rec)
    assert "First look" not in qwen35.tokenizer.decode(s.input_ids.tolist())
    assert runs(s, qwen35) == ["Red.<|im_end|>", REASONING + "\n</think>\n\nYes, red.<|im_end|>"]
    assert s.reasoning_rendered == [3]


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen3-vl"])
def test_template_that_ignores_reasoning_rejects_or_drops_counted(request, name):
    """Qwen2-VL's and Qwen3-VL (Instruct)'s templates never print reasoning_content: train and context reject the
    record (reasoning_not_rendered), drop renders it without (what the template gives anyway)."""
    p = request.getfixturevalue({"qwen2-vl": "qwen2vl_processor", "qwen3-vl": "qwen3vl"}[name])
    for policy in ("train", "context"):
        with pytest.raises(RecordError) as e:
            render(record(), p, policy=MaskPolicy(reasoning=policy))
        assert e.value.reason == "reasoning_not_rendered" and "--reasoning drop" in e.value.message
    _, _, _, s = render(record(), p, policy=MaskPolicy(reasoning="drop"))
    assert s.input_ids.tolist() == reference_ids(p, record()) == reference_ids(p, record(), drop=True)
    assert runs(s, p)[-1] == "Yes, red.<|im_end|>"


def process(processor, rec, **cfg):
    renderer = Renderer(BuildConfig(inputs=("x.jsonl",), out="", progress=False, **cfg), processor)
    raw = RawRecord(source=Source("/tmp/x.jsonl", 1), position=0, text=json.dumps(rec).encode())
    outcomes, turns = renderer.process(raw)
    return [o[0] if o[0] == "ok" else o[1]["reason"] for o in outcomes], turns


def test_turn_counts_per_policy(qwen35, qwen2vl_processor):
    rec = record(earlier="First look: a red square.")
    want = {
        "train": (["ok"], 2, 0, 1),
        "context": (["ok"], 2, 0, 1),
        "drop": (["ok"], 2, 2, 0),
        "reject": (["reasoning_refused"], 2, 0, 0),
    }
    for policy, (outcome, n, dropped, not_rendered) in want.items():
        got, turns = process(qwen35, rec, reasoning=policy)
        turns = collections.Counter(turns)
        assert (
            got,
            turns["reasoning_turns"],
            turns["reasoning_turns_dropped"],
            turns["reasoning_turns_not_rendered"],
        ) == (outcome, n, dropped, not_rendered), policy
    got, turns = process(qwen2vl_processor, rec, reasoning="drop")
    assert got == ["ok"] and turns["reasoning_turns_dropped"] == 2


@pytest.mark.parametrize(
    "value,reason",
    [
        (["thinking..."], "invalid_reasoning"),
        ({"summary": [{"type": "summary_text", "text": "x"}]}, "invalid_reasoning"),
        ("\ud800", "invalid_unicode"),
    ],
)
def test_reasoning_must_be_a_string(value, reason):
    rec = record(reasoning=value)
    with pytest.raises(RecordError) as e:
        normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    assert e.value.reason == reason and "messages[3]" in e.value.message


def test_reasoning_fields_disagree_or_sit_on_a_user_turn():
    rec = record()
    rec["messages"][3]["reasoning"] = "something else"
    with pytest.raises(RecordError, match="differ"):
        normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    rec["messages"][3]["reasoning"] = REASONING  # the same text under both keys is one reasoning
    assert normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions()).messages[3].reasoning == REASONING
    rec = record()
    rec["messages"][2]["reasoning_content"] = "users do not think here"
    with pytest.raises(RecordError) as e:
        normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    assert e.value.reason == "invalid_reasoning" and "messages[2]" in e.value.message


def test_config_validates_reasoning():
    with pytest.raises(ValueError, match="reasoning='maybe'"):
        BuildConfig(inputs=("x",), out="o", reasoning="maybe")
    assert BuildConfig(inputs=("x",), out="o").to_json()["reasoning"] == "train"


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_build_counts_dropped_reasoning_in_manifest_and_summary(tmp_path, qwen2vl_processor):
    """Qwen2-VL's template ignores reasoning: --reasoning drop lands the records, counted in the manifest and said
    in the summary; a malformed reasoning is a counted reject."""
    from vlmprep.builder.pipeline import build
    from vlmprep.shards.manifest import Manifest
    from vlmprep.shards.summary import format_build_summary

    inp = tmp_path / "r.jsonl"
    recs = [
        dict(record(earlier="First look."), id="a"),
        dict(record(reasoning=None), id="b"),
        dict(record(reasoning=[1]), id="c"),
    ]
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "ds"
    build(
        BuildConfig(
            inputs=(str(inp),),
            out=str(out),
            progress=False,
            reasoning="drop",
            max_reject_fraction=1.0,
            min_turn_coverage=0.0,
        )
    )
    manifest = json.loads((out / "manifest.json").read_text())
    t = manifest["totals"]
    assert manifest["config"]["reasoning"] == "drop" and manifest["rejects"] == {"invalid_reasoning": 1}
    assert (t["samples"], t["reasoning_turns"], t["reasoning_turns_dropped"], t["reasoning_turns_not_rendered"]) == (
        2,
        2,
        2,
        0,
    )
    assert (
        "reasoning turns   2 (--reasoning drop; 2 dropped by it, 0 left out by the template)"
        in format_build_summary(Manifest.from_json(manifest), out)
    )


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_inspect_marks_trained_reasoning(tmp_path, qwen35):
    from typer.testing import CliRunner

    from vlmprep.cli import app

    inp = tmp_path / "r.jsonl"
    inp.write_text(json.dumps(record()) + "\n")
    env = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TTY_INTERACTIVE": None, "NO_COLOR": None}
    res = CliRunner().invoke(app, ["inspect", str(inp), "--processor", "builtin:qwen3.5", "--limit", "1"], env=env)
    assert res.exit_code == 0, res.output
    assert f"[T]{REASONING}\n</think>\n\nYes, red.<|im_end|>[/T]" in res.stdout


def test_qwen35_reasoning_before_a_tool_call(qwen35):
    """An agent step: reasoning, then only a tool call (no content). Same tokens as the processor; under context the
    call and <|im_end|> are trained, under train the reasoning too."""
    rec = {
        "id": "t",
        "messages": [
            {"role": "user", "content": "Open the cart."},
            {
                "role": "assistant",
                "reasoning_content": "The cart icon is top right.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"x": 1, "y": 2}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "opened"},
            {"role": "assistant", "reasoning_content": "It opened.", "content": "Done."},
        ],
    }
    msgs = json.loads(json.dumps(rec["messages"]))
    msgs[1]["tool_calls"][0]["function"]["arguments"] = {"x": 1, "y": 2}
    ref = qwen35.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="np")["input_ids"][0]
    call = "<tool_call>\n<function=click>\n<parameter=x>\n1\n</parameter>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>"
    want = {
        "train": ["The cart icon is top right.\n</think>\n\n" + call, "It opened.\n</think>\n\nDone.<|im_end|>"],
        "context": [call, "Done.<|im_end|>"],
    }
    for policy, trained in want.items():
        _, _, _, s = render(rec, qwen35, policy=MaskPolicy(reasoning=policy))
        assert s.input_ids.tolist() == ref.tolist() and runs(s, qwen35) == trained, policy
