"""The view of a sample, shared by the terminal printers (show.py) and the HTML report (report.py): an
InspectedSample (inspected.py: a stored or rendered sample) -> segments (text runs, special tokens, collapsed image
and video runs) grouped by message -> text and facts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from vlmprep.families import ANY_TURN_STARTS, family_of
from vlmprep.tools.inspected import InspectedSample, InspectedVideo, image_token_count
from vlmprep_schemas.processor_dir import processor_files

MAX_LISTED_TIMESTAMPS = 16  # a longer video lists its first 8 and last 4 frame times in the terminal marker


@dataclass
class Segment:
    """Tokens [start, end) shown as one piece: a text run, one special token, one collapsed image run, or one video
    (all its placeholder runs and, for Qwen3-VL, the timestamp text between them)."""

    start: int
    end: int
    kind: str  # "text" | "special" | "image" | "video"
    trained: bool
    text: str
    image: int | None = None  # 0-based image occurrence for kind == "image"
    video: int | None = None  # 0-based video for kind == "video"; None: a run no video_grid_thw row accounts for
    runs: tuple[tuple[int, int], ...] = ()  # kind == "video": its placeholder runs [start, end)


@dataclass
class MessageView:
    """One message of a sample for display: its role and its token segments."""

    role: str
    segments: list[Segment]

    @property
    def runs(self) -> list[tuple[bool, list[Segment]]]:
        """Maximal runs of equal loss mask: what the trained markers wrap."""
        out: list[tuple[bool, list[Segment]]] = []
        for seg in self.segments:
            if out and out[-1][0] == seg.trained:
                out[-1][1].append(seg)
            else:
                out.append((seg.trained, [seg]))
        return out

    @property
    def num_trained(self) -> int:
        """How many of the message's tokens train."""
        return sum(s.end - s.start for s in self.segments if s.trained)

    @property
    def num_tokens(self) -> int:
        """The message's length in tokens."""
        return sum(s.end - s.start for s in self.segments)


@dataclass
class SampleView:
    """One sample prepared for display: its arrays, its messages cut into segments, and the tokenizer view."""

    sample: InspectedSample
    messages: list[MessageView]
    tokenizer_view: "TokenizerView"

    @property
    def num_tokens(self) -> int:
        """The sample's length in tokens."""
        return len(self.sample.input_ids)

    @property
    def num_trained(self) -> int:
        """How many of its tokens train (loss_mask 1)."""
        return int(self.sample.loss_mask.sum())

    @property
    def num_image_tokens(self) -> int:
        """How many of its tokens stand for image content (each image's whole unit)."""
        return image_token_count(self.sample)

    @property
    def num_images(self) -> int:
        """How many images it holds (occurrences)."""
        return len(self.sample.image_grid_thw)

    @property
    def num_video_tokens(self) -> int:
        """How many of its tokens are video placeholders."""
        return int((self.sample.mm_token_type_ids == 2).sum())


class TokenizerView:
    """What the views need from a processor: decode, special tokens, turn starts and the image merge size."""

    def __init__(
        self,
        *,
        decode: Callable[[list[int]], str],
        decode_batch: Callable[[list[list[int]]], list[str]],
        special: dict[int, str],
        merge_size: int | None,
        turn_starts: dict[str, str] = ANY_TURN_STARTS,
        grid: bool = True,
        turn_ends: tuple[str, ...] = (),
    ):
        self._decode = decode
        self._decode_batch = decode_batch
        self.special = special
        self.special_ids = np.array(sorted(special), dtype=np.int64)
        self.turn_starts = {i: turn_starts[c] for i, c in special.items() if c in turn_starts}
        self.turn_ends = {i for i, c in special.items() if c in turn_ends}  # a message starts after each
        self.merge_size = merge_size  # None: the family has no patch grid to check placeholder counts against
        self.grid = grid  # False: the family's grid rows are image sizes (no patch grid)

    @classmethod
    def from_processor(cls, processor) -> "TokenizerView":
        """The view of a loaded processor's tokenizer."""
        tok = processor.tokenizer
        kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
        return cls(
            decode=lambda ids: tok.decode(ids, **kw),
            decode_batch=lambda b: tok.batch_decode(b, **kw),
            special={int(i): t.content for i, t in tok.added_tokens_decoder.items() if t.special},
            merge_size=getattr(getattr(processor, "image_processor", None), "merge_size", None),
            turn_starts=_turn_starts(type(processor).__name__),
            grid=_grid(type(processor).__name__),
            turn_ends=_turn_ends(type(processor).__name__),
        )

    @classmethod
    def from_dir(cls, d: Path, processor_class: str | None = None) -> "TokenizerView":
        """A dataset's saved processor. Its tokenizer.json alone decodes exactly as the HF tokenizer does
        (decode is the Rust decoder either way) and skips seconds of transformers import per call. Checked first like
        every processor read from a dataset (no file linking out, no custom code)."""
        processor_files(d)
        merge = None
        for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
            if (d / name).is_file():
                cfg = json.loads((d / name).read_text(encoding="utf-8"))
                merge = (cfg.get(key) or {}).get("merge_size") if key else cfg.get("merge_size")
                if merge:
                    break
        if not (d / "tokenizer.json").is_file():
            from vlmprep.processors.load import load_saved_processor

            return cls.from_processor(load_saved_processor(d))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        return cls(
            decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
            decode_batch=lambda b: tok.decode_batch(b, skip_special_tokens=False),
            special={int(i): t.content for i, t in tok.get_added_tokens_decoder().items() if t.special},
            merge_size=int(merge) if merge else None,
            turn_starts=_turn_starts(processor_class),
            grid=_grid(processor_class),
            turn_ends=_turn_ends(processor_class),
        )

    def decode(self, ids) -> str:
        """Token ids -> their text, special tokens kept."""
        return self._decode([int(i) for i in ids])

    def pieces(self, ids: np.ndarray) -> list[str]:
        """Each token's own text, in one batched call."""
        return self._decode_batch([[int(i)] for i in ids])


