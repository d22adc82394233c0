"""Render + mask: Conversation + prepared images -> RenderedSample, with the processor's real chat template.
Each message's text is located in the rendered string (sentinels, proven by rebuilding it; a per-slot fallback for
templates that trim or rewrite turns), mapped to tokens by offsets, and every trained span is decoded back as proof.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from vlmprep.processors.llama import TOKEN_BREAK
from vlmprep.config import ROLES, check_mask_policy
from vlmprep.families import FamilySpec, resolve_family
from vlmprep.positions import mrope_position_ids
from vlmprep.types import Conversation, Part, PreparedImage, PreparedVideo, RecordError, RenderedSample

_SENTINEL = "\ue000VLMPREP{}\ue001"
_SENTINEL_RE = re.compile("\ue000VLMPREP(\\d+)\ue001")


@dataclass(frozen=True, kw_only=True)
class MaskPolicy:
    """Which tokens get loss. Per-message `weight` (0|1) overrides the role rule; headers and template scaffolding
    outside a trained message's text are never trained."""

    train_on_roles: frozenset[str] = frozenset({"assistant"})
    train_on_eos: str = "turn"  # all: every turn's end token; turn: those of trained turns; last: the last one; none
    last_turn_only: bool = False
    tool_calls: str = "reject"  # an assistant turn whose tool_calls the template does not render
    reasoning: str = "train"  # an assistant's reasoning: train | context (rendered, loss 0) | drop | reject

    def __post_init__(self):
        bad = set(self.train_on_roles) - set(ROLES)
        if bad or not self.train_on_roles:
            raise ValueError(f"train_on_roles={sorted(self.train_on_roles)}: use a non-empty subset of {', '.join(ROLES)}")
        check_mask_policy(self.train_on_eos, self.tool_calls, self.reasoning)


# What RenderContext uses when a library caller passes no policy. It differs from the CLI's default in tool_calls:
# tool-call turns trained on their text and counted (the behaviour before policies existed); `vlmprep build` always
# passes its configured policy (default: reject).
LIBRARY_DEFAULT_POLICY = MaskPolicy(tool_calls="train-content")


@dataclass(frozen=True)
class Slot:
    """One text the template receives: a content text part, or an assistant's reasoning split off its <think>."""

    msg: int
    kind: str  # "text" | "reasoning"
    text: str


@dataclass
class _Located:
    slot: int
    start: int  # char span in the rendered string
    end: int


