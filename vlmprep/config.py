"""BuildConfig: every `vlmprep build` option declared once (default, help, --help group: options.py), validated once;
the CLI's options are generated from it and it is written into the manifest as resolved. InspectConfig: the same for
`vlmprep inspect`'s own options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmprep.options import AGENT, IMAGES, INPUT, KEEP_IMAGES, LIMITS, OUTPUT, OWN, RENDER, ROLE_LIST, ROLES, SCALE, opt
from vlmprep.processors.builtin import builtin_names
from vlmprep.processors.load import bundled_templates, resolve_chat_template

IMAGE_FORMATS = ("auto", "zstd-pdelta", "zstd-delta", "zstd", "png", "webp", "original")
EOS_POLICIES = ("all", "turn", "last", "none")
TOOL_CALL_POLICIES = ("reject", "drop-from-loss", "train-content")
REASONING_POLICIES = ("train", "context", "drop", "reject")
LONG_TRACES = ("truncate", "split")
EXECUTORS = ("local", "ray")
REQUIRED = dataclasses.MISSING


def check_mask_policy(train_on_eos: str, tool_calls: str, reasoning: str) -> None:
    """The masking policy's choices, checked here for BuildConfig and mask.MaskPolicy alike."""
    for name, value, allowed in (
        ("train_on_eos", train_on_eos, EOS_POLICIES),
        ("tool_calls", tool_calls, TOOL_CALL_POLICIES),
        ("reasoning", reasoning, REASONING_POLICIES),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")


_BUILTINS = " | ".join(f"builtin:{n}" for n in builtin_names())


EXECUTOR_HELP = "Who runs the tasks: local (--workers processes) | ray (pip install 'vlmprep\\[ray]')."
IMAGE_FORMAT_HELP = (
    "How images are stored: auto (per image: a lossy photo as its source bytes where its pixels would be much larger, "
    "every other image zstd-pdelta), zstd-pdelta (lossless, each image compressed against the sample's previous one), "
    "zstd-delta, zstd, png, webp or original (see docs/shard-format.md)."
)


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Every `vlmprep build` option, each declared once here with its default, group and help (`opt(...)`): the CLI
    options, `--help` and the manifest's config are generated from these fields. Frozen; `__post_init__` runs the
    named `_check_*` checks, so a bad value is a one-line error naming the fix. The manifest stores `to_json()`, the
    options that change the output bytes."""

    # Declared in `vlmprep build --help` order; the manifest's config is key-sorted, so the order never shows there.
    out: str = opt(
        REQUIRED,
        OUTPUT,
        "Output dataset dir (shards, manifest, processor), or a store's prefix (s3://, "
        "gs://, hf://): built in a local stage ($VLMPREP_STAGE), uploaded as it lands.",
        cli_type=str,
    )
    inputs: tuple[str, ...] = opt(
        REQUIRED,
        INPUT,
        "Input .jsonl / .jsonl.zst / .json / .parquet / .arrow files, globs "
        "or dirs, local or s3:// gs:// hf:// https:// URLs (optional with --task-index when "
        "DIR/plan.json exists).",
        flag="--in",
        cli_type=list[str],
    )
    image_root: str | None = opt(
        None, INPUT, "Local image paths must resolve inside this dir (default: each input file's dir)."
    )
    allow_remote: bool = opt(False, INPUT, "Allow fetching http(s) image URLs.")
    # What a record renders to, and the masking policy (docs/families-and-masking.md).
    processor: str = opt(
        "builtin:qwen2-vl",
        RENDER,
        f"{_BUILTINS} | tiny:NAME (a family's classes over a small "
        "vocabulary: for trying it and tests, never real training) | a local processor dir | a hub "
        "id.",
    )
    seq_len: int = opt(8192, RENDER, "Max tokens per sample; cuts never split an image.")
    train_on_roles: tuple[str, ...] = opt(
        ("assistant",),
        RENDER,
        f"Comma list of roles whose text is trained: {', '.join(ROLES)}.",
        spelled=ROLE_LIST,
    )
    train_on_eos: str = opt("turn", RENDER, "End-of-turn tokens trained.", choices=EOS_POLICIES)
    last_turn_only: bool = opt(False, RENDER, "Train only the last trained turn of each record.")
    tool_calls: str = opt(
        "reject", RENDER, "A trained turn whose tool_calls the template does not render.", choices=TOOL_CALL_POLICIES
    )
    reasoning: str = opt(
        "train",
        RENDER,
        "An assistant's reasoning_content: train (rendered, trained) | context "
        "(rendered, not trained) | drop (removed, counted) | reject.",
        choices=REASONING_POLICIES,
    )
    chat_template: str | None = opt(
        None,
        RENDER,
        "A .jinja file or a bundled template's name "
        f"({', '.join(bundled_templates())}) replacing the processor's chat template "
        "(saved with the dataset).",
    )
    role_boundaries: str | None = opt(
        None, RENDER, "TOML of per-role start/end markers, for processors vlmprep does not know."
    )
    image_format: str = opt("auto", IMAGES, IMAGE_FORMAT_HELP, choices=IMAGE_FORMATS)
    # The image processor's resize budget and the video sampling (docs/video.md), saved into DIR/processor; a video
    # part's own fps / max_frames win. None: the processor's own.
    min_pixels: int | None = opt(None, IMAGES, "Image resize budget: min pixels per image (saved into DIR/processor).")
    max_pixels: int | None = opt(None, IMAGES, "Image resize budget: max pixels per image (saved into DIR/processor).")
    video_fps: float | None = opt(
        None,
        IMAGES,
        "Video frames sampled per second, unless a part sets fps (saved into "
        "DIR/processor; default: the processor's, else 2).",
    )
    video_max_frames: int | None = opt(
        None, IMAGES, "Most frames sampled from a video, unless a part sets max_frames (saved into DIR/processor)."
    )
    # Agent traces (docs/build.md): what a record longer than seq_len becomes, the screenshot history kept.
    # split by default: truncation silently drops the later turns of every long trace (docs/build.md says why).
    long_traces: str = opt(
        "split",
        AGENT,
        "A record longer than --seq-len: split (step samples, every trained turn "
        "kept) | truncate (cut the end, its turns lost).",
        choices=LONG_TRACES,
    )
    keep_images: int | None = opt(
        None,
        AGENT,
        "Screenshot history per sample: all | last:N (earlier images removed).",
        spelled=KEEP_IMAGES,
    )
    dropped_image_text: str | None = opt(
        None, AGENT, "Text that replaces each image --keep-images removes (default: dropped)."
    )
    strict: bool = opt(False, LIMITS, "Stop at the first rejected record.")
    # More rejected records than this share is an error (exit 1) after everything is written: a wrong template or
    # option must not pass as a finished dataset.
    max_reject_fraction: float = opt(
        0.05,
        LIMITS,
        "Exit 1 (after writing everything) when more than this share of the "
        "records is rejected, naming the fix; 1 = never.",
        bounds=(0.0, 1.0),
    )
    # Fewer trained turns than this share is an error the same way: lost turns are as silent as rejected records.
    min_turn_coverage: float = opt(
        0.95,
        LIMITS,
        "Exit 1 (after writing everything) when fewer than this share of the assistant turns to train land in a "
        "sample (lost to --seq-len), naming the fix; 0 = never.",
        bounds=(0.0, 1.0),
    )
    allow_empty: bool = opt(False, LIMITS, "Exit 0 even when every record is rejected (0 samples).")
    max_image_pixels: int = opt(64_000_000, LIMITS, "Reject images whose declared size exceeds this.")  # bomb guard
    # Input files are read whole: a huge file, or a device / FIFO named as an image or a video, must not be.
    max_image_bytes: int = opt(64 << 20, LIMITS, "Reject image files (local or --allow-remote) larger than this.")
    max_video_bytes: int = opt(512 << 20, LIMITS, "Reject video files larger than this.")
    max_images_per_record: int = opt(64, LIMITS, "Reject records with more images.")
    # Counted before rendering (a table's lists before a row is converted): 10^6 messages fit a few KB of a table.
    max_messages_per_record: int = opt(10_000, LIMITS, "Reject records with more messages.")
    # Found as a record's JSON is parsed (a line, a JSON string cell): parsing, and stages after it, recurse per level.
    max_json_depth: int = opt(64, LIMITS, "Reject records whose JSON (and JSON strings in it) nests deeper ([ and {).")
    max_line_bytes: int = opt(256 * 1024 * 1024, LIMITS, "Reject input lines longer than this.")
    max_zstd_window: int = opt(1 << 27, LIMITS, "Max zstd window (bytes) an input may demand.")  # zstd's own cap
    min_image_side: int = opt(4, LIMITS, "Reject images with a side shorter than this (pixels).")  # upsampled noise
    # 1, not zstd's 3: on filtered pixels its fast strategy is ~1.6x quicker and as small (docs/performance.md).
    zstd_level: int = opt(
        1,
        None,
        "zstd level of images and video frames stored as zstd-delta or zstd, at least 5 "
        "for zstd-pdelta images stored against the one before (library only, no flag).",
    )
    samples_per_shard: int = opt(1000, OUTPUT, "Max samples per shard.")
    shard_size_mb: float = opt(512.0, OUTPUT, "Max shard size in MiB.")
    overwrite: bool = opt(
        False,
        OUTPUT,
        "Replace a dataset built with other options in --out, or build beside files that are not a dataset's.",
    )
    progress: bool = opt(True, OUTPUT, "Show a progress bar.")
    append: bool = opt(  # docs/datasets-that-grow.md: the new inputs alone, committed as DIR's next version
        False,
        OUTPUT,
        "Add the --in inputs to the dataset in --out as its next version (DIR/versions/vN.json; manifest.json "
        "names the latest): only they are built, with the dataset's processor and options (not given: taken from "
        "it; given: must equal it, unless marked per version); an id already in it is a duplicate_id reject.",
    )
    # Scale out (docs/scale-out.md): the input cut into `tasks` fixed tasks (plan.json), run by an executor or one
    # at a time with task_index (a Slurm array / indexed job), then merged.
    workers: int = opt(1, SCALE, "Worker processes; output is identical for any value.")
    tasks: int = opt(1, SCALE, "Cut the input into this many fixed tasks (DIR/plan.json); 1 = one task.")
    task_index: int | None = opt(
        None, SCALE, "Run only this task of DIR/plan.json (a Slurm array / indexed job); then `vlmprep merge DIR`."
    )
    plan_only: bool = opt(False, SCALE, "Write DIR/plan.json (and DIR/processor) and stop.")
    executor: str = opt("local", SCALE, EXECUTOR_HELP, choices=EXECUTORS)
    ray_address: str | None = opt(
        None, SCALE, "Ray cluster to join (default: $RAY_ADDRESS, else a local cluster of --workers CPUs)."
    )

    def __post_init__(self):
        for check in (
            self._check_sizes,
            self._check_limits,
            self._check_policy,
            self._check_agent,
            self._check_pixels,
            self._check_scale,
            self._check_paths,
        ):
            check()

    def _check_sizes(self) -> None:
        if not self.inputs:
            raise ValueError("inputs is empty: pass at least one --in PATH")
        if self.seq_len < 16:
            raise ValueError(f"seq_len={self.seq_len} is too small: use --seq-len >= 16")
        if self.image_format not in IMAGE_FORMATS:
            raise ValueError(f"image_format={self.image_format!r}: choose one of {', '.join(IMAGE_FORMATS)}")
        if self.samples_per_shard < 1:
            raise ValueError(f"samples_per_shard={self.samples_per_shard}: must be >= 1")
        if self.shard_size_mb <= 0:
            raise ValueError(f"shard_size_mb={self.shard_size_mb}: must be > 0")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: must be >= 1")

    def _check_limits(self) -> None:
        sizes = (self.max_image_pixels, self.max_line_bytes, self.min_image_side, self.max_image_bytes)
        if self.max_images_per_record < 0 or min(*sizes, self.max_video_bytes, self.max_messages_per_record) < 1:
            raise ValueError(
                "limits must be positive: check --max-images-per-record, --max-image-pixels, --max-line-bytes, "
                "--min-image-side, --max-image-bytes, --max-video-bytes, --max-messages-per-record"
            )
        if not (1 << 10) <= self.max_zstd_window <= (1 << 31):
            raise ValueError(f"max_zstd_window={self.max_zstd_window}: must be between 1 KiB and 2 GiB")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level}: must be in -7..22")
        if not 8 <= self.max_json_depth <= 256:  # parsing recurses once per level; Python's stack holds ~1000
            raise ValueError(f"max_json_depth={self.max_json_depth}: must be in 8..256, e.g. --max-json-depth 64")
        if self.max_images_per_record > 999:
            raise ValueError(
                f"max_images_per_record={self.max_images_per_record}: at most 999 images per record "
                "(image members are img000..img999)"
            )
        if not 0 <= self.max_reject_fraction <= 1:
            raise ValueError(
                f"max_reject_fraction={self.max_reject_fraction}: must be in 0..1 (1 = never fail on "
                "rejects), e.g. --max-reject-fraction 0.05"
            )
        if not 0 <= self.min_turn_coverage <= 1:
            raise ValueError(
                f"min_turn_coverage={self.min_turn_coverage}: must be in 0..1 (0 = never fail on lost "
                "turns), e.g. --min-turn-coverage 0.95"
            )

    def _check_policy(self) -> None:
        if not self.train_on_roles or set(self.train_on_roles) - set(ROLES):
            raise ValueError(
                f"train_on_roles={list(self.train_on_roles)}: use a comma list of {', '.join(ROLES)}, "
                "e.g. --train-on-roles assistant,tool"
            )
        check_mask_policy(self.train_on_eos, self.tool_calls, self.reasoning)

    def _check_agent(self) -> None:
        if self.long_traces not in LONG_TRACES:
            raise ValueError(f"long_traces={self.long_traces!r}: choose one of {', '.join(LONG_TRACES)}")
        if self.keep_images is not None and self.keep_images < 0:
            raise ValueError(f"keep_images={self.keep_images}: use --keep-images last:N with N >= 0, or all")
        if self.dropped_image_text is not None and self.keep_images is None:
            raise ValueError("--dropped-image-text replaces images that --keep-images last:N removes: pass both")

    def _check_pixels(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v}: must be a positive pixel count, e.g. --max-pixels 1003520")
        if self.video_fps is not None and not 0 < self.video_fps <= 1000:
            raise ValueError(
                f"video_fps={self.video_fps}: must be a positive rate in frames per second, e.g. --video-fps 2"
            )
        if self.video_max_frames is not None and self.video_max_frames < 2:
            raise ValueError(
                f"video_max_frames={self.video_max_frames}: must be >= 2 (one temporal patch), e.g. "
                "--video-max-frames 64"
            )
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}: swap them")

    def _check_scale(self) -> None:
        if self.tasks < 1:
            raise ValueError(f"tasks={self.tasks}: must be >= 1 (1 = one task, today's single-machine build)")
        if self.task_index is not None and not 0 <= self.task_index < self.tasks:
            raise ValueError(f"task_index={self.task_index}: must be in 0..{self.tasks - 1} for --tasks {self.tasks}")
        if self.task_index is not None and self.plan_only:
            raise ValueError("--plan-only writes the plan and runs no task: drop --task-index")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}: choose one of {', '.join(EXECUTORS)}")
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError("--ray-address is for --executor ray: pass both")
        if self.append and self.overwrite:
            raise ValueError("--append adds a version to the dataset, --overwrite replaces it: pass one of them")

    def _check_paths(self) -> None:
        if self.chat_template is not None:
            resolve_chat_template(self.chat_template)  # a file, or a bundled template's name
        if self.image_root is not None and not Path(self.image_root).is_dir():
            raise ValueError(
                f"--image-root {self.image_root}: no such directory; pass the dir the image paths are under"
            )
        if self.role_boundaries is not None and not Path(self.role_boundaries).is_file():
            raise ValueError(
                f"--role-boundaries {self.role_boundaries}: no such file; pass the path of an existing file"
            )

    @classmethod
    def from_plan(cls, config: dict, **run) -> "BuildConfig":
        """The config a plan was made with, plus the run-only fields (out, workers, progress, task_index ...), for
        running its tasks. Without the --chat-template path: the processor saved with the plan carries the template,
        so a task on another machine or in another directory never needs that file."""
        d = dict(
            config, inputs=tuple(config["inputs"]), train_on_roles=tuple(config["train_on_roles"]), chat_template=None
        )
        return cls(**d, **run)

    def to_json(self) -> dict:
        """The options that change the output bytes, as written into manifest.json (and plan.json): display, worker
        count, the output dir, the exit-code rules and how tasks are run are left out, so the same data built
        elsewhere, with other workers or another executor, has the same manifest."""
        d = dataclasses.asdict(self)
        d["inputs"] = list(self.inputs)
        d["train_on_roles"] = list(self.train_on_roles)
        # Display, worker count, the exit-code rule, the output dir and how tasks are run never change the bytes, so
        # a copy, a rebuild elsewhere or another executor stays byte-identical (the task count does change them).
        for k in (
            "progress",
            "workers",
            "out",
            "allow_empty",
            "max_reject_fraction",
            "min_turn_coverage",
            "overwrite",
            "task_index",
            "plan_only",
            "executor",
            "ray_address",
            "append",
        ):
            d.pop(k)
        return d


FIELDS = {f.name: f for f in dataclasses.fields(BuildConfig)}
# What may differ between the versions of one dataset (`build --append`; --help marks them): never what a record
# renders to. Any other option is the dataset's own: an append that sets it otherwise is refused (builder/append.py).
PER_VERSION = frozenset(
    ("out", "inputs", "image_root", "strict", "max_reject_fraction", "min_turn_coverage", "allow_empty")
    + ("samples_per_shard", "shard_size_mb", "overwrite", "progress", "append", "workers", "tasks", "task_index")
    + ("plan_only", "executor", "ray_address")
)


def default(name: str):
    """An option's one declared default (its BuildConfig field's), for the library classes and signatures that take
    the option: tests/vlmprep/test_defaults.py holds every library default of an option to it."""
    assert FIELDS[name].default is not REQUIRED, f"{name} has no default"
    return FIELDS[name].default


def spelled(name: str, value) -> str:
    """A resolved config value as the user types it (`last:3`, `assistant,tool`), "not set" for an unset one."""
    show = FIELDS[name].metadata["show"] if name in FIELDS else None
    if show is not None:
        return show(value)
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "on" if value else "off"
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def spelled_flag(name: str, value) -> str:
    """`--keep-images last:3`, `--no-allow-remote`, `--chat-template not set`: an option as the user writes it."""
    flag = (FIELDS[name].metadata["flag"] if name in FIELDS else "") or "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {spelled(name, value)}"


# The build options `vlmprep inspect` takes on raw input (in its --help order): those that change what a record
# renders to.
RAW_OPTIONS = (
    ("processor", "seq_len", "train_on_roles", "train_on_eos", "last_turn_only", "tool_calls", "reasoning")
    + ("chat_template", "role_boundaries", "image_root", "allow_remote", "long_traces", "keep_images")
    + ("dropped_image_text", "min_pixels", "max_pixels")
)
ONLY = ("truncated", "rejected")  # inspect --only


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """The options of `vlmprep inspect`, each declared once here (its --help is generated from these fields): what to
    show (input file or dataset dir, by index, id or shard; how many), and how (token table, HTML report)."""

    path: str  # the command's argument: a built dataset dir, or raw input
    index: int | None = opt(
        None, OWN, "The record at this 0-based input position (= its shard key); found through the sample index."
    )
    id: str | None = opt(
        None, OWN, "The sample with this id; found through the sample index, reading only that sample.", flag="--id"
    )
    shard: str | None = opt(None, OWN, "Only this shard of a built dir, e.g. shard-000001.")
    limit: int = opt(3, OWN, "Show at most this many samples (or rejects).")
    only: str | None = opt(None, OWN, "truncated | rejected (raw input: why build would reject it).")
    tokens: bool = opt(False, OWN, "A table of token index, id, mask, type id and piece.", flag="--tokens")
    html: str | None = opt(None, OWN, "Write a self-contained HTML report to this file instead.")
    # Raw input only: `like` (a built dir whose resolved config and saved processor are reused) and the build options
    # given (RAW_OPTIONS: those that change what a record renders to), else build's defaults. They are declared once,
    # on BuildConfig; "keep_images": "all" overrides like's last:N.
    like: str | None = opt(None, OWN, "Raw input: render with this built dir's processor and build options.")
    build_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.build_options) - set(RAW_OPTIONS))
        if unknown:
            raise ValueError(f"build_options {unknown}: inspect takes only {', '.join(RAW_OPTIONS)}")
        if self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be >= 1")
        if self.index is not None and self.index < 0:
            raise ValueError(f"index={self.index}: must be >= 0 (the record's 0-based input position)")
        if self.only is not None and self.only not in ONLY:
            raise ValueError(f"only={self.only!r}: choose one of {', '.join(ONLY)}")
        if self.only == "rejected" and self.tokens:
            raise ValueError("--tokens shows samples; it cannot be combined with --only rejected")


INSPECT_FIELDS = {f.name: f for f in dataclasses.fields(InspectConfig) if f.metadata}
