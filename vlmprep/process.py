"""One record -> its samples or its rejects, exactly as `build` writes them (and `vlmprep inspect` shows them):

    RawRecord --parse/normalize--> Conversation --prepare_image/prepare_video--> --history/split (traces.py)-->
              --render_conversation--> RenderedSample --truncate_sample--> --encode_sample--> ShardSample
"""
from __future__ import annotations

import collections
import dataclasses
import math

from vlmprep.config import BuildConfig
from vlmprep.images import prepare_image
from vlmprep.normalize import NormalizeOptions, normalize_record
from vlmprep.processors.load import apply_pixel_budget, apply_video_budget, resolve_chat_template
from vlmprep.records import parse_record
from vlmprep.render import MaskPolicy, RenderContext, count_tokens, render_conversation, trained_messages
from vlmprep.shards.format import sample_key
from vlmprep.shards.writer import encode_sample
from vlmprep.traces import StepPolicy, split_trace, whole_trace
from vlmprep.truncate import truncate_sample
from vlmprep.types import RawRecord, RecordError, RenderedSample, deterministic_message, printable
from vlmprep.videos import DEFAULT_VIDEO_FPS, prepare_video


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
        policy = MaskPolicy(train_on_roles=frozenset(cfg.train_on_roles), train_on_eos=cfg.train_on_eos,
                            last_turn_only=cfg.last_turn_only, tool_calls=cfg.tool_calls, reasoning=cfg.reasoning)
        self.ctx = RenderContext(processor, policy=policy, role_boundaries=cfg.role_boundaries)
        self.norm = NormalizeOptions(image_root=cfg.image_root, allow_remote=cfg.allow_remote,
                                     max_images_per_record=cfg.max_images_per_record,
                                     max_image_bytes=cfg.max_image_bytes, max_video_bytes=cfg.max_video_bytes,
                                     videos=self.ctx.family.video is not None)
        if not saved:
            apply_pixel_budget(processor, self.ctx.family, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            apply_video_budget(processor, self.ctx.family, fps=cfg.video_fps, max_frames=cfg.video_max_frames,
                               default_fps=DEFAULT_VIDEO_FPS)
        self.steps = StepPolicy(long_traces=cfg.long_traces, keep_images=cfg.keep_images,
                                dropped_image_text=cfg.dropped_image_text)
        self.turns: collections.Counter = collections.Counter()
        self.lost: list[int] = []

    def render(self, raw: RawRecord) -> list[RenderedSample]:
        """parse -> normalize -> prepare images -> history/split (traces.py) -> render + mask -> truncate; raises
        RecordError. One sample per record, or several when --long-traces split cuts a long trace; `self.turns`
        then holds the record's turn accounting and `self.lost` the trained turns that could not fit."""
        self.turns, self.lost, self.largest_image = collections.Counter(), [], 0
        conv = normalize_record(parse_record(raw), raw.source, self.norm)
        assistant = {i for i, m in enumerate(conv.messages) if m.role == "assistant"}
        self.turns["input_assistant_turns"] = len(assistant)
        reasoning = set(self.ctx.reasoning_messages(conv))
        self.turns["reasoning_turns"] = len(reasoning)
        try:
            images = [prepare_image(im, self.processor, self.ctx.family, max_pixels=self.cfg.max_image_pixels,
                                    min_side=self.cfg.min_image_side) for im in conv.images]
            self.largest_image = max(map(self._image_tokens, images), default=0)
            # Videos go with their message (--keep-images counts images only); keyed by part, as steps keep parts.
            videos = {id(v): prepare_video(v, self.processor, self.ctx.family, max_pixels=self.cfg.max_image_pixels,
                                           min_side=self.cfg.min_image_side, max_tokens=self.cfg.seq_len)
                      for v in conv.videos}

            def vids(c):
                return [videos[id(v)] for v in c.videos]

            whole = whole_trace(conv, self.steps)
            steps = [whole]
            if self.cfg.long_traces == "split" and count_tokens(whole.conv, self.ctx, _pick(images, whole),
                                                                vids(whole.conv)) > self.cfg.seq_len:
                steps, self.lost = split_trace(conv, trained_messages(conv, self.ctx.policy), self.steps,
                                               lambda sc: count_tokens(sc.conv, self.ctx, _pick(images, sc),
                                                                       vids(sc.conv)),
                                               self.cfg.seq_len)
            samples = []
            for sc in steps:
                full = render_conversation(sc.conv, self.ctx, _pick(images, sc), vids(sc.conv))
                sample = truncate_sample(full, self.cfg.seq_len)
                before = {sc.source_messages[m] for m, _, _ in full.turn_spans}
                after = {sc.source_messages[m] for m, _, _ in sample.turn_spans}
                self.turns["trained_assistant_turns"] += len(after & assistant)
                self.turns["turns_lost_truncated"] += len((before - after) & assistant)
                self.turns["images_removed_by_history"] += len(sc.removed_images)
                if sc.split is not None and sc.split > 0 and sample.turn_spans:
                    self.turns["context_tokens_repeated"] += sample.turn_spans[0][1]
                samples.append(dataclasses.replace(
                    sample, id=conv.id if sc.split is None else f"{conv.id}#{sc.split}",
                    source_messages=sc.source_messages, trains=sorted(after), removed_images=sc.removed_images,
                    split=sc.split))
        except RecordError as e:
            self.turns["turns_lost_rejected"] = len(assistant)
            if e.reason == "no_trainable_tokens_after_truncation":
                self._count_large_image_loss(len(assistant))
            raise
        # Reasoning left out: by --reasoning drop, or by the template itself (Qwen3.5 prints it only after the last
        # user query), counted per input turn that no sample rendered it for.
        shown = {sc.source_messages[m] for sc, s in zip(steps, samples) for m in s.reasoning_rendered}
        key = "reasoning_turns_dropped" if self.ctx.policy.reasoning == "drop" else "reasoning_turns_not_rendered"
        self.turns[key] = len(reasoning - shown)
        self.turns["turns_lost_too_long"] = len(set(self.lost) & assistant)
        self.turns["turns_lost_policy"] = (len(assistant) - self.turns["trained_assistant_turns"]
                                           - self.turns["turns_lost_truncated"] - self.turns["turns_lost_too_long"])
        self._count_large_image_loss(self.turns["turns_lost_truncated"] + self.turns["turns_lost_too_long"])
        return samples

    def _image_tokens(self, image) -> int:
        """Placeholder tokens of one prepared image (0 for families whose count the grid does not give)."""
        merge = getattr(self.processor.image_processor, "merge_size", 1)
        return math.prod(image.grid_thw) // (merge * merge) if self.ctx.family.grid_images else 0

    @property
    def _large_image(self) -> bool:
        """The record holds an image over half of --seq-len: the turns that cost are --max-pixels' to fix, which
        neither splitting nor dropping older screenshots can replace."""
        return 2 * self.largest_image > self.cfg.seq_len

    def _count_large_image_loss(self, lost: int) -> None:
        if lost and self._large_image:  # build's fix line reads this count
            self.turns["turns_lost_large_image"] = lost

    def lost_turn_entry(self, raw: RawRecord, message: int) -> dict:
        big = f" (the record holds an image of {self.largest_image} tokens: lower --max-pixels)" if self._large_image \
            else ""
        return reject_entry(raw, "turn_too_long", f"messages[{message}]: this turn does not fit --seq-len "
                            f"{self.cfg.seq_len} even with only the system message and the task as context{big}")

    def process(self, raw: RawRecord):
        """Returns (outcomes, turn accounting): outcomes are ("ok", ShardSample) per sample and ("reject", entry) per
        rejected record or lost turn, in order; never raises for a bad record."""
        self.turns = collections.Counter()
        try:
            samples = self.render(raw)
            outcomes = []
            for sample in samples:
                outcomes.append(("ok", encode_sample(sample, key=sample_key(raw.position, sample.split),
                                                     image_format=self.cfg.image_format,
                                                     zstd_level=self.cfg.zstd_level)))
            outcomes += [("reject", self.lost_turn_entry(raw, i)) for i in self.lost]
            return outcomes, dict(self.turns)
        except RecordError as e:
            reason, message = e.reason, e.message
        except Exception as e:  # noqa: BLE001 - a bad record must never stop the build; counted loudly instead
            reason, message = "internal_error", deterministic_message(f"{type(e).__name__}: {str(e)[:300]}")
        return [("reject", reject_entry(raw, reason, message))], dict(self.turns)


def _pick(images: list, sc) -> list:
    """The prepared images a step conversation keeps (all of them when sc is None)."""
    return images if sc is None else [images[k] for k in sc.images]


def reject_entry(raw: RawRecord, reason: str, message: str) -> dict:
    """The rejects.jsonl line of a bad record; holds only text that any file or terminal can take."""
    rid = None
    if raw.text is not None or raw.data is not None:
        try:
            v = parse_record(raw).get("id")  # checked there: a string of valid unicode, or an integer
            rid = v if isinstance(v, (str, int)) else None
        except Exception:  # noqa: BLE001 - the record is being rejected already; its id is only a nicety
            pass
    entry = {"source": {"file": printable(raw.source.file), "line": raw.source.line}, "id": rid, "reason": reason,
             "message": printable(message)}
    if raw.unread_bytes:  # a file-level fault: counted in the manifest's totals.unread_bytes
        entry["unread_bytes"] = raw.unread_bytes
    return entry
