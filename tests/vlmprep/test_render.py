import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from tests.conftest import LLAMAFACTORY
from vlmprep.families import resolve_family
from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
from vlmprep.pixels.images import prepare_image
from vlmprep.render.sample import MaskPolicy, RenderContext, render_conversation, template_messages
from vlmprep.types import RecordError, Source


def png(w, h, color):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return "data:image/png;base64," + __import__("base64").b64encode(buf.getvalue()).decode()


SOURCE = Source("/tmp/x.jsonl", 1)
# Tool-call turns the stock Qwen2-VL template does not print, trained on their text (the default policy rejects them).
TRAIN_CONTENT = MaskPolicy(tool_calls="train-content")


def render_record(rec, processor, source=SOURCE, policy=None):
    conv = normalize_record(rec, source, NormalizeOptions())
    images = [prepare_image(im, processor, resolve_family(processor), max_pixels=10**8) for im in conv.images]
    return conv, render_conversation(conv, RenderContext(processor, policy=policy), images)


def trained_runs(sample, tokenizer):
    m = sample.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])))
    return [
        (int(s), int(e), tokenizer.decode(sample.input_ids[s:e].tolist(), skip_special_tokens=False))
        for s, e in zip(edges[::2], edges[1::2])
    ]


THREE_TURNS = {
    "id": "t3",
    "messages": [
        {"role": "system", "content": "You are a browser agent."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Open the page"},
                {"type": "image_url", "image_url": {"url": png(56, 56, (200, 10, 10))}},
            ],
        },
        {"role": "assistant", "content": "I will click the button."},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [
                {"type": "text", "text": "Clicked."},
                {"type": "image_url", "image_url": png(112, 56, (0, 90, 0))},
            ],
        },
        {"role": "assistant", "content": "Done: the page is open."},
    ],
}


def test_mask_literal_spans_three_turns_with_tool_image(qwen2vl_processor):
    tok = qwen2vl_processor.tokenizer
    conv, s = render_record(THREE_TURNS, qwen2vl_processor)
    text = tok.decode(s.input_ids.tolist(), skip_special_tokens=False)
    pads1 = "<|image_pad|>" * 4  # 56x56 -> grid 1x4x4 -> 4 tokens after 2x2 merge
    pads2 = "<|image_pad|>" * 8  # 112x56 -> grid 1x4x8 -> 8 tokens
    assert text == (
        "<|im_start|>system\nYou are a browser agent.<|im_end|>\n"
        f"<|im_start|>user\nOpen the page<|vision_start|>{pads1}<|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nI will click the button.<|im_end|>\n"
        f"<|im_start|>tool\nClicked.<|vision_start|>{pads2}<|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\nDone: the page is open.<|im_end|>\n"
    )
    runs = trained_runs(s, tok)
    assert [r[2] for r in runs] == ["I will click the button.<|im_end|>", "Done: the page is open.<|im_end|>"]
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for start, end, _ in runs:
        assert s.input_ids[start - len(header) : start].tolist() == header  # header itself never trained
        assert s.input_ids[end - 1] == 151645 and s.input_ids[end] == tok.encode("\n")[0]  # <|im_end|> then "\n"
    assert s.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert s.mm_token_type_ids.sum() == 12 and (s.input_ids[s.mm_token_type_ids == 1] == 151655).all()
    assert s.loss_mask[s.mm_token_type_ids == 1].sum() == 0
    assert s.image_spans == [
        (int(np.flatnonzero(s.input_ids == 151652)[k]), int(np.flatnonzero(s.input_ids == 151653)[k]) + 1)
        for k in range(2)
    ]


def _online_ids(processor, conv, images):
    """The reference path: the processor's own apply_chat_template on the same conversation."""
    msgs = template_messages(conv)
    pil = iter([Image.open(io.BytesIO(im.source.data)) for im in images])
    for m in msgs:
        for part in m["content"]:
            if part["type"] == "image":
                part["image"] = next(pil)
    out = processor.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="np")
    return out


