"""Render: Conversation + prepared images and videos -> RenderedSample, with the processor's real chat template:
the rendered text, each image and video expanded as the processor does, token ids, mm token types and positions;
the loss mask comes from the mask stage (mask.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from bisect import bisect_right
from typing import Callable

import numpy as np

from vlmprep.families import FamilySpec, resolve_family
from vlmprep.processors.llama import TOKEN_BREAK
from vlmprep.render.chat_template import (
    Slot,
    StructureRenders,
    image_drop_fix,
    message_slots,
    prints_string_arguments,
    reasoning_of,
    renders_reasoning,
    template_messages,
)
from vlmprep.render.mask import (
    Located,
    MaskInputs,
    MaskPolicy,
    check_role_markers,
    compute_mask,
    locate_slots,
    trained_messages,
)
from vlmprep.render.positions import sample_position_ids
from vlmprep.render.tokens import TextEncoder, alternation, shorten_runs
from vlmprep.types import Conversation, Part, PreparedImage, PreparedVideo, RecordError, RenderedSample

__all__ = [
    "MaskPolicy",
    "RenderContext",
    "count_tokens",
    "render_conversation",
    "template_messages",
    "trained_messages",
]  # re-exported for callers of render: MaskPolicy, trained_messages from mask.py,
# template_messages from chat_template.py


class RenderContext:
    """A loaded processor plus its family, template, policy and the ids render needs, computed once per process.
    Without a policy it renders as `vlmprep build` does by default (MaskPolicy(): --tool-calls reject included)."""

    def __init__(
        self,
        processor,
        *,
        chat_template: str | None = None,
        policy: MaskPolicy | None = None,
        role_boundaries: str | None = None,
    ):
        self.processor = processor
        self.family: FamilySpec = resolve_family(processor, role_boundaries)
        self.policy = policy or MaskPolicy()  # no policy: `vlmprep build`'s default one
        self.tokenizer = tok = processor.tokenizer
        self.chat_template = chat_template or processor.chat_template
        if not self.chat_template or not isinstance(self.chat_template, str):
            raise ValueError(
                f"processor {type(processor).__name__} has no single chat template: pass --chat-template FILE"
            )
        self.image_token = getattr(processor, "image_token", None)
        if self.image_token is None:
            raise ValueError(
                f"processor {type(processor).__name__} declares no image_token; vlmprep cannot place images"
            )
        self.eot_ids = {}
        for t in self.family.end_of_turn:
            i = tok.convert_tokens_to_ids(t)
            if i is None or i == tok.unk_token_id or tok.convert_ids_to_tokens(i) != t:
                raise ValueError(
                    f"end-of-turn token {t!r} of family {self.family.name} is not one token of this tokenizer"
                )
            self.eot_ids[i] = t
        self.wrap_open = {tok.convert_tokens_to_ids(t) for t in self.family.wrapper_open}
        self.wrap_close = {tok.convert_tokens_to_ids(t) for t in self.family.wrapper_close}
        self.reasoning = "reasoning_content" in self.chat_template
        # Whether the template prints an assistant's reasoning_content at all (on a last turn, where reasoning
        # templates keep it); one that never does makes reasoning a reject or a counted drop, never a silent loss.
        self.renders_reasoning = renders_reasoning(processor, self.chat_template)
        # A turn with no content at all (a pure tool call) goes in as "" where the template accepts strings, so
        # content-truthiness branches render it as the model's own template would for content=None.
        self.empty_as_string = " is string" in self.chat_template
        self.parse_arguments = not prints_string_arguments(processor, self.chat_template)
        self.sentinel_renders = StructureRenders(self.render_text, self.chat_template)
        specials = {t.content for t in tok.added_tokens_decoder.values() if t.special}
        self._special_re = alternation(specials)
        # Placeholders the processor repeats (an image's <|image_pad|> x N, most of an agent trace's tokens): encoded
        # one copy a run, then repeated (tokens.py).
        repeated = {getattr(processor, a, None) for a in ("image_token", "video_token")} & specials
        self.text = TextEncoder(tok, specials=specials, repeated=repeated)
        # A tokenizer that splits at TOKEN_BREAK and drops it (the Llama builtins): the template's break between two
        # pieces its vendor encodes apart. It never decodes back, so the mask proof compares without it.
        self.token_break = TOKEN_BREAK if not tok(TOKEN_BREAK, add_special_tokens=False)["input_ids"] else None
        # Text must not contain any control or placeholder string, special-flagged or not.
        placeholders = {
            getattr(processor, a, None) for a in ("image_token", "video_token", "boi_token", "fake_image_token")
        }
        self._forbidden_re = alternation(
            specials | {p for p in placeholders if isinstance(p, str) and p} | {self.token_break}
        )
        merged = processor._merge_kwargs(tokenizer_init_kwargs=getattr(tok, "init_kwargs", {}))
        self._images_kwargs = {**merged.get("images_kwargs", {}), "return_tensors": "pt"}
        mm_params = inspect.signature(processor.create_mm_token_type_ids).parameters
        self._mm_needs_lengths = "batch_image_seq_lengths" in mm_params
        self._mm_ids = _mm_type_ids(processor)

    def slots(self, conv: Conversation) -> list[Slot]:
        """The conversation's text slots (message text, tool calls, reasoning) in the order the template prints them."""
        return message_slots(
            conv,
            reasoning=self.reasoning,
            string_content=self.family.string_content,
            drop_reasoning=self.policy.reasoning == "drop",
        )

    def messages(self, conv: Conversation, texts: list[str] | None = None) -> list[dict]:
        """HF chat-template messages for `conv`, exactly as render passes them (texts: replacement slot strings)."""
        return template_messages(
            conv,
            texts,
            reasoning=self.reasoning,
            string_content=self.family.string_content,
            empty_as_string=self.empty_as_string,
            parse_arguments=self.parse_arguments,
            drop_reasoning=self.policy.reasoning == "drop",
        )

    def reasoning_messages(self, conv: Conversation) -> list[int]:
        """Messages that carry reasoning: a reasoning_content, or a <think> block the template splits off itself."""
        return [i for i, m in enumerate(conv.messages) if (reasoning_of(m, self.reasoning)[0] or "").strip()]

    def render_text(self, messages: list[dict], tools: list | None) -> str:
        """Template messages (and tools) -> the rendered chat string (the processor's apply_chat_template,
        untokenized)."""
        from jinja2 import TemplateError

        kwargs = {"tools": tools} if tools else {}
        try:
            return self.processor.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, **kwargs
            )
        except TemplateError as e:  # the template's own raise_exception: this conversation is not one it takes
            raise RecordError(
                "template_refused",
                f"the chat template refuses this conversation: {str(e)[:200]}; "
                "pass a --chat-template that takes it (roles, tools, images)",
            ) from None

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
        from vlmprep.pixels import video_metadata

        if not videos:
            return []
        inputs = {
            "video_grid_thw": np.array([v.grid_thw for v in videos], dtype=np.int64),
            "video_metadata": [video_metadata(v) for v in videos],
        }
        return [self.processor.replace_video_token(inputs, video_idx=i) for i in range(len(videos))]

    def mm_token_types(self, ids: np.ndarray, image_token_lengths: list[int]) -> np.ndarray:
        """Token ids -> the per-token multimodal type ids (0 text, 1 image, 2 video) the processor itself makes."""
        p = self.processor
        if self._mm_ids is not None:  # ProcessorMixin's own method, without its list round trip
            out = np.zeros(len(ids), dtype=np.uint8)
            for kind, tokens in self._mm_ids:
                for t in tokens:
                    out[ids == t] = kind
            return out
        if self._mm_needs_lengths:
            out = p.create_mm_token_type_ids([ids.tolist()], [image_token_lengths])[0]
        else:
            out = p.create_mm_token_type_ids([ids.tolist()])[0]
        return np.asarray(out, dtype=np.uint8)