def segment_sample(sample: InspectedSample, tv: TokenizerView) -> list[MessageView]:
    """Split into runs of equal (mask, type), each special token alone; decode each run with one call."""
    ids = np.asarray(sample.input_ids, dtype=np.int64)
    mask = np.asarray(sample.loss_mask).astype(bool)
    types = np.asarray(sample.mm_token_type_ids).astype(np.int64)
    n = len(ids)
    if n == 0:
        return []
    marked = types
    if sample.image_spans is not None:  # each image's whole unit is one piece: its own kind, 3 + k
        marked = np.where(types == 1, 0, types)
        for k, (a, b) in enumerate(sample.image_spans):
            marked[a:b] = 3 + k
    special = np.isin(ids, tv.special_ids) & (marked == 0)
    change = np.ones(n, dtype=bool)
    change[1:] = (mask[1:] != mask[:-1]) | (marked[1:] != marked[:-1]) | special[1:] | special[:-1]
    for p in np.flatnonzero(np.isin(ids[:-2], list(tv.turn_ends))) + 1:  # the newline after a turn end: its own run
        change[p + 1] |= not tv.decode(ids[p : p + 1]).strip()
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], n)
    videos = {seg.start: seg for seg in _video_segments(sample, types, mask, tv)}
    segments: list[Segment] = []
    k = 0
    video_end = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        trained = bool(mask[s])
        if s < video_end:  # inside a video block: its later runs and the timestamp text between them
            continue
        if s in videos:
            segments.append(videos[s])
            video_end = videos[s].end
        elif marked[s] != 0:
            placeholders = int((types[s:e] == 1).sum())
            segments.append(Segment(s, e, "image", trained, image_marker(sample, k, e - s, tv, placeholders), image=k))
            k += 1
        elif special[s]:
            segments.append(Segment(s, e, "special", trained, tv.special[int(ids[s])]))
        else:
            segments.append(Segment(s, e, "text", trained, tv.decode(ids[s:e])))
    if k != len(sample.image_grid_thw):
        sample.warnings.append(f"{k} image placeholder runs but {len(sample.image_grid_thw)} image_grid_thw rows")
    return _split_messages(segments, ids, tv)