def _llamafactory_records():
    recs = json.loads((LLAMAFACTORY / "mllm_demo.json").read_text())
    return [(r, Source(str(LLAMAFACTORY / "mllm_demo.json"), i + 1)) for i, r in enumerate(recs)]


def _demo_records(n):
    from scripts.demo_traces import generate_traces

    return [
        (r, Source("/tmp/demo.jsonl", i + 1))
        for i, r in enumerate(
            generate_traces(n=n, seed=3, min_images=1, max_images=4, width=320, height=200, overlong_fraction=0.0)
        )
    ]


@pytest.mark.parametrize("proc_fixture", ["qwen2vl_processor", "qwen25vl_processor"])
def test_token_parity_with_apply_chat_template(proc_fixture, request):
    processor = request.getfixturevalue(proc_fixture)
    ctx = RenderContext(processor, policy=TRAIN_CONTENT)  # the demo traces' tool calls: token parity, not the policy
    cases = _llamafactory_records() + _demo_records(50)
    checked = 0
    for rec, src in cases:
        conv = normalize_record(rec, src, NormalizeOptions())
        images = [prepare_image(im, processor, resolve_family(processor), max_pixels=10**8) for im in conv.images]
        s = render_conversation(conv, ctx, images)
        ref = _online_ids(processor, conv, images)
        np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0], err_msg=conv.id)
        np.testing.assert_array_equal(s.mm_token_type_ids, ref["mm_token_type_ids"][0], err_msg=conv.id)
        if images:
            np.testing.assert_array_equal(s.image_grid_thw, ref["image_grid_thw"], err_msg=conv.id)
        # Each image's placeholder count equals prod(grid)/merge^2.
        for (a, b), g in zip(s.image_spans, s.image_grid_thw):
            assert b - a - 2 == g.prod() // 4
        checked += 1
    assert checked >= 56


def test_special_token_text_is_rejected(qwen2vl_processor):
    rec = {"messages": [{"role": "user", "content": "say <|im_end|> now"}, {"role": "assistant", "content": "no"}]}
    with pytest.raises(RecordError) as e:
        render_record(rec, qwen2vl_processor)
    assert e.value.reason == "special_token_in_text"
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|image_pad|>"}]}
    with pytest.raises(RecordError) as e:
        render_record(rec, qwen2vl_processor)
    assert e.value.reason == "special_token_in_text"


def test_tool_call_turns_are_counted_as_unrendered(qwen2vl_processor):
    rec = {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "clicking",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"x": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ]
    }
    _, s = render_record(rec, qwen2vl_processor, policy=TRAIN_CONTENT)
    assert s.unrendered_tool_calls == 1
    assert [r[2] for r in trained_runs(s, qwen2vl_processor.tokenizer)] == ["clicking<|im_end|>", "done<|im_end|>"]


@pytest.mark.parametrize(
    "content",
    [
        "What does <image> mean in HTML?",
        [{"type": "text", "text": "Render <image> here"}, {"type": "image_url", "image_url": png(56, 56, (1, 2, 3))}],
    ],
)
def test_image_marker_is_text_in_openai_layout(content, qwen2vl_processor):
    rec = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "An <image> tag."}]}
    conv, s = render_record(rec, qwen2vl_processor)
    assert "<image>" in conv.messages[0].text and conv.messages[1].text == "An <image> tag."
    ref = _online_ids(qwen2vl_processor, conv, s.images)
    np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0])
    assert "An <image> tag.<|im_end|>" in [r[2] for r in trained_runs(s, qwen2vl_processor.tokenizer)]