def _mm_type_ids(processor) -> list[tuple[int, list[int]]] | None:
    """(type, token ids) in the order ProcessorMixin.create_mm_token_type_ids marks them (a later type wins), where
    the processor keeps that method; None where it has its own (Idefics3, GLM-4.1V: spans, not ids)."""
    from transformers.processing_utils import ProcessorMixin

    if type(processor).create_mm_token_type_ids is not ProcessorMixin.create_mm_token_type_ids:
        return None
    kinds = ((1, processor.image_token_ids), (2, processor.video_token_ids), (3, processor.audio_token_ids))
    return [(kind, [int(t) for t in tokens if t is not None]) for kind, tokens in kinds]


def _check_no_special_tokens(conv: Conversation, ctx: RenderContext) -> None:
    if ctx._forbidden_re is None:
        return
    for i, m in enumerate(conv.messages):
        calls = [tc.arguments_json for tc in m.tool_calls] + [tc.name for tc in m.tool_calls]
        for s in [m.text, m.reasoning or ""] + calls:
            hit = ctx._forbidden_re.search(s)
            if hit:
                raise RecordError(
                    "special_token_in_text",
                    f"messages[{i}] ({m.role}) contains the control token {hit.group(0)!r} as text",
                )


def render_conversation(
    conv: Conversation, ctx: RenderContext, images: list[PreparedImage], videos: list[PreparedVideo] = ()
) -> RenderedSample:
    """A Conversation and its prepared images and videos -> one RenderedSample: token ids from the processor's own
    chat template with each image or video expanded to its placeholder tokens, the 0/1 loss mask (which turns and
    parts train, per --train-on-roles, --tool-calls, --reasoning), the multimodal token types and MRoPE position ids.
    The mask is derived from where each message's text landed in the rendered string and checked against the tokens,
    so a template that drops or rewrites trained text is a RecordError (counted reject), never a silent mislabel.
    Trade-off: rendering through the model's own template (not building ids turn by turn) keeps the ids exactly what
    the model sees at inference, at the price of locating every message's text in the rendered string to derive the
    mask."""
    _check_no_special_tokens(conv, ctx)
    if ctx.policy.reasoning == "reject":
        for i in ctx.reasoning_messages(conv):
            raise RecordError(
                "reasoning_refused",
                f"messages[{i}]: this assistant turn carries reasoning and "
                "--reasoning reject refuses it; pass --reasoning train|context|drop",
            )
    slots = ctx.slots(conv)
    rendered = ctx.render_text(ctx.messages(conv, [s.text for s in slots]), conv.tools)  # the slots made once
    located = locate_slots(ctx, conv, slots, rendered)
    reasoning_rendered = _reasoning_rendered(ctx, slots, located)
    if ctx.family.role_markers:
        check_role_markers(ctx, conv, slots, located, rendered)

    expanded, offs = _expand_images(ctx, rendered, images, conv, videos)
    ids, offsets = ctx.text.encode(expanded)
    starts, ends = offsets[:, 0], offsets[:, 1]
    image_spans, video_spans, mm_types, in_image = _expansion_spans(ctx, offs, ids, starts, ends)

    # MaskInputs' fields in order: the same names as these locals (at: the rendered -> expanded char map)
    inputs = MaskInputs(conv, ctx, slots, located, rendered, expanded, _char_map(offs), ids, starts, ends)
    loss_mask, unrendered, turn_spans = compute_mask(inputs)
    if (loss_mask.astype(bool) & in_image).any():
        raise RecordError("mask_verification_failed", "a trained token lies inside an image wrapper")

    grids = np.array([im.grid_thw for im in images], dtype=np.int32).reshape(-1, 3)
    video_grids = np.array([v.grid_thw for v in videos], dtype=np.int32).reshape(-1, 3)
    sgt = _second_per_grid_ts(ctx, videos)
    pixels = ctx.processor.image_processor
    positions = sample_position_ids(ctx.family, mm_types, image_spans, video_spans, grids, video_grids, sgt, pixels)

    return RenderedSample(
        id=conv.id,
        source=conv.source,
        input_ids=ids.astype(np.int32),
        loss_mask=loss_mask,
        mm_token_type_ids=mm_types,
        position_ids=positions,
        image_grid_thw=grids,
        images=list(images),
        image_spans=image_spans,
        video_grid_thw=video_grids,
        second_per_grid_ts=sgt,
        videos=list(videos),
        video_spans=video_spans,
        num_tokens_before_truncation=len(ids),
        unrendered_tool_calls=unrendered,
        turn_spans=turn_spans,
        reasoning_rendered=reasoning_rendered,
    )