class RenderContext:
    """A loaded processor plus its family, template, policy and the ids render needs, computed once per process."""

    def __init__(self, processor, *, chat_template: str | None = None, policy: MaskPolicy | None = None,
                 role_boundaries: str | None = None):
        self.processor = processor
        self.family: FamilySpec = resolve_family(processor, role_boundaries)
        self.policy = policy or LIBRARY_DEFAULT_POLICY
        self.tokenizer = tok = processor.tokenizer
        self.chat_template = chat_template or processor.chat_template
        if not self.chat_template or not isinstance(self.chat_template, str):
            raise ValueError(f"processor {type(processor).__name__} has no single chat template: pass --chat-template FILE")
        self.image_token = getattr(processor, "image_token", None)
        if self.image_token is None:
            raise ValueError(f"processor {type(processor).__name__} declares no image_token; vlmprep cannot place images")
        self.eot_ids = {}
        for t in self.family.end_of_turn:
            i = tok.convert_tokens_to_ids(t)
            if i is None or i == tok.unk_token_id or tok.convert_ids_to_tokens(i) != t:
                raise ValueError(f"end-of-turn token {t!r} of family {self.family.name} is not one token of this tokenizer")
            self.eot_ids[i] = t
        self.wrap_open = {tok.convert_tokens_to_ids(t) for t in self.family.wrapper_open}
        self.wrap_close = {tok.convert_tokens_to_ids(t) for t in self.family.wrapper_close}
        self.reasoning = "reasoning_content" in self.chat_template
        # Whether the template prints an assistant's reasoning_content at all (on a last turn, where reasoning
        # templates keep it); one that never does makes reasoning a reject or a counted drop, never a silent loss.
        self.renders_reasoning = _renders_reasoning(processor, self.chat_template)
        # A turn with no content at all (a pure tool call) goes in as "" where the template accepts strings, so
        # content-truthiness branches render it as the model's own template would for content=None.
        self.empty_as_string = " is string" in self.chat_template
        self.parse_arguments = not _prints_string_arguments(processor, self.chat_template)
        specials = {t.content for t in tok.added_tokens_decoder.values() if t.special}
        self._special_re = _alternation(specials)
        # A tokenizer that splits at TOKEN_BREAK and drops it (the Llama builtins): the template's break between two
        # pieces its vendor encodes apart. It never decodes back, so the mask proof compares without it.
        self.token_break = TOKEN_BREAK if not tok(TOKEN_BREAK, add_special_tokens=False)["input_ids"] else None
        # Text must not contain any control or placeholder string, special-flagged or not.
        placeholders = {getattr(processor, a, None) for a in ("image_token", "video_token", "boi_token", "fake_image_token")}
        self._forbidden_re = _alternation(specials | {p for p in placeholders if isinstance(p, str) and p}
                                          | {self.token_break})
        merged = processor._merge_kwargs(tokenizer_init_kwargs=getattr(tok, "init_kwargs", {}))
        self._images_kwargs = {**merged.get("images_kwargs", {}), "return_tensors": "pt"}
        self._mm_needs_lengths = "batch_image_seq_lengths" in inspect.signature(processor.create_mm_token_type_ids).parameters

    def slots(self, conv: Conversation) -> list[Slot]:
        return message_slots(conv, reasoning=self.reasoning, string_content=self.family.string_content,
                             drop_reasoning=self.policy.reasoning == "drop")

    def messages(self, conv: Conversation, texts: list[str] | None = None) -> list[dict]:
        """HF chat-template messages for `conv`, exactly as render passes them (texts: replacement slot strings)."""
        return template_messages(conv, texts, reasoning=self.reasoning, string_content=self.family.string_content,
                                 empty_as_string=self.empty_as_string, parse_arguments=self.parse_arguments,
                                 drop_reasoning=self.policy.reasoning == "drop")

    def reasoning_messages(self, conv: Conversation) -> list[int]:
        """Messages that carry reasoning: a reasoning_content, or a <think> block the template splits off itself."""
        return [i for i, m in enumerate(conv.messages) if (_reasoning_of(m, self.reasoning)[0] or "").strip()]

    def render_text(self, messages: list[dict], tools: list | None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.processor.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False, **kwargs)

    def image_replacements(self, images: list[PreparedImage], rendered: str) -> list[str]:
        """The processor's own expansion of each image placeholder (replace_image_token), from the stored pixels."""
        p = self.processor
        if not images:
            return []
        if self.family.image_mode.startswith("smart_resize"):
            grids = np.array([im.grid_thw for im in images], dtype=np.int64)
            return [p.replace_image_token({"image_grid_thw": grids}, image_idx=i) for i in range(len(images))]
        from PIL import Image

        pils = [Image.fromarray(im.pixels, "RGB") for im in images]
        kwargs = dict(self._images_kwargs)
        if self.family.image_mode != "source":
            kwargs["do_resize"] = False  # stored pixels are already the processor's resize
        layout = p.prepare_inputs_layout(images=[pils], text=[rendered])  # one sample: multi-image rules apply
        _, replacements = p._process_images(layout[0], **kwargs)
        return [str(r) for r in replacements]

    def video_replacements(self, videos: list[PreparedVideo]) -> list[str]:
        """The processor's own expansion of each video placeholder (replace_video_token: Qwen3-VL's timestamp text
        included), from the stored frames' grid and timing."""
        from vlmprep.videos import video_metadata

        if not videos:
            return []
        inputs = {"video_grid_thw": np.array([v.grid_thw for v in videos], dtype=np.int64),
                  "video_metadata": [video_metadata(v) for v in videos]}
        return [self.processor.replace_video_token(inputs, video_idx=i) for i in range(len(videos))]

    def mm_token_types(self, ids: np.ndarray, image_token_lengths: list[int]) -> np.ndarray:
        p = self.processor
        if self._mm_needs_lengths:
            out = p.create_mm_token_type_ids([ids.tolist()], [image_token_lengths])[0]
        else:
            out = p.create_mm_token_type_ids([ids.tolist()])[0]
        return np.asarray(out, dtype=np.uint8)