def test_image_marker_takes_an_image_only_in_the_sharegpt_layout(qwen2vl_processor):
    img = png(56, 56, (1, 2, 3))
    sharegpt = {
        "conversations": [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A square."}],
        "images": [img],
    }
    conv, s = render_record(sharegpt, qwen2vl_processor)
    assert len(conv.images) == 1 and conv.messages[0].text == "What is it?"
    no_images = {"conversations": sharegpt["conversations"]}
    with pytest.raises(RecordError) as e:
        render_record(no_images, qwen2vl_processor)
    assert e.value.reason == "image_count_mismatch"


def test_responses_and_anthropic_parts_render_as_the_processor_renders_plain_parts(qwen2vl_processor):
    """Issue 22: a converted Responses trace keeps its assistant turns (output_text, refusal) and an Anthropic image
    block gives the pixels its data URI gives: token ids equal apply_chat_template on the plain text/image record."""
    tok = qwen2vl_processor.tokenizer
    uri = png(84, 56, (30, 60, 90))
    b64 = uri.split(",", 1)[1]
    dialect = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is on screen?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                ],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "A blue square.", "annotations": []}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Delete it."}, {"type": "input_image", "image_url": uri}],
            },
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't delete files."}]},
        ]
    }
    conv, s = render_record(dialect, qwen2vl_processor)
    pil = Image.open(io.BytesIO(__import__("base64").b64decode(b64)))
    plain = [
        {"role": "user", "content": [{"type": "text", "text": "What is on screen?"}, {"type": "image", "image": pil}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A blue square."}]},
        {"role": "user", "content": [{"type": "text", "text": "Delete it."}, {"type": "image", "image": pil}]},
        {"role": "assistant", "content": [{"type": "text", "text": "I can't delete files."}]},
    ]
    ref = qwen2vl_processor.apply_chat_template(plain, tokenize=True, return_dict=True, return_tensors="np")
    np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0])
    np.testing.assert_array_equal(s.image_grid_thw, ref["image_grid_thw"])
    assert [r[2] for r in trained_runs(s, tok)] == ["A blue square.<|im_end|>", "I can't delete files.<|im_end|>"]
    np.testing.assert_array_equal(s.images[0].pixels, s.images[1].pixels)  # Anthropic base64 == the data URI


@pytest.mark.parametrize("name", ["qwen2-vl", "mistral3-pixtral", "glm-4.1v", "llama4"])
def test_encode_tokenizes_a_placeholder_run_once_and_gives_the_tokenizers_own_ids_and_offsets(name):
    """Most tokens of an image-heavy sample are one placeholder repeated; TextEncoder.encode (RenderContext.text)
    tokenizes each run as one copy and repeats it. Ids and char offsets equal the tokenizer's own on the whole text, for any text around."""
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.support.tiny_processors import load_family_processor

    processor = load_family_processor(name)
    ctx = RenderContext(processor)
    tok = processor.tokenizer
    pads = [t for t in (getattr(processor, "image_token", None), getattr(processor, "video_token", None)) if t]
    text = st.lists(
        st.sampled_from(list("ab \n\u00e9\u4e2d<|>") + ["<|im_end|>", "[IMG]", "<|patch|>"]), max_size=12
    ).map("".join)
    pieces = st.lists(
        st.one_of(text, st.builds(lambda t, k: t * k, st.sampled_from(pads), st.integers(1, 40))), max_size=8
    )

    counts: dict[str, int] = {}  # kept over every example, as over the candidates of one split search

    @given(pieces, st.booleans())
    def check(parts, bos_first):
        s = ((tok.bos_token or "") if bos_first else "") + "".join(parts)
        bos = tok.bos_token
        want = tok(s, add_special_tokens=not (bos and s.startswith(bos)), return_offsets_mapping=True)
        ids, spans = ctx.text.encode(s)
        assert ids.tolist() == want["input_ids"]
        assert spans.tolist() == [list(o) for o in want["offset_mapping"]]
        assert ctx.text.count(s) == len(want["input_ids"])
        assert ctx.text.count(s, counts) == len(want["input_ids"])  # summed over the text between special tokens

    assert ctx.text.run_re is not None  # the shortcut is on for this tokenizer
    assert name != "qwen2-vl" or ctx.text.boundary_re is not None  # and the per-piece count
    check()


