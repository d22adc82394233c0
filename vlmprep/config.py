"""BuildConfig: every `vlmprep build` option, validated once; written into the manifest as resolved."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from vlmprep.processors.load import resolve_chat_template

IMAGE_FORMATS = ("zstd", "png", "webp", "original")
ROLES = ("system", "user", "assistant", "tool")
EOS_POLICIES = ("all", "turn", "last", "none")
TOOL_CALL_POLICIES = ("reject", "drop-from-loss", "train-content")
REASONING_POLICIES = ("train", "context", "drop", "reject")
LONG_TRACES = ("truncate", "split")
EXECUTORS = ("local", "ray")


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    inputs: tuple[str, ...]
    out: str
    processor: str = "builtin:qwen2-vl"
    seq_len: int = 8192
    image_format: str = "zstd"
    samples_per_shard: int = 1000
    shard_size_mb: float = 512.0
    workers: int = 1
    allow_remote: bool = False
    image_root: str | None = None  # local image paths must resolve inside it; default: each input file's dir
    strict: bool = False
    max_image_pixels: int = 64_000_000  # decompression-bomb guard on the declared size
    max_images_per_record: int = 64
    max_line_bytes: int = 256 * 1024 * 1024
    max_zstd_window: int = 1 << 27  # bytes of decoder window a .zst input may demand (zstd's own default cap)
    min_image_side: int = 4  # smaller images carry no signal and upsample into noise
    zstd_level: int = 3
    progress: bool = True
    allow_empty: bool = False  # a build that writes 0 samples is an error (exit 1) unless this is set
    # More rejected records than this share of the records read is an error (exit 1) after everything is written:
    # a wrong template or option must not pass as a finished dataset. 1 = never.
    max_reject_fraction: float = 0.05
    overwrite: bool = False  # replace a dataset built with other options, or build beside unrelated files in --out
    # Masking policy (README, "Families and masking").
    train_on_roles: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"  # all | turn | last | none: which end-of-turn tokens get loss
    last_turn_only: bool = False
    tool_calls: str = "reject"  # a trained turn whose tool_calls the template does not render
    reasoning: str = "train"  # an assistant's reasoning_content: train | context (rendered, loss 0) | drop | reject
    chat_template: str | None = None  # a .jinja file replacing the processor's template (saved with the dataset)
    role_boundaries: str | None = None  # a TOML of per-role start/end markers, for unknown processors
    # Agent traces (README, "Agent traces"): what a record longer than seq_len becomes, the screenshot history kept
    # per sample, and the image processor's resize budget (saved into DIR/processor).
    long_traces: str = "truncate"
    keep_images: int | None = None  # --keep-images last:N; None = all
    dropped_image_text: str | None = None  # replaces each image the history policy removes; None = dropped
    min_pixels: int | None = None
    max_pixels: int | None = None
    # Video parts (README, "Video"): the build-wide frames sampled per second and cap on sampled frames, set on the
    # video processor (saved into DIR/processor); a part's own fps / max_frames win. None: the processor's own.
    video_fps: float | None = None
    video_max_frames: int | None = None
    # Scale out (README, "Scale out"): the input cut into `tasks` fixed tasks (plan.json), run by an executor or one
    # at a time with task_index (a Slurm array / indexed job), then merged.
    tasks: int = 1
    task_index: int | None = None
    plan_only: bool = False
    executor: str = "local"
    ray_address: str | None = None

    def __post_init__(self):
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
        if (self.max_images_per_record < 0 or self.max_image_pixels < 1 or self.max_line_bytes < 1
                or self.min_image_side < 1):
            raise ValueError("limits must be positive: check --max-images-per-record, --max-image-pixels, "
                             "--max-line-bytes, --min-image-side")
        if not (1 << 10) <= self.max_zstd_window <= (1 << 31):
            raise ValueError(f"max_zstd_window={self.max_zstd_window}: must be between 1 KiB and 2 GiB")
        if not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level={self.zstd_level}: must be in -7..22")
        if not self.train_on_roles or set(self.train_on_roles) - set(ROLES):
            raise ValueError(f"train_on_roles={list(self.train_on_roles)}: use a comma list of {', '.join(ROLES)}, "
                             "e.g. --train-on-roles assistant,tool")
        if self.train_on_eos not in EOS_POLICIES:
            raise ValueError(f"train_on_eos={self.train_on_eos!r}: choose one of {', '.join(EOS_POLICIES)}")
        if self.tool_calls not in TOOL_CALL_POLICIES:
            raise ValueError(f"tool_calls={self.tool_calls!r}: choose one of {', '.join(TOOL_CALL_POLICIES)}")
        if self.reasoning not in REASONING_POLICIES:
            raise ValueError(f"reasoning={self.reasoning!r}: choose one of {', '.join(REASONING_POLICIES)}")
        if self.long_traces not in LONG_TRACES:
            raise ValueError(f"long_traces={self.long_traces!r}: choose one of {', '.join(LONG_TRACES)}")
        if self.keep_images is not None and self.keep_images < 0:
            raise ValueError(f"keep_images={self.keep_images}: use --keep-images last:N with N >= 0, or all")
        if self.dropped_image_text is not None and self.keep_images is None:
            raise ValueError("--dropped-image-text replaces images that --keep-images last:N removes: pass both")
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v}: must be a positive pixel count, e.g. --max-pixels 1003520")
        if self.video_fps is not None and not 0 < self.video_fps <= 1000:
            raise ValueError(f"video_fps={self.video_fps}: must be a positive rate in frames per second, e.g. "
                             "--video-fps 2")
        if self.video_max_frames is not None and self.video_max_frames < 2:
            raise ValueError(f"video_max_frames={self.video_max_frames}: must be >= 2 (one temporal patch), e.g. "
                             "--video-max-frames 64")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} > max_pixels={self.max_pixels}: swap them")
        if not 0 <= self.max_reject_fraction <= 1:
            raise ValueError(f"max_reject_fraction={self.max_reject_fraction}: must be in 0..1 (1 = never fail on "
                             "rejects), e.g. --max-reject-fraction 0.05")
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
        if self.max_images_per_record > 999:
            raise ValueError(f"max_images_per_record={self.max_images_per_record}: at most 999 images per record "
                             "(image members are img000..img999)")
        if self.chat_template is not None:
            resolve_chat_template(self.chat_template)  # a file, or a bundled template's name
        if self.image_root is not None and not Path(self.image_root).is_dir():
            raise ValueError(f"--image-root {self.image_root}: no such directory; pass the dir the image paths are under")
        if self.role_boundaries is not None and not Path(self.role_boundaries).is_file():
            raise ValueError(f"--role-boundaries {self.role_boundaries}: no such file; pass the path of an existing file")

    @classmethod
    def from_plan(cls, config: dict, **run) -> "BuildConfig":
        """The config a plan was made with, plus the run-only fields (out, workers, progress, task_index ...), for
        running its tasks. Without the --chat-template path: the processor saved with the plan carries the template,
        so a task on another machine or in another directory never needs that file."""
        d = dict(config, inputs=tuple(config["inputs"]), train_on_roles=tuple(config["train_on_roles"]),
                 chat_template=None)
        return cls(**d, **run)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["inputs"] = list(self.inputs)
        d["train_on_roles"] = list(self.train_on_roles)
        # Display, worker count, the exit-code rule, the output dir and how tasks are run never change the bytes, so
        # a copy, a rebuild elsewhere or another executor stays byte-identical (the task count does change them).
        for k in ("progress", "workers", "out", "allow_empty", "max_reject_fraction", "overwrite", "task_index",
                  "plan_only", "executor", "ray_address"):
            d.pop(k)
        return d