def _prints_string_arguments(processor, chat_template: str) -> bool:
    """Whether the template prints tool-call arguments given as a JSON string verbatim (Qwen2/3-VL). Templates that
    walk the arguments' keys (Qwen3.5: `arguments|items`) fail on a string, and templates that serialize them
    (`tojson`: the Llama / Mistral vendor templates) would print it escaped, as a JSON string inside the JSON; both
    expect the object, so they get the parsed one."""
    probe = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}]}]
    try:
        rendered = processor.apply_chat_template(probe, chat_template=chat_template, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error on a string means it needs the object
        return False
    return '{"k": 1}' in rendered


def _renders_reasoning(processor, chat_template: str) -> bool:
    probe = [{"role": "user", "content": "q"},
             {"role": "assistant", "reasoning_content": _SENTINEL.format(0), "content": "a"}]
    try:
        rendered = processor.apply_chat_template(probe, chat_template=chat_template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe renders no reasoning we could prove
        return False
    return _SENTINEL.format(0) in rendered


def _alternation(strings) -> re.Pattern | None:
    strings = sorted((s for s in strings if s), key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in strings)) if strings else None


def _split_think(text: str) -> tuple[str, str]:
    # The exact split Qwen3 / Qwen3.5 templates apply to an assistant content holding "</think>".
    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, text.split("</think>")[-1].lstrip("\n")


def _reasoning_split_applies(m, reasoning: bool) -> bool:
    texts = [p for p in m.parts if p.type == "text"]
    return (reasoning and m.role == "assistant" and len(texts) == 1 and len(m.parts) == 1
            and "</think>" in texts[0].text)


def _reasoning_of(m, reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning, answer): a message's reasoning_content, or the <think> block a reasoning template splits off its
    content (answer: the content that is left); (None, None) when it has none."""
    if m.reasoning is not None:
        return m.reasoning, None
    if _reasoning_split_applies(m, reasoning):
        return _split_think(m.text)
    return None, None


def message_slots(conv: Conversation, *, reasoning: bool = False, string_content: bool = False,
                  drop_reasoning: bool = False) -> list[Slot]:
    """Every text the template receives, in template_messages order; each message has at least one slot."""
    slots = []
    for i, m in enumerate(conv.messages):
        r, answer = _reasoning_of(m, reasoning)
        if r is not None and not drop_reasoning:
            slots.append(Slot(i, "reasoning", r))
        if answer is not None:
            slots.append(Slot(i, "text", answer))
        elif string_content and not m.images and not m.videos:
            slots.append(Slot(i, "text", m.text))
        else:
            texts = [p.text for p in m.parts if p.type == "text"]
            slots += [Slot(i, "text", t) for t in (texts or [""])]
    return slots


def template_messages(conv: Conversation, texts: list[str] | None = None, *, reasoning: bool = False,
                      string_content: bool = False, empty_as_string: bool = False,
                      parse_arguments: bool = False, drop_reasoning: bool = False) -> list[dict]:
    """Conversation -> HF chat-template messages. With `texts`, the slots take those strings instead (sentinels).
    `reasoning`: an assistant "<think>R</think>A" goes in as reasoning_content=R, content=A, as reasoning templates
    split it themselves; `string_content`: text-only messages go in as one string (templates that print content);
    `empty_as_string`: a message without any part goes in as content "" instead of one empty text part;
    tool-call arguments go in as the record gave them (a string stays the exact string), or parsed where
    `parse_arguments` (templates that cannot take a string). A message's own reasoning goes in as reasoning_content
    (how reasoning templates read it); `drop_reasoning` leaves it out (and a split-off <think> block with it)."""
    slots = message_slots(conv, reasoning=reasoning, string_content=string_content, drop_reasoning=drop_reasoning)
    vals = iter(texts if texts is not None else [s.text for s in slots])
    out = []
    for i, m in enumerate(conv.messages):
        msg: dict = {"role": m.role}
        r, answer = _reasoning_of(m, reasoning)
        if r is not None and not drop_reasoning:
            msg["reasoning_content"] = next(vals)
        if answer is not None:
            msg["content"] = [{"type": "text", "text": next(vals)}]
        elif (string_content and not m.images and not m.videos) or (empty_as_string and not m.parts):
            msg["content"] = next(vals)
        else:
            content = []
            for p in m.parts:
                if p.type == "image":
                    content.append({"type": "image"})
                elif p.type == "video":
                    content.append({"type": "video"})
                else:
                    content.append({"type": "text", "text": next(vals)})
            if not any(p.type == "text" for p in m.parts):
                content.append({"type": "text", "text": next(vals)})
            msg["content"] = content
        if m.tool_calls:
            msg["tool_calls"] = [{"id": tc.id, "type": "function", "function": {
                "name": tc.name,
                "arguments": json.loads(tc.arguments) if parse_arguments and isinstance(tc.arguments, str) else tc.arguments}}
                for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def trained_messages(conv: Conversation, policy: MaskPolicy = LIBRARY_DEFAULT_POLICY) -> list[int]:
    """Indices of messages whose text is trained: the role rule, overridden by per-message weight, then last-turn."""
    idx = [i for i, m in enumerate(conv.messages)
           if m.weight == 1 or (m.weight is None and m.role in policy.train_on_roles)]
    return idx[-1:] if policy.last_turn_only else idx


def _check_no_special_tokens(conv: Conversation, ctx: RenderContext) -> None:
    if ctx._forbidden_re is None:
        return
    for i, m in enumerate(conv.messages):
        for s in [m.text, m.reasoning or ""] + [tc.arguments_json for tc in m.tool_calls] + [tc.name for tc in m.tool_calls]:
            hit = ctx._forbidden_re.search(s)
            if hit:
                raise RecordError("special_token_in_text",
                                  f"messages[{i}] ({m.role}) contains the control token {hit.group(0)!r} as text")


def _candidates(text: str) -> list[str]:
    # The rewrites templates apply to message text (jinja trim, Qwen's strip('\n'), mistral-common's rstrip(' ')),
    # most faithful first.
    out = []
    for c in (text, text.strip(), text.strip("\n"), text.lstrip(), text.rstrip(), text.lstrip("\n"), text.rstrip("\n"),
              text.rstrip(" ")):
        if c not in out:
            out.append(c)
    return out


def _locate(ctx: RenderContext, conv: Conversation, slots: list[Slot], rendered: str) -> list[_Located]:
    """Char span of every slot the template kept, proven either by rebuilding `rendered` from the sentinel rendering
    or, for templates that rewrite text (trim, think-stripping), slot by slot between identical scaffolding."""
    if any("\ue000VLMPREP" in s.text for s in slots):
        raise RecordError("sentinel_in_text", "text contains vlmprep's reserved sentinel marker")
    sentinel_text = ctx.render_text(ctx.messages(conv, [_SENTINEL.format(k) for k in range(len(slots))]), conv.tools)
    pieces = _SENTINEL_RE.split(sentinel_text)  # scaffold, id, scaffold, id, ..., scaffold
    order = [int(x) for x in pieces[1::2]]
    if order != sorted(set(order)):
        raise RecordError("template_not_verbatim", "the chat template repeats or reorders message text")
    for k in sorted(set(range(len(slots))) - set(order)):
        if slots[k].kind != "reasoning" and slots[k].text:
            raise RecordError("template_not_verbatim",
                              f"messages[{slots[k].msg}]: the chat template drops this message's text")
    located, pos, rebuilt = [], 0, []
    for k, scaffold in zip(order, pieces[0::2]):
        pos += len(scaffold)
        located.append(_Located(k, pos, pos + len(slots[k].text)))
        rebuilt += [scaffold, slots[k].text]
        pos += len(slots[k].text)
    rebuilt.append(pieces[-1])
    if "".join(rebuilt) == rendered:
        return located
    return _locate_by_segments(ctx, conv, slots, sentinel_text, rendered)


def _locate_by_segments(ctx, conv, slots, sentinel_text: str, rendered: str) -> list[_Located]:
    """Fallback: both renderings must share the same control-token skeleton; inside each plain segment the scaffold
    around a slot must match exactly and the slot must be a known rewrite of its text (see _candidates)."""
    split = ctx._special_re.split if ctx._special_re is not None else (lambda s: [s])
    specials = ctx._special_re.findall if ctx._special_re is not None else (lambda s: [])
    if specials(sentinel_text) != specials(rendered):
        raise RecordError("template_not_verbatim", "the chat template changes its control tokens with the message text")
    located, base = [], 0
    r_specials = specials(rendered)
    for j, (zseg, rseg) in enumerate(zip(split(sentinel_text), split(rendered))):
        parts = _SENTINEL_RE.split(zseg)
        scaffold, ks = parts[0::2], [int(k) for k in parts[1::2]]
        if not rseg.startswith(scaffold[0]):
            raise RecordError("template_not_verbatim", "the chat template rewrites scaffolding around message text")
        cur = len(scaffold[0])
        for n, k in enumerate(ks):
            nxt, last, slot = scaffold[n + 1], n == len(ks) - 1, slots[k]
            # After a turn's last text, tool-call rendering may depend on the text (e.g. only if non-empty).
            loose_tail = last and bool(conv.messages[slot.msg].tool_calls)
            found = None
            for cand in _candidates(slot.text):
                if not rseg.startswith(cand, cur):
                    continue
                after = cur + len(cand)
                if (rseg[after:] == nxt or loose_tail) if last else rseg.startswith(nxt, after):
                    found = cand
                    break
            if found is None:
                raise RecordError("template_not_verbatim",
                                  f"messages[{slot.msg}]: rendered text is not a known rewrite of the message text")
            located.append(_Located(k, base + cur, base + cur + len(found)))
            cur += len(found) + len(nxt)
        if not ks and zseg != rseg:
            raise RecordError("template_not_verbatim", "the chat template rewrites scaffolding between messages")
        base += len(rseg) + (len(r_specials[j]) if j < len(r_specials) else 0)
    return located


def _check_role_markers(ctx: RenderContext, conv: Conversation, slots, located, rendered: str) -> None:
    """--role-boundaries: each located slot must lie inside its role's region, from the nearest start marker of that
    role (with no other role's start after it) to that role's next end marker."""
    markers = ctx.family.role_markers
    starts = sorted((m.start(), m.end(), role) for role, (st, _) in markers.items()
                    for m in re.finditer(re.escape(st), rendered))
    for loc in located:
        role = conv.messages[slots[loc.slot].msg].role
        if role not in markers:
            continue
        before = [(a, b, r) for a, b, r in starts if b <= loc.start]
        end = rendered.find(markers[role][1], before[-1][1]) if before else -1
        if not before or before[-1][2] != role or end < loc.end:
            raise RecordError("role_boundary_mismatch",
                              f"messages[{slots[loc.slot].msg}] ({role}) text is not inside its declared "
                              f"{markers[role][0]!r}...{markers[role][1]!r} markers")


def _tool_calls_rendered(gap: str, tool_calls) -> bool:
    """Each call's name, and its arguments string verbatim or each argument key and value, appear in the text the
    template put after the turn."""
    cur = 0
    for tc in tool_calls:
        at = gap.find(tc.name, cur)
        if at < 0:
            return False
        if isinstance(tc.arguments, str) and gap.find(tc.arguments, at) >= 0:
            cur = at + len(tc.name)
            continue
        args = json.loads(tc.arguments_json)
        items = args.items() if isinstance(args, dict) else [("", args)]
        for k, v in items:
            if k and gap.find(k, at) < 0:
                return False
            forms = {json.dumps(v), json.dumps(v, ensure_ascii=False)}
            if not isinstance(v, (dict, list)):
                forms.add(str(v))
            if not any(gap.find(f, at) >= 0 for f in forms):
                return False
        cur = at + len(tc.name)
    return True


def render_conversation(conv: Conversation, ctx: RenderContext, images: list[PreparedImage],
                        videos: list[PreparedVideo] = ()) -> RenderedSample:
    _check_no_special_tokens(conv, ctx)
    if ctx.policy.reasoning == "reject":
        for i in ctx.reasoning_messages(conv):
            raise RecordError("reasoning_refused", f"messages[{i}]: this assistant turn carries reasoning and "
                                                   "--reasoning reject refuses it; pass --reasoning train|context|drop")
    slots = ctx.slots(conv)
    rendered = ctx.render_text(ctx.messages(conv), conv.tools)
    located = _locate(ctx, conv, slots, rendered)
    reasoning_rendered = sorted({slots[loc.slot].msg for loc in located
                                 if slots[loc.slot].kind == "reasoning" and slots[loc.slot].text.strip()})
    if not ctx.renders_reasoning:
        for slot in slots:
            if slot.kind == "reasoning" and slot.text.strip() and slot.msg not in reasoning_rendered:
                raise RecordError("reasoning_not_rendered",
                                  f"messages[{slot.msg}]: the chat template does not render reasoning_content; pass "
                                  "--reasoning drop to train without it (counted), or a --chat-template that renders it")
    if ctx.family.role_markers:
        _check_role_markers(ctx, conv, slots, located, rendered)

    expanded, offs = _expand_images(ctx, rendered, images, conv, videos)
    # Message text never holds a placeholder, so char positions only shift by each earlier expansion.
    rep_ends = [o["span"][1] for o in offs]
    rep_delta = np.cumsum([0] + [(o["new_span"][1] - o["new_span"][0]) - (o["span"][1] - o["span"][0]) for o in offs])

    def at(pos: int) -> int:
        return pos + int(rep_delta[bisect_right(rep_ends, pos)])

    bos = ctx.tokenizer.bos_token
    enc = ctx.tokenizer(expanded, add_special_tokens=not (bos and expanded.startswith(bos)), return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]

    image_spans, video_spans, lengths = [], [], []
    for o in offs:
        s, e = o["new_span"]
        covered = np.flatnonzero((ends > s) & (starts < e))
        if not len(covered):
            raise RecordError("image_wrapper_missing", f"an {o.get('type', 'image')} expansion produced no tokens")
        a, b = int(covered[0]), int(covered[-1]) + 1
        if o.get("type", "image") == "image":
            lengths.append(b - a)
        while a > 0 and ids[a - 1] in ctx.wrap_open:
            a -= 1
        while b < len(ids) and ids[b] in ctx.wrap_close:
            b += 1
        (video_spans if o.get("type") == "video" else image_spans).append((a, b))
    mm_types = ctx.mm_token_types(ids, lengths)
    in_image = np.zeros(len(ids), dtype=bool)
    for a, b in image_spans + video_spans:  # a video is one unit like an image: never trained, never cut
        in_image[a:b] = True
    if (mm_types.astype(bool) & ~in_image).any():
        raise RecordError("image_wrapper_missing", "image placeholder tokens outside any image's expansion")

    loss_mask, unrendered, turn_spans = _mask(conv, ctx, slots, located, rendered, expanded, at, ids, starts, ends)
    if (loss_mask.astype(bool) & in_image).any():
        raise RecordError("mask_verification_failed", "a trained token lies inside an image wrapper")

    grids = np.array([im.grid_thw for im in images], dtype=np.int32).reshape(-1, 3)
    video_grids = np.array([v.grid_thw for v in videos], dtype=np.int32).reshape(-1, 3)
    sgt = _second_per_grid_ts(ctx, videos)
    if ctx.family.positions == "mrope":
        runs = []
        for a, b in image_spans:
            run = np.flatnonzero(mm_types[a:b])
            runs.append((a + int(run[0]), a + int(run[-1]) + 1, tuple(grids[len(runs)]), 1))
        for k, (a, b) in enumerate(video_spans):
            runs += _video_runs(ctx, a, mm_types[a:b], video_grids[k], sgt[k])
        positions = mrope_position_ids(len(ids), [r[:2] for r in sorted(runs)],
                                       np.array([r[2] for r in sorted(runs)], dtype=np.int64).reshape(-1, 3),
                                       ctx.processor.image_processor.merge_size,
                                       intervals=[r[3] for r in sorted(runs)])
    else:
        positions = np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))).copy()

    return RenderedSample(
        id=conv.id, source=conv.source, input_ids=ids.astype(np.int32), loss_mask=loss_mask,
        mm_token_type_ids=mm_types, position_ids=positions, image_grid_thw=grids, images=list(images),
        image_spans=image_spans, video_grid_thw=video_grids, second_per_grid_ts=sgt, videos=list(videos),
        video_spans=video_spans, num_tokens_before_truncation=len(ids), unrendered_tool_calls=unrendered,
        turn_spans=turn_spans, reasoning_rendered=reasoning_rendered,
    )


def _second_per_grid_ts(ctx: RenderContext, videos: list[PreparedVideo]) -> np.ndarray:
    from vlmprep.videos import second_per_grid_t

    # float32: what the processor's list becomes as a tensor, and what Qwen2.5-VL's get_rope_index multiplies
    return np.array([second_per_grid_t(v, ctx.processor.video_processor) for v in videos], dtype=np.float32)


def _video_runs(ctx: RenderContext, start: int, types: np.ndarray, grid, sgt) -> list[tuple]:
    """(start, end, grid, temporal interval) of each placeholder run of one video, as get_rope_index groups them:
    Qwen2/2.5-VL one run of t x h x w (2.5: temporal ids spaced tokens_per_second * second_per_grid_t); Qwen3-VL
    one run per temporal patch, split by its timestamp text."""
    idx = np.flatnonzero(types == 2)
    breaks = np.flatnonzero(np.diff(idx) > 1)
    bounds = list(zip(np.r_[idx[:1], idx[breaks + 1]], np.r_[idx[breaks], idx[-1:]] + 1))
    t, h, w = (int(x) for x in grid)
    family = ctx.family
    if family.video == "qwen3":
        if len(bounds) != t:
            raise RecordError("image_wrapper_missing", f"a video of {t} temporal patches expanded to {len(bounds)} runs")
        return [(start + int(a), start + int(b), (1, h, w), 1) for a, b in bounds]
    if len(bounds) != 1:
        raise RecordError("image_wrapper_missing", f"a video expanded to {len(bounds)} placeholder runs, expected 1")
    interval = np.float32(family.tokens_per_second) * np.float32(sgt) if family.video == "qwen2.5" else 1
    return [(start + int(bounds[0][0]), start + int(bounds[0][1]), (t, h, w), interval)]


def count_tokens(conv: Conversation, ctx: RenderContext, images: list[PreparedImage],
                 videos: list[PreparedVideo] = ()) -> int:
    """The length render_conversation would give, without locating text or proving masks (for planning splits)."""
    expanded, _ = _expand_images(ctx, ctx.render_text(ctx.messages(conv), conv.tools), images, conv, videos)
    bos = ctx.tokenizer.bos_token
    return len(ctx.tokenizer(expanded, add_special_tokens=not (bos and expanded.startswith(bos)))["input_ids"])


def _expand_images(ctx: RenderContext, rendered: str, images: list[PreparedImage],
                   conv: Conversation | None = None, videos: list[PreparedVideo] = ()) -> tuple[str, list[dict]]:
    """The rendered text with each image and video placeholder replaced by the processor's own expansion, and the
    offsets."""
    n_placeholders = len(re.findall(re.escape(ctx.image_token), rendered))
    if n_placeholders != len(images):
        what = f"template emitted {n_placeholders} image placeholders for {len(images)} images"
        raise RecordError("image_count_mismatch", _dropped_images(ctx, conv, n_placeholders, what) or what)
    video_token = getattr(ctx.processor, "video_token", None)
    n_videos = len(re.findall(re.escape(video_token), rendered)) if video_token and videos else 0
    if n_videos != len(videos):
        raise RecordError("video_count_mismatch", f"template emitted {n_videos} video placeholders for {len(videos)} "
                                                  "videos; move each video to a user message")
    replacements = ctx.image_replacements(images, rendered)
    expanded, offs = ctx.processor.get_text_with_replacements([rendered], images_replacements=replacements,
                                                              videos_replacements=ctx.video_replacements(list(videos)))
    return expanded[0], (offs[0] if offs else [])


def _dropped_images(ctx: RenderContext, conv: Conversation | None, n_placeholders: int, what: str) -> str | None:
    """Names the first message whose images the template does not print (rendering without them keeps as many
    placeholders), so the message points at the fix; None when no single message explains the mismatch."""
    for i, m in enumerate(conv.messages if conv is not None else []):
        if not m.images:
            continue
        parts = [p for p in m.parts if p.type != "image"] or [Part(type="text", text="")]
        probe = dataclasses.replace(conv, messages=[*conv.messages[:i], dataclasses.replace(m, parts=parts),
                                                    *conv.messages[i + 1:]])
        try:
            n = len(re.findall(re.escape(ctx.image_token), ctx.render_text(ctx.messages(probe), conv.tools)))
        except Exception:  # noqa: BLE001 - a diagnosis only; the mismatch is reported either way
            continue
        if n_placeholders - n < len(m.images):
            return (f"messages[{i}] ({m.role}): the chat template drops images in {m.role} messages ({what}); "
                    f"move the image to a user message, or pass a --chat-template that renders it")
    return None


@dataclass
class _Interval:
    """A trained char span of the expanded text, what it must decode to, and the end-of-turn right after it."""

    start: int
    end: int
    eot: bool = False
    msg: int = -1
    expected: str = field(default="")


def _mask(conv, ctx: RenderContext, slots, located, rendered, expanded, at, ids, starts, ends):
    policy = ctx.policy
    by_msg: dict[int, list[_Located]] = {}
    for loc in sorted(located, key=lambda x: x.start):
        by_msg.setdefault(slots[loc.slot].msg, []).append(loc)
    special = ctx._special_re

    def next_special(pos: int, skip: tuple[str, ...] = ()) -> int:
        while True:
            m = special.search(rendered, pos) if special is not None else None
            if m is None or m.group() not in skip:
                return m.start() if m else len(rendered)
            pos = m.end()  # a control token the model generates as part of the turn (Mistral's [TOOL_CALLS])

    # Where each message's body ends in `rendered`: its last text, plus tool calls or whitespace the template
    # prints before the next control token (the model must generate those too).
    body_end, unrendered_msgs = {}, set()
    for i, locs in by_msg.items():
        e = locs[-1].end
        m = conv.messages[i]
        gap = rendered[e:next_special(e, ctx.family.tool_call_tokens if m.tool_calls else ())]
        if m.tool_calls:
            if _tool_calls_rendered(gap, m.tool_calls):
                e += len(gap)
            else:
                unrendered_msgs.add(i)
        elif not gap.strip():
            e += len(gap)
        body_end[i] = e
    for i, m in enumerate(conv.messages):
        if m.role == "assistant" and m.tool_calls and i not in by_msg:
            unrendered_msgs.add(i)

    trained = []
    for i in trained_messages(conv, policy):
        if i in unrendered_msgs:
            if policy.tool_calls == "reject":
                raise RecordError("tool_calls_not_rendered",
                                  f"messages[{i}]: the chat template does not render this turn's tool_calls; pass a "
                                  "tool-aware --chat-template, or --tool-calls drop-from-loss")
            if policy.tool_calls == "drop-from-loss":
                continue
        if i in by_msg:
            trained.append(i)

    intervals: list[_Interval] = []
    for i in trained:
        locs = by_msg[i]
        if policy.reasoning == "context":  # the reasoning is context: training starts at the text after it
            kept = [loc for loc in locs if slots[loc.slot].kind != "reasoning"]
            locs = kept or [_Located(-1, locs[-1].end, locs[-1].end)]
        run = _Interval(locs[0].start, locs[0].end, msg=i)
        for loc in locs[1:]:
            between = rendered[run.end:loc.start]
            if special is not None and special.search(between):
                intervals.append(run)  # an image or other control token splits the turn: never train it
                run = _Interval(loc.start, loc.end, msg=i)
            else:
                run.end = loc.end  # plain template text inside one turn (e.g. "</think>"): the model generates it
        run.end = body_end[i]
        intervals.append(run)

    eos_for = set()
    if policy.train_on_eos == "turn":
        eos_for = set(trained)
    elif policy.train_on_eos == "last" and trained:
        eos_for = {trained[-1]}
    elif policy.train_on_eos == "all":
        eos_for = set(by_msg)

    mask = np.zeros(len(ids), dtype=bool)
    proofs: list[tuple[np.ndarray, str]] = []
    turn_tokens: dict[int, list[int]] = {}
    for iv in intervals:
        s, e = at(iv.start), at(iv.end)
        straddle = np.flatnonzero((starts < s) & (ends > s))
        if len(straddle):
            t0 = int(starts[straddle[0]])
            if expanded[t0:s].strip():
                raise RecordError("mask_boundary_misaligned",
                                  f"messages[{iv.msg}]: a token crosses the start of the message text")
            s = t0  # a header's trailing space merged into the first token: generated by the model, so trained
        if ((starts < e) & (ends > e)).any():
            raise RecordError("mask_boundary_misaligned", f"messages[{iv.msg}]: a token crosses the end of the message text")
        sel = (starts >= s) & (ends <= e) & (ends > starts)
        mask |= sel
        proofs.append((sel, expanded[s:e].replace(ctx.token_break, "") if ctx.token_break else expanded[s:e]))
        hit = np.flatnonzero(sel)
        if len(hit):
            turn_tokens.setdefault(iv.msg, []).extend([int(hit[0]), int(hit[-1]) + 1])
    # End-of-turn tokens: for a trained turn the one starting exactly where its body ends; with "all", for any
    # other message the first one before the next message's text.
    last_interval_of = {iv.msg: iv for iv in intervals}
    msg_starts = sorted((at(locs[0].start), i) for i, locs in by_msg.items())
    is_eot = np.isin(ids, list(ctx.eot_ids))
    for i in sorted(eos_for):
        e = at(last_interval_of[i].end if i in last_interval_of else body_end[i])
        limit = next((s for s, j in msg_starts if j > i), len(expanded))
        hit = np.flatnonzero((starts == e) & is_eot) if i in last_interval_of else []
        if not len(hit) and (i not in last_interval_of or conv.messages[i].role != "assistant"):
            hit = np.flatnonzero((starts >= e) & (starts < limit) & is_eot)  # e.g. after a trailing image
        if len(hit):
            k = int(hit[0])
            mask[k] = True
            if i in turn_tokens:  # a trained turn ends with its end-of-turn: cut before it, it is not trained
                turn_tokens[i].extend([k, k + 1])
            one = np.zeros(len(ids), dtype=bool)
            one[k] = True
            proofs.append((one, ctx.eot_ids[int(ids[k])]))
        elif i in last_interval_of and conv.messages[i].role == "assistant" and expanded[e:].strip():
            raise RecordError("end_of_turn_not_found",
                              f"messages[{i}]: no {'/'.join(ctx.family.end_of_turn)} right after the turn, so the "
                              "model could not learn to stop; check the template or --role-boundaries")
    # Proof: every trained span decodes back to exactly the rendered text it covers.
    for sel, want in proofs:
        got = ctx.tokenizer.decode(ids[sel].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if got != want:
            raise RecordError("mask_verification_failed", f"trained span decodes to {got[:60]!r}, expected {want[:60]!r}")
    if not mask.any():
        raise RecordError("no_trainable_tokens", "no token of this record is trained")
    spans = sorted((i, min(t), max(t)) for i, t in turn_tokens.items())
    return mask.astype(np.uint8), len(unrendered_msgs), spans