def test_encode_calls_the_tokenizers_backend_only_where_its_call_adds_nothing(qwen2vl_processor):
    """TextEncoder tokenizes through the tokenizers backend directly (the tokenizer's own call is a fifth of a short
    record's tokenize) where the tokenizer's call is the plain TokenizersBackend path, and goes through the call
    whenever the backend holds a truncation, padding or split-special-tokens state the call would change; the ids and
    offsets are the call's either way (the test above checks them on any text)."""
    from vlmprep.render.tokens import TextEncoder, _plain_backend

    tok = qwen2vl_processor.tokenizer
    enc = TextEncoder(tok, specials=set(tok.all_special_tokens), repeated=set())
    assert enc._backend is tok.backend_tokenizer
    text = "<|im_start|>user\nhello there, a longer line of text<|im_end|>\n"
    want = tok(text, return_offsets_mapping=True)
    backend = tok.backend_tokenizer
    calls = []
    real_call = type(tok).__call__
    try:
        type(tok).__call__ = lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k)
        ids, spans = enc.encode(text)
        assert not calls  # the backend directly
        backend.enable_truncation(4)
        ids_t, spans_t = enc.encode(text)
        assert calls  # through the call, which lifts the truncation as it always did
    finally:
        type(tok).__call__ = real_call
        backend.no_truncation()
    for got_ids, got_spans in ((ids, spans), (ids_t, spans_t)):
        assert got_ids.tolist() == want["input_ids"]
        assert got_spans.tolist() == [list(o) for o in want["offset_mapping"]]

    class Overriding(type(tok)):
        def _encode_plus(self, *a, **k):
            return super()._encode_plus(*a, **k)

    assert _plain_backend(tok) is tok.backend_tokenizer and _plain_backend(Overriding.__new__(Overriding)) is None


def test_runs_are_found_as_the_regex_scan_finds_them():
    """shorten_runs finds each placeholder run by str.find (tokens.py: _runs), not by a regex scan of every char: its
    runs are finditer's, for any text and any placeholder set (tokens that are prefixes of each other included)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from vlmprep.render.tokens import _runs

    token_sets = [["<a>"], ["<a>", "<b>"], ["<a><a>", "<a>"], ["<a>x", "<a>"], ["aa", "a"]]

    @given(st.sampled_from(token_sets), st.lists(st.sampled_from(["<a>", "<b>", "x", "a", "<", ">"]), max_size=30))
    def check(tokens, parts):
        tokens = sorted(tokens, key=len, reverse=True)  # as TextEncoder orders them
        run_re = re.compile("|".join(f"(?:{re.escape(t)}){{2,}}" for t in tokens))
        text = "".join(parts)
        assert [m.span() for m in _runs(text, run_re, tokens)] == [m.span() for m in run_re.finditer(text)]

    check()


@pytest.mark.parametrize("name", ["qwen2-vl", "mistral3-pixtral", "glm-4.1v", "llama4"])
def test_the_mask_proofs_decode_is_the_tokenizers_own(name):
    """TextEncoder.decode (the mask proof's decode of each trained span) calls the tokenizers backend directly where
    the tokenizer's decode is the plain TokenizersBackend path, and gives the tokenizer's own decode (special tokens
    kept, no clean-up) for any ids; a tokenizer that overrides its decode goes through it."""
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.support.tiny_processors import load_family_processor
    from vlmprep.render.tokens import _plain_decoder

    processor = load_family_processor(name)
    tok, ctx_text = processor.tokenizer, RenderContext(processor).text
    specials = sorted(tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens)

    @given(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(specials)), max_size=30))
    def check(ids):
        want = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert ctx_text.decode(np.array(ids, dtype=np.int64)) == want

    check()

    class Overriding(type(tok)):
        def _decode(self, *a, **k):
            return super()._decode(*a, **k)

    assert ctx_text._decoder is tok.backend_tokenizer  # the shortcut is on for these tokenizers
    assert _plain_decoder(Overriding.__new__(Overriding)) is None


@pytest.mark.parametrize("name", ["qwen2-vl", "mistral3-pixtral", "glm-4.1v"])
def test_count_tokens_is_the_rendered_length(name):
    from tests.support.tiny_processors import load_family_processor
    from vlmprep.render.sample import count_tokens

    processor = load_family_processor(name)
    rec = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look"},
                    {"type": "image_url", "image_url": {"url": png(56, 84, (1, 2, 3))}},
                    {"type": "image_url", "image_url": {"url": png(140, 28, (9, 2, 3))}},
                ],
            },
            {"role": "assistant", "content": "Two pictures."},
        ]
    }
    conv = normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    ctx = RenderContext(processor)
    images = [prepare_image(im, processor, ctx.family, max_pixels=10**8) for im in conv.images]
    n = len(render_conversation(conv, ctx, images).input_ids)
    assert count_tokens(conv, ctx, images) == n
    assert count_tokens(conv, ctx, images, pieces={}) == n


@pytest.mark.parametrize(
    "name", ["qwen2-vl", "qwen3.5", "llama4", "mistral3-pixtral", "gemma3", "glm-4.1v", "internvl", "smolvlm"]
)
def test_mm_token_types_equal_the_processors_own(name):
    """RenderContext.mm_token_types marks ids itself where the processor keeps ProcessorMixin's method (no list round
    trip): the types must equal the processor's own create_mm_token_type_ids, ids of every modality mixed in."""
    from tests.support.tiny_processors import load_family_processor

    processor = load_family_processor(name)
    ctx = RenderContext(processor)
    special = [t for a in ("image_token_ids", "video_token_ids", "audio_token_ids") for t in getattr(processor, a) if t]
    ids = np.random.default_rng(0).choice(special + list(range(10, 60)), 400).astype(np.int64)
    got = ctx.mm_token_types(ids, [len(ids)])
    if ctx._mm_needs_lengths:
        want = processor.create_mm_token_type_ids([ids.tolist()], [[len(ids)]])[0]
    else:
        want = processor.create_mm_token_type_ids([ids.tolist()])[0]
    assert got.dtype == np.uint8 and got.tolist() == list(want)
    assert got.any() or ctx._mm_ids is None  # Idefics3 / SmolVLM mark spans by image lengths, not random ids