def _video_segments(sample: InspectedSample, types: np.ndarray, mask: np.ndarray, tv: TokenizerView) -> list[Segment]:
    """One segment per video: its placeholder runs (Qwen2/2.5-VL: one; Qwen3-VL: one per temporal patch, each after
    its `<t seconds>` text) matched to its grid row by token count, folded with the text between them into one block
    when that text shares the runs' loss mask (always, in a valid sample); otherwise each run is its own block."""
    idx = np.flatnonzero(types == 2)
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) > 1)
    bounds = list(zip(idx[np.r_[0, breaks + 1]].tolist(), (idx[np.r_[breaks, len(idx) - 1]] + 1).tolist()))
    # Without a merge size (a processor that names none), runs count as Qwen3-VL's (one per temporal patch) when that
    # accounts for them all, else as one per video.
    per_patch = len(bounds) == sum(v.grid_thw[0] for v in sample.videos)
    out, i, matched = [], 0, 0
    for k, video in enumerate(sample.videos):
        t, h, w = video.grid_thw
        want = t * h * w // tv.merge_size**2 if tv.merge_size else None
        runs = []
        while i < len(bounds) and (
            sum(b - a for a, b in runs) < want if want is not None else len(runs) < (t if per_patch else 1)
        ):
            runs.append(bounds[i])
            i += 1
        if not runs:
            break
        matched += 1
        got = sum(b - a for a, b in runs)
        text = video_marker(video, k, got, len(runs), want)
        a, b = runs[0][0], runs[-1][1]
        if len(set(mask[a:b].tolist())) == 1:
            out.append(Segment(a, b, "video", bool(mask[a]), text, video=k, runs=tuple(runs)))
        else:
            out += [
                Segment(
                    ra,
                    rb,
                    "video",
                    bool(mask[ra]),
                    text if j == 0 else run_marker(k, j, len(runs), rb - ra),
                    video=k,
                    runs=((ra, rb),),
                )
                for j, (ra, rb) in enumerate(runs)
            ]
    for a, b in bounds[i:]:
        out.append(Segment(a, b, "video", bool(mask[a]), f"[video: no grid row -> {b - a} tokens]", runs=((a, b),)))
    if i < len(bounds) or matched < len(sample.videos):
        sample.warnings.append(
            f"{len(bounds)} video placeholder runs do not match the {len(sample.videos)} videos' grid rows"
        )
    return out


def video_marker(video: InspectedVideo, k: int, n_tokens: int, n_runs: int, expected: int | None) -> str:
    """[video K: F of N frames at FPS fps, t = T0, T1, ... s | TxHxW patches -> X tokens (in R runs)]"""
    t, h, w = video.grid_thw
    ts = [f"{x:.2f}" for x in video.timestamps]
    if len(ts) > MAX_LISTED_TIMESTAMPS:
        ts = ts[:8] + ["..."] + ts[-4:]
    runs = f" in {n_runs} runs" if n_runs > 1 else ""
    bad = "" if expected in (None, n_tokens) else f", grid implies {expected}!"
    return (
        f"[video {k + 1}: {len(video.frame_indices)} of {video.total_num_frames} frames at {video.fps:g} fps, "
        f"t = {', '.join(ts)} s | {t}x{h}x{w} patches -> {n_tokens} tokens{runs}{bad}]"
    )


def run_marker(k: int, j: int, n_runs: int, n_tokens: int) -> str:
    """A video's placeholder run after its first, where it is shown apart from the others."""
    return f"[video {k + 1}, run {j + 1}/{n_runs}: {n_tokens} tokens]"


def image_marker(
    sample: InspectedSample, k: int, n_tokens: int, tv: TokenizerView, placeholders: int | None = None
) -> str:
    """The marker that stands for image k's whole unit: its patch grid (or, for a family without one, its stored size)
    and token count, flagged where the grid implies another count of placeholders (`placeholders`: those the unit
    holds; default all its tokens)."""
    grid = sample.image_grid_thw
    if k >= len(grid):
        return f"[image {k + 1}: no grid row -> {n_tokens} tokens]"
    t, h, w = (int(x) for x in grid[k])
    if not tv.grid:  # the grid row is the stored size
        return f"[image {k + 1}: {w}x{h} px -> {n_tokens} tokens]"
    patches = f"{h}x{w}" if t == 1 else f"{t}x{h}x{w}"
    expected = None if tv.merge_size is None else t * h * w // (tv.merge_size**2)
    got = n_tokens if placeholders is None else placeholders
    bad = "" if expected in (None, got) else f", grid implies {expected}!"
    return f"[image {k + 1}: {patches} patches -> {n_tokens} tokens{bad}]"


def _split_messages(segments: list[Segment], ids: np.ndarray, tv: TokenizerView) -> list[MessageView]:
    """A message starts at each turn-start token, and after each turn-end token (SmolVLM) and the blank text after
    it (the newline between turns stays with the turn it ends)."""
    messages: list[MessageView] = []
    cur: list[Segment] = []
    ended = opened_after_end = False
    for seg in segments:
        token = int(ids[seg.start]) if seg.kind == "special" else -1
        blank = seg.kind == "text" and not seg.text.strip()
        if cur and (token in tv.turn_starts or (ended and not blank)):
            messages.append(MessageView(_role(cur, ids, tv, opened_after_end), cur))
            cur, opened_after_end = [], ended
        cur.append(seg)
        ended = token in tv.turn_ends or (ended and blank)
    if cur:
        messages.append(MessageView(_role(cur, ids, tv, opened_after_end), cur))
    return messages