def _reasoning_rendered(ctx: RenderContext, slots: list[Slot], located: list[Located]) -> list[int]:
    """Messages whose reasoning the template printed; reasoning it cannot print is a reject, never a silent loss."""
    printed = sorted(
        {slots[loc.slot].msg for loc in located if slots[loc.slot].kind == "reasoning" and slots[loc.slot].text.strip()}
    )
    if not ctx.renders_reasoning:
        for slot in slots:
            if slot.kind == "reasoning" and slot.text.strip() and slot.msg not in printed:
                raise RecordError(
                    "reasoning_not_rendered",
                    f"messages[{slot.msg}]: the chat template does not render reasoning_content; pass "
                    "--reasoning drop to train without it (counted), or a --chat-template that "
                    "renders it",
                )
    return printed


def _char_map(offs: list[dict]) -> Callable[[int], int]:
    """Maps a char of the rendered text to the expanded text: message text never holds a placeholder, so char
    positions only shift by each earlier expansion."""
    rep_ends = [o["span"][1] for o in offs]
    rep_delta = np.cumsum([0] + [(o["new_span"][1] - o["new_span"][0]) - (o["span"][1] - o["span"][0]) for o in offs])

    def at(pos: int) -> int:
        return pos + int(rep_delta[bisect_right(rep_ends, pos)])

    return at


