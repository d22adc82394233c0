"""Data types named by their place in the flow:
RawRecord -> Conversation -> RenderedSample -> ShardSample, plus RecordError for rejects.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from vlmprep.rejects import REASONS
from vlmprep_schemas.limits import json_depth


class UserError(Exception):
    """A fault the user can fix (bad option, missing input, --strict stop): printed as one line, exit 1."""


class ManifestError(UserError):
    """A UserError that carries the dataset's manifest (the command prints its summary before the line)."""

    def __init__(self, message: str, manifest):
        super().__init__(message)
        self.manifest = manifest

    def __reduce__(self):  # pickles (a pool or Ray worker may raise it): Exception's default would drop `manifest`
        return type(self), (str(self), self.manifest)


_ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-fA-F]+")


def deterministic_message(message: str) -> str:
    """Drops object addresses (`<_io.BytesIO object at 0x7f...>`) that a library error may carry, so the same bad
    record writes the same rejects.jsonl line in every build; a lone surrogate quoted from the record becomes the
    text `\\udc00`, so the line can always be written and printed."""
    return printable(_ADDRESS.sub("", message))


def printable(text: str) -> str:
    """`text` with each lone surrogate (which no file or terminal can encode) spelled as `\\udXXX`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RecordError(Exception):
    """A bad record: rejected with a stable reason code, counted, never fatal unless --strict."""

    def __init__(self, reason: str, message: str):
        if reason not in REASONS:  # a programming error: every reason is documented (docs/rejects.md)
            raise ValueError(f"unknown reject reason {reason!r}: add it to vlmprep/rejects.py REASONS")
        message = deterministic_message(message)
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    def __reduce__(self):
        # Crosses process boundaries (pool workers, Ray): Exception's default pickles self.args, the one joined
        # string, which __init__ cannot be called with.
        return type(self), (self.reason, self.message)


def json_value(text: str | bytes, *, max_depth: int, what: str):
    """JSON text from a record (a line, a JSON string column, tool-call arguments) -> its value; a RecordError
    (json_too_deep) naming `what` where [ and { nest deeper than `max_depth`, found as it is parsed: the parser stops
    at Python's stack (10^5 levels), and what it made is measured without recursion (json_nesting) before any stage
    recurses over it. Text that is not JSON raises the parser's ValueError."""
    try:
        value = json.loads(text)
    except RecursionError:
        depth = json_depth(text, 0)  # counted on the text: the parser gave up
    else:
        depth = json_nesting(value)
    if depth > max_depth:
        raise RecordError("json_too_deep", f"{what} nests {depth} levels deep > max_json_depth={max_depth}")
    return value


def json_nesting(value) -> int:
    """How deep [ and { nest in a parsed JSON value (0 for a scalar), walked level by level without recursion, its
    containers only: under 1 ms for a 600 KB agent trace, a fraction of parsing it (a second pass over the text, to
    count before parsing, cost 4x the parse)."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level:
        depth, below = depth + 1, []
        for node in level:
            below.extend(v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list)))
        level = below
    return depth


@dataclass(frozen=True)
class Source:
    """Where a record came from: its file, its line (or array index), and the input name its generated id uses."""

    file: str
    line: int  # 1-based line (jsonl), array index (json) or row (a Parquet / Arrow table)
    input_name: str = ""  # the file's path relative to the inputs' common parent: the stem of generated ids


@dataclass
class RawRecord:
    """One input line, not yet parsed: parsing happens in workers so a bad line is just a reject."""

    source: Source
    position: int  # global input position; fixes output order whatever the worker count
    text: bytes | None = None  # the raw line
    data: Any = None  # already-parsed object (from a .json array file)
    error: RecordError | None = None  # file-level reader fault attached to this position
    offset: int = 0  # where the line starts in the (decompressed) file, .json: item index; a task plan cuts here
    size: int = 0  # its bytes: the plan balances tasks by them
    unread_bytes: int = 0  # a file-level fault: the input bytes from the fault on, which no record was read from
    row: bool = False  # `data` is a table row (tables.py): its layout is converted when parsed, in the worker


@dataclass(frozen=True)
class ImageData:
    """Source bytes of one image, already fetched (data URI decoded or file read)."""

    data: bytes
    origin: str  # "data-uri", a path, or a URL: for messages only


@dataclass(frozen=True, kw_only=True)
class VideoData:
    """One video part, fetched: a container file's bytes, or frame images taken at `fps`; plus the part's own
    sampling and pixel options (None: the build-wide default, else the video processor's own)."""

    data: bytes | None = None  # container bytes (a path's file or a data URI)
    frames: tuple[ImageData, ...] = ()  # a video given as a list of frame images
    origin: str = ""  # "data-uri", a path, or "frames": for messages only
    fps: float | None = None  # a file: frames sampled per second; a frame list: the rate the frames were taken at
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None


@dataclass
class Part:
    """One content part of a message: text, an image or a video."""

    type: str  # "text" | "image" | "video"
    text: str | None = None
    image: ImageData | None = None
    video: VideoData | None = None


@dataclass
class ToolCall:
    """One tool call of an assistant message: its id, the function name and the arguments as the record gave them."""

    id: str | None
    name: str
    arguments: str | dict  # as the record gave it: a JSON string (printed verbatim by templates) or an object

    @property
    def arguments_json(self) -> str:
        """The arguments as a JSON string (the record's own string, verbatim, where it gave one)."""
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Message:
    """One normalized message: role, typed content parts, tool calls, and the fields that steer masking (weight,
    reasoning)."""

    role: str  # system | user | assistant | tool
    parts: list[Part]
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    weight: int | None = None  # OpenAI fine-tuning per-message weight (0|1); None = role rule
    reasoning: str | None = None  # an assistant's reasoning_content (or reasoning): its thinking before the answer

    @property
    def text(self) -> str:
        """The message's text parts joined."""
        return "".join(p.text or "" for p in self.parts if p.type == "text")

    @property
    def images(self) -> list[ImageData]:
        """The message's images, in order."""
        return [p.image for p in self.parts if p.type == "image" and p.image is not None]

    @property
    def videos(self) -> list[VideoData]:
        """The message's videos, in order."""
        return [p.video for p in self.parts if p.type == "video" and p.video is not None]


@dataclass
class Conversation:
    """A normalized record (normalize_record's output): its id, source, messages and tools."""

    id: str
    source: Source
    messages: list[Message]
    tools: list[dict] | None = None

    @property
    def images(self) -> list[ImageData]:
        """Every image of the conversation, in message order."""
        return [im for m in self.messages for im in m.images]

    @property
    def videos(self) -> list[VideoData]:
        """Every video of the conversation, in message order."""
        return [v for m in self.messages for v in m.videos]


class PreparedImage:
    """An image as the processor's own resize stores it: these exact pixels (uint8 H x W x 3) fix its grid. The grid,
    and so the image's tokens, is known from the source's header alone (images.open_image); the pixels are made on
    first use, once, so an image that no sample keeps is never decoded, nor one stored as its source bytes (its
    source is only checked: check_source)."""

    def __init__(
        self,
        *,
        grid_thw: tuple[int, int, int],
        source: ImageData | None,
        pixels: np.ndarray | None = None,
        load: Callable[[], np.ndarray] | None = None,
        digest: str | None = None,
        source_size: tuple[int, int] = (0, 0),
        shape: tuple[int, int] | None = None,
    ):
        assert (pixels is None) != (load is None), "a PreparedImage holds its pixels or the way to make them"
        self.grid_thw = grid_thw
        self.source = source
        self.source_size = source_size  # (width, height) upright, before the processor's resize; (0, 0): unknown
        self.keep: str | None = None  # the extension a lossy source is stored under as it is (jpg, webp)
        self._pixels = pixels
        self._load = load
        self._digest = digest
        self._shape = shape
        self._check: Callable[[], None] | None = None
        self._make_views: Callable[[], "Views | None"] | None = None
        self._views: "Views | None" = None

    def keep_as(self, ext: str | None, check: Callable[[], None] | None = None) -> "PreparedImage":
        """Mark the source as one whose bytes can be stored as they are (a lossy source: images._lossy_ext), under
        extension `ext` (None: not), with `check`, what check_source runs (None: the pixels are made)."""
        self.keep, self._check = ext, check
        return self

    @property
    def pixels(self) -> np.ndarray:
        """The resized pixels, decoded on first access (a fault raises a RecordError here, on every access)."""
        if self._pixels is None:
            self._pixels = self._load()  # a fault raises here, and again on the next access
            self._load = None
        return self._pixels

    @property
    def shape(self) -> tuple[int, int]:
        """(height, width) of the resized pixels, as the header predicted them: nothing is decoded for it."""
        if self._pixels is not None or self._shape is None:
            return tuple(self.pixels.shape[:2])
        return self._shape

    def views_from(self, make: Callable[[], "Views | None"]) -> "PreparedImage":
        """Mark the image as one whose views (vlmprep_schemas.views) may be stored beside its kept source: `make`
        decodes the source and returns them, or None where the processor's output from them would differ."""
        self._make_views = make
        return self

    @property
    def may_have_views(self) -> bool:
        """Whether views_from marked it (its views are then made by make_views)."""
        return self._make_views is not None or self._views is not None

    def make_views(self) -> "Views | None":
        """The views, made once (a decode of the source: a fault raises its RecordError here, as a decode would)."""
        if self._make_views is not None:
            self._views, self._make_views = self._make_views(), None
        return self._views

    def check_source(self) -> None:
        """Raise the RecordError a decode of the source would (a check that makes no pixels, images.check_decode,
        where the image has one; else its pixels are made): what a store of the source bytes needs, once."""
        if self._pixels is not None:
            return
        if self._check is None:
            _ = self.pixels
            return
        self._check()  # a fault raises here, and again on the next call
        self._check = lambda: None

    @property
    def loaded(self) -> bool:
        """Whether the pixels were decoded (a counter of the work done, for tests and benchmarks)."""
        return self._pixels is not None

    @property
    def digest(self) -> str:
        """sha256 of the source bytes (made once): identical images in a sample are stored once."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.source.data).hexdigest()
        return self._digest


@dataclass(frozen=True)
class Views:
    """A kept photo's two views packed in one array (vlmprep_schemas.views.pack): the processor's canvas and global
    view, (height, width) each."""

    packed: np.ndarray  # uint8 H x W x 3
    canvas: tuple[int, int]
    glob: tuple[int, int]


@dataclass
class PreparedVideo:
    """A video sampled and resized as the model's video processor does: these frames fix its grid and tokens."""

    frames: np.ndarray  # uint8 T x H x W x 3, the sampled frames after the processor's resize (T not padded)
    grid_thw: tuple[int, int, int]  # t = ceil(T / temporal_patch_size)
    fps: float  # the source's frame rate (a frame list: the rate it was given)
    total_num_frames: int  # frames in the source
    frame_indices: list[int]  # source frame of each stored frame
    source: VideoData


@dataclass
class RenderedSample:
    """Token-level view of one conversation, aligned arrays of length L."""

    id: str
    source: Source
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    mm_token_type_ids: np.ndarray  # uint8 [L]
    position_ids: np.ndarray  # int32 [3, L]
    image_grid_thw: np.ndarray  # int32 [N, 3]
    images: list[PreparedImage]
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each image's whole wrapper
    video_grid_thw: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int32))  # int32 [V, 3]
    second_per_grid_ts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # float32 [V]
    videos: list[PreparedVideo] = field(default_factory=list)
    video_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each video's whole expansion
    num_tokens_before_truncation: int = 0
    truncated: bool = False
    dropped_images: int = 0
    dropped_videos: int = 0
    unrendered_tool_calls: int = 0  # assistant turns whose tool_calls the template did not render
    turn_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (message, first, end) trained token spans
    reasoning_rendered: list[int] = field(default_factory=list)  # messages whose reasoning the template printed
    # Where the sample came from in its record (set by the pipeline): the input messages it holds, those it trains,
    # the input image occurrences the history policy removed, and its number when the record was split.
    source_messages: list[int] = field(default_factory=list)
    trains: list[int] = field(default_factory=list)
    removed_images: list[int] = field(default_factory=list)
    split: int | None = None


@dataclass
class ShardSample:
    """Encoded tar members of one sample: {extension: bytes}; plus counts for the manifest."""

    key: str
    members: dict[str, bytes]
    num_tokens: int
    num_trainable_tokens: int
    num_images: int
    meta: dict