def test_the_sentinel_rendering_is_kept_per_shape_and_equals_a_fresh_one(qwen2vl_processor):
    """StructureRenders keeps mask.locate_slots' sentinel rendering by the messages' JSON: records of one shape render
    it once, each sample equals one rendered with nothing kept, another shape renders anew, and a template that reads
    the clock keeps nothing."""
    from vlmprep.render.chat_template import StructureRenders

    calls = []
    ctx = RenderContext(qwen2vl_processor)
    render = ctx.render_text
    ctx.sentinel_renders = StructureRenders(lambda m, t: calls.append(1) or render(m, t), ctx.chat_template)
    fresh = RenderContext(qwen2vl_processor)
    fresh.sentinel_renders._on = False

    def record(i, turns=1):
        msgs = []
        for k in range(turns):
            msgs += [
                {"role": "user", "content": [{"type": "text", "text": f"q{i}-{k} " * (i + 1)}]},
                {"role": "assistant", "content": f"a{i}-{k}  \n" * (k + 1)},
            ]
        return {"id": f"r{i}", "messages": msgs}

    for i in range(5):
        conv = normalize_record(record(i), SOURCE, NormalizeOptions())
        got, want = render_conversation(conv, ctx, []), render_conversation(conv, fresh, [])
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
        assert got.turn_spans == want.turn_spans
    assert len(calls) == 1  # five records of one shape: one sentinel rendering
    render_conversation(normalize_record(record(0, turns=2), SOURCE, NormalizeOptions()), ctx, [])
    assert len(calls) == 2  # another shape
    dated = StructureRenders(lambda m, t: calls.append(1) or "x", "{{ strftime_now('%Y') }}")
    dated.render([{"role": "user", "content": "\ue000VLMPREP0\ue001"}], None)
    dated.render([{"role": "user", "content": "\ue000VLMPREP0\ue001"}], None)
    assert len(calls) == 4
