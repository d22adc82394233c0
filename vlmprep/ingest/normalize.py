"""Normalize one parsed record (OpenAI chat or ShareGPT/LLaMA-Factory layout) into a Conversation.
Image and video references are fetched to bytes here (media.py: data URI, local path under an allowed root, opt-in
http for images; videos are local paths and data URIs only).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from vlmprep.config import default
from vlmprep.ingest.locations import is_url
from vlmprep.ingest.media import MediaFetcher, decode_base64
from vlmprep.types import (
    Conversation,
    ImageData,
    Message,
    Part,
    RecordError,
    Source,
    ToolCall,
    VideoData,
    json_value,
)

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
}
IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


@dataclass(frozen=True, kw_only=True)
class NormalizeOptions:
    """What normalize needs from the build options: where local media may resolve, whether remote images may be
    fetched, the per-record image limit, and whether the family renders video."""

    image_root: str | None = default("image_root")  # None: the input file's own directory
    allow_remote: bool = default("allow_remote")
    max_images_per_record: int = default("max_images_per_record")
    max_json_depth: int = default("max_json_depth")  # tool-call arguments given as a JSON string
    max_image_bytes: int = default("max_image_bytes")  # an image file (local or remote) is read whole: no more
    max_video_bytes: int = default("max_video_bytes")  # likewise a video file
    videos: bool = False  # the processor's family renders video parts (vlmprep/families: FamilySpec.video)
    # Each root resolved once per set of options (one build's): a root swapped for a link while the build runs does
    # not move it, and every image path is still resolved in full when it is read.
    _roots: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    def real_dir(self, path: str) -> str:
        """The directory a record's local paths must resolve inside."""
        if path not in self._roots:
            self._roots[path] = os.path.realpath(path)
        return self._roots[path]


def normalize_record(data: dict, source: Source, opts: NormalizeOptions) -> Conversation:
    """One parsed record (OpenAI chat, Responses or Anthropic parts, or the ShareGPT / LLaMA-Factory layout with
    <image> / <video> markers) -> one Conversation: messages with typed parts, images and videos read to bytes (data
    URIs, local paths inside --image-root, http(s) only with --allow-remote), tool calls and reasoning kept, and a
    generated id where the record has none. Null fields count as absent. Anything it cannot read the same way every
    time is a RecordError with a registered reason (missing_messages, image_not_found, too_many_images, ...): the
    record is rejected and counted, the build goes on. Trade-off: media bytes are read here, once per record, so
    later stages never touch the file system or the network."""
    data = _drop_nulls(data)
    if "messages" in data:
        raw_messages = data["messages"]
    elif "conversations" in data:
        raw_messages = data["conversations"]
    else:
        raise RecordError("missing_messages", "record has no 'messages' (or ShareGPT 'conversations') list")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RecordError("missing_messages", "'messages' must be a non-empty list")

    # An input in a store has no local dir: its images come inline (data URIs, table cells), by URL, or as absolute
    # paths under an --image-root given for them.
    remote = is_url(source.file)
    base_dir = None if remote else os.path.dirname(os.path.abspath(source.file))
    root = opts.real_dir(opts.image_root) if opts.image_root else None if remote else opts.real_dir(base_dir)
    marker_images, marker_videos = data.get("images"), data.get("videos")
    if marker_images is not None and not isinstance(marker_images, list):
        raise RecordError("invalid_images_field", "'images' must be a list of paths or URLs")
    if marker_videos is not None and not isinstance(marker_videos, list):
        raise RecordError("invalid_videos_field", "'videos' must be a list of video paths (or of frame-image lists)")
    pending = {IMAGE_MARKER: list(marker_images or []), VIDEO_MARKER: list(marker_videos or [])}

    # <image> / <video> markers are the ShareGPT / LLaMA-Factory layout's own convention (an 'images' or 'videos'
    # list, even empty, or the 'conversations' key); in an OpenAI-layout record they are ordinary text.
    markers = marker_images is not None or marker_videos is not None or "conversations" in data
    ctx = _ImageContext(
        base_dir=base_dir,
        root=root,
        allow_remote=opts.allow_remote,
        markers=markers,
        max_bytes={"image": opts.max_image_bytes, "video": opts.max_video_bytes},
        videos=opts.videos,
        max_json_depth=opts.max_json_depth,
    )
    messages = [_normalize_message(m, i, pending, ctx) for i, m in enumerate(_upgrade_legacy(raw_messages))]
    for marker, given, kind in ((IMAGE_MARKER, marker_images, "image"), (VIDEO_MARKER, marker_videos, "video")):
        if pending[marker]:
            raise RecordError(
                f"{kind}_count_mismatch",
                f"'{kind}s' lists {len(given)} {kind}s but the text has only "
                f"{len(given) - len(pending[marker])} {marker} markers",
            )
    if not any(m.role == "assistant" for m in messages):
        raise RecordError("no_assistant_turn", "record has no assistant message to train on")
    n_images = sum(len(m.images) for m in messages)
    if n_images > opts.max_images_per_record:
        raise RecordError("too_many_images", f"{n_images} images > max_images_per_record={opts.max_images_per_record}")

    rid = data.get("id")
    if isinstance(rid, (int, float)) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        rid = generated_id(source)
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RecordError("invalid_tools", "'tools' must be a list of tool specs")
    return Conversation(id=rid, source=source, messages=messages, tools=tools)


