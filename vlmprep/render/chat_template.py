"""The chat template's side of render: a Conversation -> the messages an HF chat template takes (each text slot in
the order the template prints it, reasoning split off or dropped, tool-call arguments as the template wants them),
and probes of what a template prints. Input: a Conversation; output: template messages and their text slots.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from vlmprep.processors.load import TEMPLATES_DIR
from vlmprep.render.mask import SENTINEL
from vlmprep.types import Conversation


@dataclass(frozen=True)
class Slot:
    """One text the template receives: a content text part, or an assistant's reasoning split off its <think>."""

    msg: int
    kind: str  # "text" | "reasoning"
    text: str


class StructureRenders:
    """Renders of template messages that carry no record text (mask.locate_slots' sentinel rendering), kept by their
    JSON: the records of one shape (most of a VQA set) render their sentinels once. Exact, since a render is a
    function of the messages and tools alone, unless the template reads the clock or draws at random: then none is
    kept. At most 256 are kept, by a 256-bit digest of that JSON (a trace's tool specs make it long), the oldest
    dropped first."""

    _MAX = 256

    def __init__(self, render, chat_template: str):
        self._render = render
        self._on = not any(w in chat_template for w in ("strftime_now", "random", "now("))
        self._kept: dict[bytes, str] = {}

    def render(self, messages: list[dict], tools: list | None) -> str:
        """The template's render of `messages` and `tools`, kept or made now."""
        if not self._on:
            return self._render(messages, tools)
        try:  # key order kept: a template may walk a dict's keys in order
            key = hashlib.blake2b(json.dumps([messages, tools]).encode(), digest_size=32).digest()
        except (TypeError, ValueError):
            return self._render(messages, tools)
        out = self._kept.get(key)
        if out is None:
            out = self._render(messages, tools)
            if len(self._kept) >= self._MAX:
                del self._kept[next(iter(self._kept))]
            self._kept[key] = out
        return out


def prints_string_arguments(processor, chat_template: str) -> bool:
    """Whether the template prints tool-call arguments given as a JSON string verbatim (Qwen2/3-VL). Templates that
    walk the arguments' keys (Qwen3.5: `arguments|items`) fail on a string, and templates that serialize them
    (`tojson`: the Llama / Mistral vendor templates) would print it escaped, as a JSON string inside the JSON; both
    expect the object, so they get the parsed one."""
    probe = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}],
        },
    ]
    try:
        rendered = processor.apply_chat_template(probe, chat_template=chat_template, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error on a string means it needs the object
        return False
    return '{"k": 1}' in rendered


def renders_reasoning(processor, chat_template: str) -> bool:
    """Whether the template prints an assistant's reasoning_content at all (probed on a last turn, where reasoning
    templates keep it)."""
    probe = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": SENTINEL.format(0), "content": "a"},
    ]
    try:
        rendered = processor.apply_chat_template(probe, chat_template=chat_template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe renders no reasoning we could prove
        return False
    return SENTINEL.format(0) in rendered


def image_drop_fix(ctx, conv: Conversation, message: int, what: str) -> str:
    """What would help where the chat template drops the images of conv.messages[message] (ctx: render's
    RenderContext; `what`: the counts): a bundled template of the family that prints every image of the record, named
    where one does (probed); and, by where the image is, moving it to a user message (it is in another role's), or
    giving it in a later user message where the template drops it only beside tools (Llama 4's Hub template prints
    the first user message of a record with tools as text next to the tool list)."""
    m, messages, n = conv.messages[message], ctx.messages(conv), len(conv.images)
    named = [t for t in ctx.family.templates if _placeholders(ctx, _bundled(t), messages, conv.tools) == n]
    use = (
        f"pass --chat-template {named[0]} (bundled; it renders them)"
        if named
        else "pass a --chat-template that renders them"
    )
    if m.role != "user":
        return (
            f"the chat template drops images in {m.role} messages ({what}); move the image to a user message, or {use}"
        )
    beside_tools = [_placeholders(ctx, ctx.chat_template, messages, t) or 0 for t in (None, conv.tools)]
    if conv.tools and beside_tools[0] - beside_tools[1] >= len(m.images):
        return (
            f"the chat template prints this message as text beside the tool list when the record has tools, so its "
            f"images are dropped ({what}); {use}, or give the images in a later user message"
        )
    return f"the chat template drops this user message's images ({what}); {use}"


def _bundled(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _placeholders(ctx, template: str, messages: list[dict], tools: list | None) -> int | None:
    """The image placeholders `template` prints for the messages (and tools); None where it cannot render them."""
    try:
        text = ctx.processor.apply_chat_template(
            messages, chat_template=template, tokenize=False, **({"tools": tools} if tools else {})
        )
    except Exception:  # noqa: BLE001 - a diagnosis only: a template that cannot render the record renders no image
        return None
    return text.count(ctx.image_token)


def _split_think(text: str) -> tuple[str, str]:
    # The exact split Qwen3 / Qwen3.5 templates apply to an assistant content holding "</think>".
    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, text.split("</think>")[-1].lstrip("\n")


def _reasoning_split_applies(m, reasoning: bool) -> bool:
    texts = [p for p in m.parts if p.type == "text"]
    return reasoning and m.role == "assistant" and len(texts) == 1 and len(m.parts) == 1 and "</think>" in texts[0].text


def reasoning_of(m, reasoning: bool) -> tuple[str | None, str | None]:
    """(reasoning, answer): a message's reasoning_content, or the <think> block a reasoning template splits off its
    content (answer: the content that is left); (None, None) when it has none."""
    if m.reasoning is not None:
        return m.reasoning, None
    if _reasoning_split_applies(m, reasoning):
        return _split_think(m.text)
    return None, None


def message_slots(
    conv: Conversation, *, reasoning: bool = False, string_content: bool = False, drop_reasoning: bool = False
) -> list[Slot]:
    """Every text the template receives, in template_messages order; each message has at least one slot."""
    slots = []
    for i, m in enumerate(conv.messages):
        r, answer = reasoning_of(m, reasoning)
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


def template_messages(
    conv: Conversation,
    texts: list[str] | None = None,
    *,
    reasoning: bool = False,
    string_content: bool = False,
    empty_as_string: bool = False,
    parse_arguments: bool = False,
    drop_reasoning: bool = False,
) -> list[dict]:
    """Conversation -> HF chat-template messages. With `texts`, the slots take those strings instead (sentinels).
    `reasoning`: an assistant "<think>R</think>A" goes in as reasoning_content=R, content=A, as reasoning templates
    split it themselves; `string_content`: text-only messages go in as one string (templates that print content);
    `empty_as_string`: a message without any part goes in as content "" instead of one empty text part;
    tool-call arguments go in as the record gave them (a string stays the exact string), or parsed where
    `parse_arguments` (templates that cannot take a string). A message's own reasoning goes in as reasoning_content
    (how reasoning templates read it); `drop_reasoning` leaves it out (and a split-off <think> block with it)."""
    if texts is None:
        slots = message_slots(conv, reasoning=reasoning, string_content=string_content, drop_reasoning=drop_reasoning)
        texts = [s.text for s in slots]
    vals = iter(texts)
    out = []
    for m in conv.messages:
        msg: dict = {"role": m.role}
        r, answer = reasoning_of(m, reasoning)
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
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.name,
                        "arguments": (
                            json.loads(tc.arguments)
                            if parse_arguments and isinstance(tc.arguments, str)
                            else tc.arguments
                        ),
                    },
                }
                for tc in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out