def _expansion_spans(ctx: RenderContext, offs: list[dict], ids: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """[start, end) tokens of each image's and video's whole expansion (wrapper included), the mm token types, and
    which tokens lie inside an expansion."""
    image_spans, video_spans, lengths = [], [], []
    for o in offs:
        s, e = o["new_span"]
        covered = ((ends > s) & (starts < e)).nonzero()[0]
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
    return image_spans, video_spans, mm_types, in_image


def _second_per_grid_ts(ctx: RenderContext, videos: list[PreparedVideo]) -> np.ndarray:
    from vlmprep.pixels import second_per_grid_t

    # float32: what the processor's list becomes as a tensor, and what Qwen2.5-VL's get_rope_index multiplies
    return np.array([second_per_grid_t(v, ctx.processor.video_processor) for v in videos], dtype=np.float32)


def count_tokens(
    conv: Conversation,
    ctx: RenderContext,
    images: list[PreparedImage],
    videos: list[PreparedVideo] = (),
    pieces: dict[str, int] | None = None,
) -> int:
    """The length render_conversation would give, without locating text or proving masks (for planning splits).
    Each expansion goes in with its placeholder runs cut to one copy, counted back (see tokens.TextEncoder): the
    long runs are never built, scanned or tokenized. `pieces`: TextEncoder.count's per-record counts of the text
    between special tokens, so the candidates of one split search tokenize each piece once."""
    rendered = ctx.render_text(ctx.messages(conv), conv.tools)
    image_reps, video_reps = _replacements(ctx, rendered, images, conv, videos)
    short = [shorten_runs(r, ctx.text.run_re, ctx.text.run_tokens) for r in image_reps + video_reps]
    expanded, _ = ctx.processor.get_text_with_replacements(
        [rendered],
        images_replacements=[t for t, _ in short[: len(image_reps)]],
        videos_replacements=[t for t, _ in short[len(image_reps) :]],
    )
    return ctx.text.count(expanded[0], pieces) + sum(k - 1 for _, runs in short for _, k, _ in runs)


def _expand_images(
    ctx: RenderContext,
    rendered: str,
    images: list[PreparedImage],
    conv: Conversation | None = None,
    videos: list[PreparedVideo] = (),
) -> tuple[str, list[dict]]:
    """The rendered text with each image and video placeholder replaced by the processor's own expansion, and the
    offsets."""
    image_reps, video_reps = _replacements(ctx, rendered, images, conv, videos)
    expanded, offs = ctx.processor.get_text_with_replacements(
        [rendered], images_replacements=image_reps, videos_replacements=video_reps
    )
    return expanded[0], (offs[0] if offs else [])


def _replacements(
    ctx: RenderContext,
    rendered: str,
    images: list[PreparedImage],
    conv: Conversation | None,
    videos: list[PreparedVideo],
) -> tuple[list[str], list[str]]:
    """The processor's own expansion of each image and video placeholder of the rendered text, once their counts
    are checked."""
    n_placeholders = len(re.findall(re.escape(ctx.image_token), rendered))
    if n_placeholders != len(images):
        what = f"template emitted {n_placeholders} image placeholders for {len(images)} images"
        raise RecordError("image_count_mismatch", _dropped_images(ctx, conv, n_placeholders, what) or what)
    video_token = getattr(ctx.processor, "video_token", None)
    n_videos = len(re.findall(re.escape(video_token), rendered)) if video_token and videos else 0
    if n_videos != len(videos):
        raise RecordError(
            "video_count_mismatch",
            f"template emitted {n_videos} video placeholders for {len(videos)} "
            "videos; move each video to a user message",
        )
    return ctx.image_replacements(images, rendered), ctx.video_replacements(list(videos))


def _dropped_images(ctx: RenderContext, conv: Conversation | None, n_placeholders: int, what: str) -> str | None:
    """Names the first message whose images the template does not print (rendering without them keeps as many
    placeholders), so the message points at the fix; None when no single message explains the mismatch."""
    for i, m in enumerate(conv.messages if conv is not None else []):
        if not m.images:
            continue
        parts = [p for p in m.parts if p.type != "image"] or [Part(type="text", text="")]
        probe = dataclasses.replace(
            conv, messages=[*conv.messages[:i], dataclasses.replace(m, parts=parts), *conv.messages[i + 1 :]]
        )
        try:
            n = len(re.findall(re.escape(ctx.image_token), ctx.render_text(ctx.messages(probe), conv.tools)))
        except Exception:  # noqa: BLE001 - a diagnosis only; the mismatch is reported either way
            continue
        if n_placeholders - n < len(m.images):
            return f"messages[{i}] ({m.role}): {image_drop_fix(ctx, conv, i, what)}"
    return None