def generated_id(source: Source) -> str:
    """The id of a record that has none: "~" + its input's name (path relative to the inputs' common parent) + ":"
    + line. Unique across inputs and stable for the same inputs; the reserved "~" keeps real ids (and the bare
    "file:line" ids earlier versions generated) from meeting them by accident."""
    return f"~{source.input_name or os.path.basename(source.file)}:{source.line}"


_VERBATIM = ("arguments", "tools")  # data the template prints as given: a null inside them is a value


def assistant_turns(data) -> int:
    """The assistant messages of a parsed record as normalize_record reads them (`messages`, else ShareGPT's
    `conversations`; `role` or `from`, any case, `gpt` included), for a record rejected before it normalized: its
    turns are lost with it, whatever the layout. 0 where there is no such list."""
    data = _drop_nulls(data) if isinstance(data, dict) else {}
    messages = data.get("messages", data.get("conversations"))
    return sum(
        isinstance(m, dict)
        and isinstance(role := m.get("role", m.get("from")), str)
        and ROLES.get(role.lower()) == "assistant"
        for m in (messages if isinstance(messages, list) else ())
    )


def _drop_nulls(obj):
    """Arrow-style schema unification fills absent fields with null: treat null as absent, recursively."""
    if isinstance(obj, dict):
        return {k: v if k in _VERBATIM else _drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v) for v in obj]
    return obj


def _upgrade_legacy(raw_messages: list) -> list:
    """Older OpenAI chat fields -> today's: an assistant `function_call` becomes one tool call with the generated id
    "call_<message index>", a later role "function" message the tool message answering it (by name, else the
    oldest open call); an assistant `refusal` with no content becomes its content."""
    out, open_calls = [], []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        fc = m.pop("function_call", None)
        if fc is not None:
            if m.get("tool_calls"):
                raise RecordError("invalid_tool_call", f"messages[{i}]: has both function_call and tool_calls")
            if not isinstance(fc, dict):
                raise RecordError("invalid_tool_call", f"messages[{i}]: function_call must be an object")
            m["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": fc}]
            open_calls.append((f"call_{i}", fc.get("name")))
        role = m.get("role")
        role = role.lower() if isinstance(role, str) else None
        if role == "function" and "tool_call_id" not in m and open_calls:
            call = next((c for c in open_calls if c[1] == m.get("name")), open_calls[0])
            open_calls.remove(call)
            m["tool_call_id"] = call[0]
        if "refusal" in m and not m.get("content") and ROLES.get(role) == "assistant":
            m["content"] = m["refusal"]
        out.append(m)
    return out


