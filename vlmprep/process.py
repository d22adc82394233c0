"""One record -> its samples or its rejects, exactly as `build` writes them (and `vlmprep inspect` shows them):

    RawRecord --parse/normalize--> Conversation --open_image/prepare_video--> --history/split (traces.py)-->
              --render_conversation--> RenderedSample --truncate_sample--> pixels of the kept images
              --encode_sample--> ShardSample
An image's grid (so its tokens) comes from its header; only the images some sample keeps are decoded and resized.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

from vlmprep.config import BuildConfig
from vlmprep.ingest import (
    NormalizeOptions,
    ReadLimits,
    assistant_turns,
    normalize_record,
    parse_record,
    readable_record,
)
from vlmprep.pixels import DEFAULT_VIDEO_FPS, make_ready, open_image, prepare_image, prepare_video
from vlmprep.processors.load import apply_pixel_budget, apply_video_budget, resolve_chat_template
from vlmprep.render import (
    MaskPolicy,
    RenderContext,
    StepConversation,
    StepPolicy,
    count_tokens,
    render_conversation,
    split_trace,
    trained_messages,
    truncate_sample,
    whole_trace,
)
from vlmprep.shards.format import sample_key
from vlmprep.shards.writer import encode_sample
from vlmprep.types import (
    Conversation,
    PreparedImage,
    PreparedVideo,
    RawRecord,
    RecordError,
    RenderedSample,
    deterministic_message,
    printable,
)
from vlmprep_schemas.boundary import redact_credentials


class Renderer:
    """Everything one process needs to turn a RawRecord into a RenderedSample, exactly as `build` does.
    Also used by `vlmprep inspect` on raw input, so what a person sees is what build writes."""

    def __init__(self, cfg: BuildConfig, processor, *, saved: bool = False):
        """saved: `processor` is a dataset's saved copy, which already carries --chat-template and --min/--max-pixels
        (see renderer_from_saved), so neither is applied again."""
        self.cfg = cfg
        self.processor = processor
        if cfg.chat_template is not None and not saved:
            # Set on the processor itself, so the copy saved into the dataset carries the template that rendered it.
            template = resolve_chat_template(cfg.chat_template).read_text(encoding="utf-8")
            processor.chat_template = template
            if getattr(processor.tokenizer, "chat_template", None) is not None:
                processor.tokenizer.chat_template = template
        # vlmprep truncates to --seq-len itself (never inside an image); the tokenizer's "longer than the
        # specified maximum" warning about the untruncated render is noise. Mark it shown instead of changing
        # model_max_length, so the processor copy saved with the shards stays byte-identical.
        warned = getattr(processor.tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
        policy = MaskPolicy(
            train_on_roles=frozenset(cfg.train_on_roles),
            train_on_eos=cfg.train_on_eos,
            last_turn_only=cfg.last_turn_only,
            tool_calls=cfg.tool_calls,
            reasoning=cfg.reasoning,
        )
        self.ctx = RenderContext(processor, policy=policy, role_boundaries=cfg.role_boundaries)
        self.limits = ReadLimits.of(cfg)
        self.norm = NormalizeOptions(
            max_json_depth=cfg.max_json_depth,
            image_root=cfg.image_root,
            allow_remote=cfg.allow_remote,
            max_images_per_record=cfg.max_images_per_record,
            max_image_bytes=cfg.max_image_bytes,
            max_video_bytes=cfg.max_video_bytes,
            videos=self.ctx.family.video is not None,
        )
        if not saved:
            apply_pixel_budget(processor, self.ctx.family, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            apply_video_budget(
                processor,
                self.ctx.family,
                fps=cfg.video_fps,
                max_frames=cfg.video_max_frames,
                default_fps=DEFAULT_VIDEO_FPS,
            )
        self.steps = StepPolicy(
            long_traces=cfg.long_traces, keep_images=cfg.keep_images, dropped_image_text=cfg.dropped_image_text
        )
        self.turns: collections.Counter = collections.Counter()
        self.lost: list[int] = []
        self._shapes: dict = {}  # an image's stored shape by its upright size (images.open_image)

    def render(self, raw: RawRecord) -> list[RenderedSample]:
        """parse -> normalize -> open images (header: grid) -> history/split (traces.py) -> render + mask ->
        truncate -> the pixels of the images the samples keep; raises RecordError. One sample per record, or several
        when --long-traces split cuts a long trace; `self.turns` then holds the record's turn accounting and
        `self.lost` the trained turns that could not fit."""
        self.turns, self.lost, self.largest_image, self.record_images = collections.Counter(), [], 0, 0
        conv = None
        try:
            conv = normalize_record(parse_record(raw, self.limits), raw.source, self.norm)
            return self._render(conv)
        except Exception:
            # A rejected record trains nothing: every assistant turn it holds is lost with it, whatever was counted
            # before the fault (the coverage gate sees them).
            self.turns = rejected_turns(raw, conv, self.turns)
            raise

    def _render(self, conv: Conversation) -> list[RenderedSample]:
        self.record_images = len(conv.images)
        assistant = {i for i, m in enumerate(conv.messages) if m.role == "assistant"}
        self.turns["input_assistant_turns"] = len(assistant)
        reasoning = set(self.ctx.reasoning_messages(conv))
        self.turns["reasoning_turns"] = len(reasoning)
        images: list[PreparedImage] = []
        try:
            self._open_images(conv, images)
            self.largest_image = max(map(self._grid_tokens, images), default=0)
            videos = self._prepare_videos(conv, first=min(assistant, default=len(conv.messages)))

            steps, self.lost, rendered = self.plan(conv, images, videos)
            samples = []
            for sc in steps:
                full = rendered.pop(id(sc), None) or render_conversation(sc.conv, self.ctx, *_pick(sc, images, videos))
                sample = truncate_sample(full, self.cfg.seq_len)
                before = {sc.source_messages[m] for m, _, _ in full.turn_spans}
                after = {sc.source_messages[m] for m, _, _ in sample.turn_spans}
                self.turns["trained_assistant_turns"] += len(after & assistant)
                self.turns["turns_lost_truncated"] += len((before - after) & assistant)
                self.turns["images_removed_by_history"] += len(sc.removed_images)
                if sc.split is not None and sc.split > 0 and sample.turn_spans:
                    self.turns["context_tokens_repeated"] += sample.turn_spans[0][1]
                samples.append(
                    dataclasses.replace(
                        sample,
                        id=conv.id if sc.split is None else f"{conv.id}#{sc.split}",
                        source_messages=sc.source_messages,
                        trains=sorted(after),
                        removed_images=sc.removed_images,
                        split=sc.split,
                    )
                )
            for s in samples:  # history, split and cut are done: decode and resize what the samples keep, once each
                for im in s.images:  # (a source stored as its bytes: checked only), so a fault rejects the record
                    make_ready(im, self.cfg.image_format)
        except Exception as e:
            fault = self._first_image_fault(conv, images)
            if fault is None and not isinstance(e, RecordError):
                raise
            if fault is not None:
                raise fault from None
            if e.reason == "no_trainable_tokens_after_truncation":
                self._count_lost_turn_causes(len(assistant))
            raise
        # Reasoning left out: by --reasoning drop, or by the template itself (Qwen3.5 prints it only after the last
        # user query), counted per input turn that no sample rendered it for.
        shown = {sc.source_messages[m] for sc, s in zip(steps, samples) for m in s.reasoning_rendered}
        key = "reasoning_turns_dropped" if self.ctx.policy.reasoning == "drop" else "reasoning_turns_not_rendered"
        self.turns[key] = len(reasoning - shown)
        self.turns["turns_lost_too_long"] = len(set(self.lost) & assistant)
        self.turns["turns_lost_policy"] = (
            len(assistant)
            - self.turns["trained_assistant_turns"]
            - self.turns["turns_lost_truncated"]
            - self.turns["turns_lost_too_long"]
        )
        self._count_lost_turn_causes(self.turns["turns_lost_truncated"] + self.turns["turns_lost_too_long"])
        return samples

    def _open_images(self, conv: Conversation, images: list[PreparedImage]) -> None:
        """Appends each image of the record to `images` as it opens (so a fault check sees those opened before a
        failure): its grid from its header (an image repeated in the record, once); its pixels are made later, only
        where a sample keeps it."""
        opened: dict[bytes, PreparedImage] = {}
        for im in conv.images:
            if im.data not in opened:
                opened[im.data] = open_image(
                    im,
                    self.processor,
                    self.ctx.family,
                    max_pixels=self.cfg.max_image_pixels,
                    min_side=self.cfg.min_image_side,
                    shapes=self._shapes,
                )
            images.append(opened[im.data])

    def _prepare_videos(self, conv: Conversation, *, first: int) -> dict[int, PreparedVideo]:
        """The record's videos keyed by part (as steps keep parts); they go with their message (--keep-images counts
        images only). One longer than --seq-len rejects the record only where every trained turn follows it (it sits
        before message `first`, the first assistant turn); a later one is cut or its turns are lost, as an image there
        would be."""
        return {
            id(v): prepare_video(
                v,
                self.processor,
                self.ctx.family,
                max_pixels=self.cfg.max_image_pixels,
                min_side=self.cfg.min_image_side,
                max_tokens=self.cfg.seq_len if i < first else None,
            )
            for i, m in enumerate(conv.messages)
            for v in m.videos
        }

    def plan(
        self, conv: Conversation, images: list[PreparedImage], videos: dict[int, PreparedVideo]
    ) -> tuple[list[StepConversation], list[int], dict[int, RenderedSample]]:
        """The conversations to render, one per sample: the whole record with the history policy applied, or, with
        --long-traces split and a trace longer than --seq-len, the step samples split_trace cuts it into; the
        trained turns that fit no sample; and the renders already made, by id of their step conversation. Lengths
        come from the images' grids: no pixel is made here, except where a record that looks short is rendered
        whole at once (its own length then tells that it fits: no separate count)."""
        pieces: dict[str, int] = {}  # the candidates share most of their text: each piece is tokenized once

        def length(sc: StepConversation) -> int:
            return count_tokens(sc.conv, self.ctx, *_pick(sc, images, videos), pieces=pieces)

        whole = whole_trace(conv, self.steps)
        if self.cfg.long_traces != "split":
            return [whole], [], {}
        full = self._render_if_short(whole, images, videos)
        if full is not None:
            return [whole], [], {id(whole): full}
        if length(whole) > self.cfg.seq_len:
            steps, lost = split_trace(
                conv, trained_messages(conv, self.ctx.policy), self.steps, length, self.cfg.seq_len
            )
            return steps, lost, {}
        return [whole], [], {}

    def _render_if_short(
        self, sc: StepConversation, images: list[PreparedImage], videos: dict[int, PreparedVideo]
    ) -> RenderedSample | None:
        """The render of `sc` where a rough size (its image and video tokens, a token per char of its text, some per
        message) is within --seq-len and the render's own length is too: it is then the sample, and counting its
        tokens first would tokenize it twice. None otherwise, or where the render fails: the record then goes the
        counted way (count_tokens, then split or render), exactly as if this had not run."""
        kept, kept_videos = _pick(sc, images, videos)
        size = sum(map(self._grid_tokens, (*kept, *kept_videos)))
        for m in sc.conv.messages:
            size += 16 + len(m.text) + len(m.reasoning or "")
            size += sum(len(tc.name) + len(tc.arguments_json) for tc in m.tool_calls)
        if size + (len(json.dumps(sc.conv.tools)) if sc.conv.tools else 0) > self.cfg.seq_len:
            return None
        try:
            full = render_conversation(sc.conv, self.ctx, kept, kept_videos)
        except RecordError:
            return None
        return full if len(full.input_ids) <= self.cfg.seq_len else None

    def _first_image_fault(self, conv: Conversation, opened: list[PreparedImage]) -> RecordError | None:
        """The fault of the record's first faulty image, every image decoded up to it: a record that fails is
        rejected for the reason it had when every image was prepared before anything else. (A fault in the pixel
        data of an image that no sample keeps does not reject a record that is fine otherwise: it is never decoded.)"""
        for k, im in enumerate(conv.images):
            try:
                if k < len(opened):
                    _ = opened[k].pixels  # decodes it (once)
                else:
                    prepare_image(
                        im,
                        self.processor,
                        self.ctx.family,
                        max_pixels=self.cfg.max_image_pixels,
                        min_side=self.cfg.min_image_side,
                    )
            except RecordError as e:
                return e
        return None

    def _grid_tokens(self, item) -> int:
        """Placeholder tokens of one prepared image or video (0 for families whose count the grid does not give)."""
        merge = getattr(self.processor.image_processor, "merge_size", 1)
        return math.prod(item.grid_thw) // (merge * merge) if self.ctx.family.grid_images else 0

    @property
    def _large_image(self) -> bool:
        """The record holds an image over half of --seq-len: the turns that cost are --max-pixels' to fix, which
        neither splitting nor dropping older screenshots can replace."""
        return 2 * self.largest_image > self.cfg.seq_len

    def _count_lost_turn_causes(self, lost: int) -> None:
        """What build's fix line reads of turns --seq-len cost: those of a record with an image over half of it
        (--max-pixels' to fix), and those of a record with at most one image (--keep-images cannot shorten it)."""
        if lost and self._large_image:
            self.turns["turns_lost_large_image"] = lost
        if lost and self.record_images <= 1:
            self.turns["turns_lost_single_image"] = lost

    def lost_turn_entry(self, raw: RawRecord, message: int) -> dict:
        """The turn_too_long reject entry for a turn that does not fit --seq-len even with the least context."""
        big = (
            f" (the record holds an image of {self.largest_image} tokens: lower --max-pixels)"
            if self._large_image
            else ""
        )
        return reject_entry(
            raw,
            "turn_too_long",
            f"messages[{message}]: this turn does not fit --seq-len "
            f"{self.cfg.seq_len} even with only the system message, the task and what the turn acts "
            f"on (the messages since the assistant turn before it) as context{big}",
        )

    def process(self, raw: RawRecord):
        """Returns (outcomes, turn accounting): outcomes are ("ok", ShardSample) per sample and ("reject", entry) per
        rejected record or lost turn, in order; never raises for a bad record."""
        self.turns = collections.Counter()
        try:
            samples = self.render(raw)
            outcomes, encoded = [], {}
            for sample in samples:
                outcomes.append(
                    (
                        "ok",
                        encode_sample(
                            sample,
                            key=sample_key(raw.position, sample.split),
                            image_format=self.cfg.image_format,
                            zstd_level=self.cfg.zstd_level,
                            encoded=encoded,
                        ),
                    )
                )
            outcomes += [("reject", self.lost_turn_entry(raw, i)) for i in self.lost]
            return outcomes, dict(self.turns)
        except RecordError as e:
            reason, message = e.reason, e.message
        except Exception as e:  # noqa: BLE001 - a bad record must never stop the build; counted loudly instead
            reason, message = "internal_error", deterministic_message(f"{type(e).__name__}: {str(e)[:300]}")
        return [("reject", reject_entry(raw, reason, message))], dict(self.turns)


def rejected_turns(raw: RawRecord, conv: Conversation | None, counted: collections.Counter) -> collections.Counter:
    """The turn accounting of a rejected record: its assistant turns (from the normalized conversation, else the
    raw record as far as it parses, in any layout normalize reads) all lost with it, whatever the stage rejecting it;
    of what was counted before the fault, only the facts about the input stay (reasoning turns, and turns an oversized
    image cost or that --keep-images cannot save, which build's fix line reads)."""
    if conv is not None:
        n = sum(m.role == "assistant" for m in conv.messages)
    else:
        try:
            n = assistant_turns(readable_record(raw))
        except Exception:  # noqa: BLE001 - the record is being rejected already; its turn count is best effort
            n = 0
    keep = ("reasoning_turns", "turns_lost_large_image", "turns_lost_single_image")
    return collections.Counter(
        {"input_assistant_turns": n, "turns_lost_rejected": n, **{k: counted[k] for k in keep if counted[k]}}
    )


def _pick(sc: StepConversation, images: list[PreparedImage], videos: dict[int, PreparedVideo]) -> tuple[list, list]:
    """The prepared images and videos a step conversation keeps (videos go with their message: keyed by part)."""
    return [images[k] for k in sc.images], [videos[id(v)] for v in sc.conv.videos]


def reject_entry(raw: RawRecord, reason: str, message: str) -> dict:
    """The rejects.jsonl line of a bad record; holds only text that any file or terminal can take."""
    rid = None
    if raw.text is not None or raw.data is not None:
        try:
            v = parse_record(raw).get("id")  # checked there: a string of valid unicode, or an integer
            rid = v if isinstance(v, (str, int)) else None
        except Exception:  # noqa: BLE001 - the record is being rejected already; its id is only a nicety
            pass
    entry = {
        "source": {"file": printable(raw.source.file), "line": raw.source.line},
        "id": rid,
        "reason": reason,
        "message": printable(redact_credentials(message)),  # an image URL's user:password@ is never written
    }
    if raw.unread_bytes:  # a file-level fault: counted in the manifest's totals.unread_bytes
        entry["unread_bytes"] = raw.unread_bytes
    return entry