def _role(segs: list[Segment], ids: np.ndarray, tv: TokenizerView, after_end: bool = False) -> str:
    first = segs[0]
    if after_end and first.kind == "text":  # SmolVLM: `User:` / `Assistant:` after the turn end
        words = first.text.split()
        return words[0].rstrip(":") if words else "?"
    how = tv.turn_starts.get(int(ids[first.start])) if first.kind == "special" else None
    if how == "next":
        words = segs[1].text.split("\n", 1)[0].split() if len(segs) > 1 and segs[1].kind == "text" else []
        return words[0].rstrip(":") if words else "?"
    return how or "(no turn header)"


def view_sample(sample: InspectedSample, tv: TokenizerView) -> SampleView:
    """An InspectedSample -> its SampleView (messages cut into trained and masked segments)."""
    return SampleView(sample, segment_sample(sample, tv), tv)


def header_line(v: SampleView) -> str:
    """The sample's header line: key, id and where it came from."""
    s = v.sample
    return f"=== sample {s.key}  id {s.id}  ({s.where}) ==="


def message_line(m: MessageView) -> str:
    """A message's header line: its role and how many of its tokens train."""
    trained = f" ({m.num_trained}/{m.num_tokens} tokens trained)" if m.num_trained else ""
    return f"--- {m.role}{trained} ---"


def fact_lines(v: SampleView) -> list[str]:
    """The lines under a sample: token counts and trained share, truncation and what it dropped, split and context
    messages, unrendered tool calls, warnings."""
    s = v.sample
    ratio = v.num_trained / max(v.num_tokens, 1)
    if s.truncated:
        dropped = f"{s.dropped_images} image{'s' if s.dropped_images != 1 else ''} dropped by the cut"
        if s.dropped_videos:
            dropped += f", {s.dropped_videos} video{'s' if s.dropped_videos != 1 else ''} dropped"
        trunc = f"truncated: yes, {s.num_tokens_before_truncation} -> {v.num_tokens} tokens, {dropped}"
    else:
        trunc = "truncated: no"
    lines = [
        f"tokens {v.num_tokens} | trained {v.num_trained} ({ratio:.1%}) | image tokens {v.num_image_tokens}"
        f" | images {v.num_images}"
        + (f" | video tokens {v.num_video_tokens} | videos {len(s.videos)}" if s.videos or v.num_video_tokens else ""),
        f"{trunc} | source {s.source[0]}:{s.source[1]}",
    ]
    if s.split is not None or s.removed_images:
        context = [i for i in s.messages if i not in s.trains]
        parts = [
            f"split: sample {s.split} of its record" if s.split is not None else "not split",
            f"trains messages {_ranges(s.trains)}",
            f"context messages {_ranges(context)}",
        ]
        if s.removed_images:
            parts.append(f"images removed by --keep-images {_ranges(s.removed_images)}")
        lines.append(" | ".join(parts))
    if s.unrendered_tool_calls:
        lines.append(
            f"note: {s.unrendered_tool_calls} turn(s) with tool_calls that the chat template does not "
            "render, so the model never sees them (build --tool-calls)"
        )
    lines += [f"WARNING: {w}" for w in s.warnings]
    return lines


def reject_line(r: dict) -> str:
    """One reject as a line: source file and line, id, reason and message."""
    src = r.get("source") or {}
    rid = f"  id {r['id']}" if r.get("id") is not None else ""
    return f"rejected  {src.get('file')}:{src.get('line')}{rid}  {r.get('reason')}: {r.get('message')}"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5" (input message or image indices)."""
    out, run = [], []
    for x in sorted(xs):
        if run and x == run[-1] + 1:
            run.append(x)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [x]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out) or "none"


def _turn_starts(processor_class: str | None) -> dict[str, str]:
    family = family_of(processor_class)
    return family.turn_starts if family is not None and family.turn_starts else ANY_TURN_STARTS


def _turn_ends(processor_class: str | None) -> tuple[str, ...]:
    family = family_of(processor_class)
    return family.turn_ends if family is not None else ()


def _grid(processor_class: str | None) -> bool:
    """Whether the family's grid rows are patch grids (an unknown class: as they are stored, checked as grids)."""
    family = family_of(processor_class)
    return family is None or family.grid_images