def _check_text(text, where: str) -> str:
    if not isinstance(text, str):
        raise RecordError("invalid_text", f"{where}: text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError("invalid_unicode", f"{where}: text holds a lone surrogate") from None
    return text


def _normalize_message(m, idx: int, pending: dict[str, list], ctx: "_ImageContext") -> Message:
    where = f"messages[{idx}]"
    if not isinstance(m, dict):
        raise RecordError("invalid_message", f"{where} is a {type(m).__name__}, expected an object")
    role_raw = m.get("role", m.get("from"))
    if not isinstance(role_raw, str) or role_raw.lower() not in ROLES:
        raise RecordError("unknown_role", f"{where}: unknown role {role_raw!r}")
    role = ROLES[role_raw.lower()]
    content = m.get("content", m.get("value"))
    parts: list[Part] = []
    if content is None:
        pass
    elif isinstance(content, str):
        parts = _split_markers(_check_text(content, where), pending, ctx, where)
    elif isinstance(content, list):
        for j, p in enumerate(content):
            parts.extend(_normalize_part(p, f"{where}.content[{j}]", pending, ctx))
    else:
        raise RecordError("invalid_content", f"{where}: content must be a string or a list of parts")

    tool_calls = [
        _normalize_tool_call(tc, f"{where}.tool_calls[{k}]", ctx.max_json_depth)
        for k, tc in enumerate(m.get("tool_calls") or [])
    ]
    if role == "assistant" and not parts and not tool_calls:
        raise RecordError(
            "empty_assistant_turn",
            f"{where}: assistant message has no content, tool_calls, function_call or refusal to train on",
        )
    weight = m.get("weight")
    if weight is not None and weight not in (0, 1):
        raise RecordError("invalid_weight", f"{where}: weight must be 0 or 1, got {weight!r}")
    tool_call_id = m.get("tool_call_id")
    name = m.get("name")
    return Message(
        role=role,
        parts=parts,
        tool_calls=tool_calls,
        tool_call_id=tool_call_id if isinstance(tool_call_id, str) else None,
        name=name if isinstance(name, str) else None,
        weight=weight,
        reasoning=_normalize_reasoning(m, role, where),
    )


_REASONING_KEYS = ("reasoning_content", "reasoning")  # vLLM / DeepSeek / Qwen exports; `reasoning`: OpenRouter, others


def _normalize_reasoning(m: dict, role: str, where: str) -> str | None:
    """An assistant's reasoning text, or None. Reasoning that is there but unusable is a reject, never ignored."""
    given = {k: m[k] for k in _REASONING_KEYS if k in m}
    for k, v in given.items():
        if not isinstance(v, str):
            raise RecordError(
                "invalid_reasoning",
                f"{where}.{k}: reasoning must be a string, got {type(v).__name__} "
                "(structured reasoning parts are not read)",
            )
        _check_text(v, f"{where}.{k}")
    texts = {v for v in given.values() if v.strip()}  # "" is what exporters write for a turn without thinking
    if not texts:
        return None
    if len(texts) > 1:
        raise RecordError("invalid_reasoning", f"{where}: reasoning_content and reasoning differ; keep one")
    if role != "assistant":
        raise RecordError(
            "invalid_reasoning", f"{where}: a {role} message carries reasoning; only assistant turns think"
        )
    return texts.pop()


def _split_markers(text: str, pending: dict[str, list], ctx: "_ImageContext", where: str) -> list[Part]:
    """LLaMA-Factory layout: each <image> marker takes the next entry of the record's 'images' list, each <video>
    marker the next of its 'videos' list (a video path, or a list of frame images as LLaMA-Factory also takes)."""
    if not ctx.markers or (IMAGE_MARKER not in text and VIDEO_MARKER not in text):
        return [Part("text", text=text)] if text else []
    parts: list[Part] = []
    for piece in _MARKERS.split(text):
        if piece not in pending:
            if piece:
                parts.append(Part("text", text=piece))
            continue
        kind = "image" if piece == IMAGE_MARKER else "video"
        if not pending[piece]:
            raise RecordError(f"{kind}_count_mismatch", f"{where}: more {piece} markers than '{kind}s' entries")
        ref = pending[piece].pop(0)
        if kind == "image":
            parts.append(Part("image", image=ctx.fetch(ref, where)))
        else:
            parts.append(_video({"type": "video", "video": ref}, "video", where, ctx))
    return parts


def _normalize_part(p, where: str, pending: dict[str, list], ctx: "_ImageContext") -> list[Part]:
    if isinstance(p, str):
        return _split_markers(_check_text(p, where), pending, ctx, where)
    if not isinstance(p, dict):
        raise RecordError("invalid_content_part", f"{where}: part must be an object")
    ptype = p.get("type")
    if ptype is None:
        # Untyped parts from schema-unified datasets: infer from the one payload key present.
        ptype = next((k for k in ("text", "image_url", "image", "video_url", "video") if k in p), None)
    if ptype in ("text", "input_text", "output_text"):  # input_/output_text: the OpenAI Responses API's parts
        text = _check_text(p.get("text"), where)
        return _split_markers(text, pending, ctx, where)
    if ptype == "refusal":  # Responses API: an assistant refusal part, trained as its text
        return _split_markers(_check_text(p.get("refusal"), where), pending, ctx, where)
    if ptype in ("image_url", "input_image"):
        ref = p.get("image_url")
        if isinstance(ref, dict):
            ref = ref.get("url")
        if ref is None and "file_id" in p:
            raise RecordError(
                "unsupported_file_id",
                f"{where}: image given by file_id (OpenAI Files API); inline it as a data URI or path",
            )
        return [Part("image", image=ctx.fetch(ref, where))]
    if ptype == "image":
        if isinstance(p.get("source"), dict):
            return [Part("image", image=_anthropic_image(p["source"], where, ctx))]
        ref = p.get("image", p.get("url", p.get("path")))
        return [Part("image", image=ctx.fetch(ref, where))]
    if ptype in ("video", "video_url", "input_video"):
        return [_video(p, ptype, where, ctx)]
    if ptype in ("audio", "input_audio", "audio_url"):
        raise RecordError("unsupported_audio", f"{where}: audio parts are not supported")
    raise RecordError("unknown_content_type", f"{where}: unknown content part type {ptype!r}")


def _video(p: dict, ptype: str, where: str, ctx: "_ImageContext") -> Part:
    if not ctx.videos:
        raise RecordError(
            "unsupported_video",
            f"{where}: this processor's family has no video support in "
            "vlmprep (Qwen2-VL, Qwen2.5-VL and Qwen3-VL have); drop the "
            "video part or build with one of those processors",
        )
    return Part("video", video=_video_part(p, ptype, where, ctx))


_VIDEO_OPTIONS = {"fps": float, "max_frames": int, "min_pixels": int, "max_pixels": int, "total_pixels": int}


def _video_part(p: dict, ptype: str, where: str, ctx: "_ImageContext") -> VideoData:
    """`video_url` {"url": PATH_OR_DATA_URI}, `video` PATH, or `video` [IMG, ...] (frames taken at `fps`), with the
    optional sampling and pixel options of the part (also accepted inside a `video_url` object)."""
    ref = p.get("video_url") if ptype == "video_url" else p.get("video", p.get("url", p.get("path")))
    opts = dict(p)
    if isinstance(ref, dict):
        opts.update(ref)
        ref = ref.get("url")
    options = {}
    for k, kind in _VIDEO_OPTIONS.items():
        v = opts.get(k)
        if v is None:
            continue
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not v > 0
            or (kind is int and v != int(v))
            or v != v
            or v == float("inf")
        ):
            raise RecordError(
                "invalid_video_option",
                f"{where}: {k}={v!r} must be a positive {'number' if kind is float else 'integer'}",
            )
        options[k] = kind(v)
    if isinstance(ref, list):
        if not ref:
            raise RecordError("video_no_frames", f"{where}: the video's frame list is empty; give at least one frame")
        frames = tuple(ctx.fetch(r, f"{where}.video[{k}]") for k, r in enumerate(ref))
        return VideoData(frames=frames, origin="frames", **options)
    fetched = ctx.fetch(ref, where, kind="video")
    return VideoData(data=fetched.data, origin=fetched.origin, **options)


