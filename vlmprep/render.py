"""Render + mask: Conversation + prepared images -> RenderedSample, with the processor's real chat template.
The mask comes from where each message's text lands in the rendered string (found with sentinels and
re-verified), mapped to tokens by the tokenizer's offsets, then proven by decoding the trained spans.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from vlmprep.positions import mrope_position_ids
from vlmprep.types import Conversation, PreparedImage, RecordError, RenderedSample

_SENTINEL = "\ue000VLMPREP{}\ue001"
_SENTINEL_RE = re.compile("\ue000VLMPREP(\\d+)\ue001")


@dataclass(frozen=True)
class FamilySpec:
    """What render and truncate must know about a model family's placeholder and turn scheme."""

    name: str
    image_token: str
    vision_start: str
    vision_end: str
    end_of_turn: str


FAMILIES = {
    "Qwen2VLProcessor": FamilySpec("qwen2-vl", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>"),
    "Qwen2_5_VLProcessor": FamilySpec("qwen2.5-vl", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>"),
}


class RenderContext:
    """A loaded processor plus the ids and patterns render needs, computed once per process."""

    def __init__(self, processor, *, chat_template: str | None = None):
        cls = type(processor).__name__
        if cls not in FAMILIES:
            raise ValueError(f"processor class {cls} is not supported yet (supported: {', '.join(sorted(FAMILIES))})")
        self.processor = processor
        self.family = FAMILIES[cls]
        self.tokenizer = processor.tokenizer
        self.chat_template = chat_template or processor.chat_template
        if not self.chat_template:
            raise ValueError(f"processor {cls} has no chat template: pass --chat-template FILE")
        tok = self.tokenizer
        self.image_token_id = tok.convert_tokens_to_ids(self.family.image_token)
        self.vision_start_id = tok.convert_tokens_to_ids(self.family.vision_start)
        self.vision_end_id = tok.convert_tokens_to_ids(self.family.vision_end)
        self.eot_id = tok.convert_tokens_to_ids(self.family.end_of_turn)
        self.merge_size = processor.image_processor.merge_size
        specials = sorted({t.content for t in tok.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in specials)) if specials else None

    def render_text(self, messages: list[dict], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.processor.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False, **kwargs)


def template_messages(conv: Conversation, texts: list[str] | None = None) -> list[dict]:
    """Conversation -> HF chat-template messages. With `texts`, text parts take those strings instead
    (sentinels); every message gets at least one text part so even an empty turn can be located."""
    out = []
    k = 0
    for m in conv.messages:
        content = []
        has_text = False
        for p in m.parts:
            if p.type == "image":
                content.append({"type": "image"})
            else:
                content.append({"type": "text", "text": p.text if texts is None else texts[k]})
                k += 1
                has_text = True
        if not has_text:
            content.append({"type": "text", "text": "" if texts is None else texts[k]})
            k += 1
        msg: dict = {"role": m.role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                  "function": {"name": tc.name, "arguments": json.loads(tc.arguments)}}
                                 for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _text_slots(conv: Conversation) -> list[tuple[int, str]]:
    """(message index, text) for each text slot template_messages emits, in order."""
    slots = []
    for i, m in enumerate(conv.messages):
        texts = [p.text for p in m.parts if p.type == "text"]
        slots.extend((i, t) for t in (texts or [""]))
    return slots


def _check_no_special_tokens(conv: Conversation, ctx: RenderContext) -> None:
    if ctx._special_re is None:
        return
    for i, m in enumerate(conv.messages):
        for s in [m.text] + [tc.arguments for tc in m.tool_calls]:
            hit = ctx._special_re.search(s)
            if hit:
                raise RecordError("special_token_in_text",
                                  f"messages[{i}] ({m.role}) contains the control token {hit.group(0)!r} as text")


def _locate_slots(ctx: RenderContext, conv: Conversation, rendered: str) -> list[tuple[int, int, int]]:
    """Char span of every text slot in `rendered`: (message index, start, end), proven by reconstruction."""
    slots = _text_slots(conv)
    if any("\ue000VLMPREP" in t for _, t in slots):
        raise RecordError("sentinel_in_text", "text contains vlmprep's reserved sentinel marker")
    sentinel_text = ctx.render_text(template_messages(conv, [_SENTINEL.format(k) for k in range(len(slots))]), conv.tools)
    pieces = _SENTINEL_RE.split(sentinel_text)  # scaffold, id, scaffold, id, ..., scaffold
    order = [int(x) for x in pieces[1::2]]
    if sorted(order) != list(range(len(slots))) or order != sorted(order):
        raise RecordError("template_not_verbatim",
                          "the chat template drops, repeats or reorders message text; masks cannot be proven")
    spans = []
    pos = 0
    rebuilt = []
    for k, scaffold in zip(order, pieces[0::2]):
        rebuilt.append(scaffold)
        pos += len(scaffold)
        text = slots[k][1]
        spans.append((slots[k][0], pos, pos + len(text)))
        rebuilt.append(text)
        pos += len(text)
    rebuilt.append(pieces[-1])
    if "".join(rebuilt) != rendered:
        raise RecordError("template_not_verbatim",
                          "the chat template rewrites message text; masks cannot be proven")
    return spans


def render_conversation(conv: Conversation, ctx: RenderContext, images: list[PreparedImage]) -> RenderedSample:
    _check_no_special_tokens(conv, ctx)
    rendered = ctx.render_text(template_messages(conv), conv.tools)
    spans = _locate_slots(ctx, conv, rendered)

    enc = ctx.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    # Expand each single image placeholder to its token count: the pad is a special token, so the
    # tokenizer splits around it and repeating its id equals tokenizing the expanded text.
    pad_idx = np.flatnonzero(ids == ctx.image_token_id)
    if len(pad_idx) != len(images):
        raise RecordError("image_count_mismatch",
                          f"template emitted {len(pad_idx)} image placeholders for {len(images)} images")
    grids = np.array([im.grid_thw for im in images], dtype=np.int32).reshape(-1, 3)
    per_image = grids.prod(axis=1) // (ctx.merge_size ** 2)
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[pad_idx] = per_image
    ids = np.repeat(ids, repeats)
    offsets = np.repeat(offsets, repeats, axis=0)
    run_starts = np.cumsum(np.concatenate([[0], repeats[:-1]]))[pad_idx]
    image_runs = [(int(s), int(s + n)) for s, n in zip(run_starts, per_image)]

    image_spans = []
    for s, e in image_runs:
        if s < 1 or e >= len(ids) or ids[s - 1] != ctx.vision_start_id or ids[e] != ctx.vision_end_id:
            raise RecordError("image_wrapper_missing", "an image placeholder run is not wrapped in vision start/end tokens")
        image_spans.append((s - 1, e + 1))

    loss_mask = _mask_from_spans(conv, ctx, ids, offsets, spans, rendered)
    mm_types = (ids == ctx.image_token_id).astype(np.uint8)
    positions = mrope_position_ids(len(ids), image_runs, grids, ctx.merge_size)

    unrendered = 0
    for i, m in enumerate(conv.messages):
        if m.role == "assistant" and m.tool_calls:
            end = max(e for mi, _, e in spans if mi == i)
            nxt = min((s for mi, s, _ in spans if mi > i), default=len(rendered))
            if not all(tc.name in rendered[end:nxt] for tc in m.tool_calls):
                unrendered += 1

    return RenderedSample(
        id=conv.id, source=conv.source, input_ids=ids.astype(np.int32), loss_mask=loss_mask,
        mm_token_type_ids=mm_types, position_ids=positions, image_grid_thw=grids, images=list(images),
        image_spans=image_spans, num_tokens_before_truncation=len(ids), unrendered_tool_calls=unrendered,
    )


def trained_messages(conv: Conversation) -> list[int]:
    """Indices of messages whose content is trained: assistant turns, or per-message weight when given."""
    return [i for i, m in enumerate(conv.messages) if (m.weight == 1) or (m.weight is None and m.role == "assistant")]


def _mask_from_spans(conv, ctx: RenderContext, ids, offsets, spans, rendered: str) -> np.ndarray:
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    expected: list[tuple[np.ndarray, str]] = []
    for i in trained_messages(conv):
        msg_spans = [(s, e) for mi, s, e in spans if mi == i]
        s0, e1 = msg_spans[0][0], msg_spans[-1][1]
        if any(b[0] != a[1] for a, b in zip(msg_spans, msg_spans[1:])):
            raise RecordError("template_not_verbatim", f"messages[{i}]: template inserts text inside the message")
        straddle = ((starts < s0) & (ends > s0)) | ((starts < e1) & (ends > e1))
        if straddle.any():
            raise RecordError("mask_boundary_misaligned",
                              f"messages[{i}]: a token crosses the boundary of the message text")
        sel = (starts >= s0) & (ends <= e1) & (ends > starts)
        eot = np.flatnonzero((starts == e1) & (ids == ctx.eot_id))
        if len(eot):
            sel[eot[0]] = True
        mask |= sel
        expected.append((sel, rendered[s0:e1] + (ctx.family.end_of_turn if len(eot) else "")))
    # Proof: each trained span decodes back to exactly its message text plus end-of-turn.
    for sel, want in expected:
        got = ctx.tokenizer.decode(ids[sel].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if got != want:
            raise RecordError("mask_verification_failed", f"trained span decodes to {got[:60]!r}, expected {want[:60]!r}")
    if not mask.any():
        raise RecordError("no_trainable_tokens", "no token of this record is trained")
    return mask.astype(np.uint8)