def _anthropic_image(src: dict, where: str, ctx: "_ImageContext") -> ImageData:
    """Anthropic Messages API image block source: base64 data (decoded as a data URI's) or a URL (the same remote
    and local rules as image_url)."""
    kind = src.get("type")
    if kind == "base64":
        return ImageData(data=decode_base64(src.get("data"), where), origin="data-uri")
    if kind == "url":
        return ctx.fetch(src.get("url"), where)
    if kind == "file" or "file_id" in src:
        raise RecordError(
            "unsupported_file_id",
            f"{where}: image given by file_id (Anthropic Files API); inline it as base64 data or a path",
        )
    raise RecordError(
        "unsupported_image_source", f"{where}: Anthropic image source type {kind!r} is not supported (base64 or url)"
    )


def _normalize_tool_call(tc, where: str, max_json_depth: int) -> ToolCall:
    if not isinstance(tc, dict):
        raise RecordError("invalid_tool_call", f"{where}: tool call must be an object")
    fn = tc.get("function", tc)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise RecordError("invalid_tool_call", f"{where}: tool call has no function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:  # parsed again by the template and the mask check: its depth is bounded here
            json_value(args, max_depth=max_json_depth, what=f"{where}: arguments")
        except ValueError:
            raise RecordError("invalid_tool_arguments", f"{where}: arguments is not valid JSON") from None
        _check_text(args, where)  # kept as the exact string: templates print it verbatim
    elif isinstance(args, dict):
        _check_text(json.dumps(args, ensure_ascii=False), where)
    else:
        raise RecordError("invalid_tool_arguments", f"{where}: arguments must be a JSON string or an object")
    tid = tc.get("id")
    return ToolCall(id=tid if isinstance(tid, str) else None, name=name, arguments=args)


@dataclass(frozen=True)
class _ImageContext(MediaFetcher):
    """One record's media (media.py) and how its parts read: the ShareGPT markers, whether video parts render."""

    markers: bool = False  # the record is in the ShareGPT / LLaMA-Factory layout
    videos: bool = False  # video parts are rendered (else rejected as unsupported_video)
    max_json_depth: int = default("max_json_depth")  # tool-call arguments given as a JSON string
