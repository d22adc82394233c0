"""TrainConfig: every trainer option, declared once with its default and help and validated once; built from an
optional TOML file plus CLI overrides (cli.py) and written into the run dir as `config.toml`. Components take the
option groups of options.py, not the whole config.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass

from trainer.families import TINY_NAMES
from trainer.option_values import ConfigError, DataSources, DataSpec, cache_limit_bytes, check_mixture

TINY_MODELS = TINY_NAMES  # --tiny-random NAME: one per family (trainer/families.py), sized to the dataset's processor
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
EXPORT_DTYPES = ("bf16", "fp32")
MAX_BATCH_TOKENS = 1 << 40  # --max-tokens-per-batch / --pack-to: beyond any batch, and far inside int64


# Option groups in --help and in docs/trainer.md's options table, in this order.
GROUPS = {
    "data": "where samples come from and how they are read",
    "model": "which model, how it runs, what is trained",
    "optimization": "run length, schedule, AdamW",
    "packing": "how samples become micro-batches: padded, a token budget, or packed rows",
    "eval": "held-out loss: on what and how often",
    "checkpointing": "the run dir, checkpoints and resume",
    "logging": "progress bar, TensorBoard",
}
REQUIRED = dataclasses.MISSING
TENSORBOARD_INSTALLED = importlib.util.find_spec("tensorboard") is not None


def opt(default, group: str, text: str, *, shown: str = ""):
    """A TrainConfig field with its one declaration of docs: `text` (one line) and `group` feed --help and the
    options table in docs/trainer.md; `shown` says how a machine-dependent default is chosen (the docs show it
    instead)."""
    assert group in GROUPS and text, f"option needs a group from {list(GROUPS)} and a help text"
    return dataclasses.field(default=default, metadata={"group": group, "help": text, "shown": shown})


@dataclass(frozen=True, kw_only=True)
class TrainConfig(DataSources):
    """Every trainer option, each declared once here with its default and help (`opt(...)`): the CLI flags, the TOML
    keys and `python -m trainer --help` are generated from these fields. Frozen and checked in __post_init__ by named
    `_check_*` checks (a bad value is a one-line ConfigError naming the fix); `to_toml()` is what the run dir keeps as
    config.toml, so a resume or an export reads the same options back."""

    data: str | tuple[DataSpec, ...] = opt(
        REQUIRED,
        "data",
        "shard dir (its manifest.json; DIR@vN or DIR@TAG: that version), brace pattern, file:, "
        "http(s):// or pipe: URL; or name=N,path=P[,weight=W][,on_end=repeat|stop] "
        "once per dataset of a mixture ([[data]] tables in the TOML)",
    )
    out: str = opt("runs/run", "checkpointing", "run dir: checkpoints, metrics.jsonl, config.toml, tb/")
    follow: bool = opt(
        False,
        "data",
        "take each newer version of a dataset dir (plain DIR; DIR@vN stays pinned) at the next epoch boundary "
        "(docs/datasets-that-grow.md); off: the version resolved at the start, for the whole run",
    )
    processor: str = opt("", "data", "processor dir for the pixel math; '' = the dataset's own DATA/processor/")
    model: str = opt("", "model", "HF checkpoint dir (AutoModelForImageTextToText); or pass tiny_random")
    tiny_random: str = opt(
        "",
        "model",
        "random-init tiny model instead of --model, sized to the dataset's processor: " + ", ".join(TINY_MODELS),
    )
    max_steps: int = opt(0, "optimization", "optimizer steps to run; 0 = `epochs` full epochs")
    epochs: int = opt(1, "optimization", "full passes over the data (when max_steps is 0)")
    schedule_steps: int = opt(0, "optimization", "warmup + cosine length in steps; 0 = the run's total steps")
    micro_batch_size: int = opt(
        1, "packing", "samples per micro-batch (padded), or packed rows per micro-batch with pack_to"
    )
    max_tokens_per_batch: int = opt(
        0, "packing", "> 0: micro-batches up to this many tokens, counted as rows x padded length"
    )
    pack_to: int = opt(0, "packing", "> 0: pack whole samples into rows of at most this many tokens")
    pack_window: int = opt(64, "packing", "samples of look-ahead the packer chooses rows from (held in memory)")
    grad_accum: int = opt(1, "optimization", "micro-batches per optimizer step on each rank")
    lr: float = opt(2e-5, "optimization", "peak learning rate (after warmup; the cosine ends at lr x min_lr_ratio)")
    min_lr_ratio: float = opt(0.1, "optimization", "final learning rate as a fraction of lr")
    warmup_steps: int = opt(0, "optimization", "steps of linear warmup from lr/warmup_steps to lr")
    weight_decay: float = opt(0.0, "optimization", "AdamW weight decay (matrices only; biases and norms get none)")
    adam_beta1: float = opt(0.9, "optimization", "AdamW beta1")
    adam_beta2: float = opt(
        0.95, "optimization", "AdamW beta2 (torch's default is 0.999; 0.95 is the usual choice for LLM fine-tuning)"
    )
    adam_eps: float = opt(1e-8, "optimization", "AdamW epsilon")
    max_grad_norm: float = opt(
        1.0,
        "optimization",
        "clip the global gradient norm (all ranks' shards together) to this; 0 = no clipping; "
        "the logged grad_norm is the norm before clipping",
    )
    seed: int = opt(
        0, "optimization", "seed of the model init, dropout and the data order (a function of seed, epoch and version)"
    )
    num_workers: int = opt(2, "data", "DataLoader worker processes per rank that decode samples")
    prefetch_factor: int = opt(4, "data", "samples each DataLoader worker decodes ahead")
    shuffle: bool = opt(
        True, "data", "sample-level shuffle: a new seeded permutation each epoch (off: shards are read in sequence)"
    )
    shuffle_span: int = opt(0, "data", "shards whose samples one permutation block mixes; 0 = all of a rank's shards")
    shuffle_shards: bool = opt(True, "data", "shuffle each rank's shard order every epoch (seeded)")
    shard_cache: str = opt(
        "",
        "data",
        "where remote (s3://, gs://, hf://, http(s)://, pipe:) shards are cached for "
        "random access, one dir per rank; '' = OUT/shard-cache",
    )
    shard_cache_limit: str = opt(
        "",
        "data",
        "most bytes the shard cache holds per node, e.g. 50GB (split over the "
        "node's ranks; shards no reader needs are evicted); '' = no limit",
    )
    shard_prefetch: int = opt(4, "data", "remote shards fetched ahead of those being read (within the cache limit)")
    read_timeout: float = opt(
        60.0,
        "data",
        "seconds a remote read may go without a byte before it fails (and after "
        "which a read averaging under 64 KiB/s is stopped)",
    )
    verify_shards: bool = opt(
        True,
        "data",
        "check each shard's sha256 against its manifest when this run first "
        "reads it (remembered in the shard cache: a resume does not hash again); off: sizes, "
        "sample counts and changes while training only",
    )
    activation_checkpointing: bool = opt(
        False, "model", "recompute each block's activations in backward to save memory"
    )
    precision: str = opt("auto", "model", "auto (bf16 on CUDA, fp32 on CPU), " + ", ".join(PRECISIONS[1:]))
    device: str = opt("auto", "model", "auto (CUDA when visible), " + ", ".join(DEVICES[1:]))
    attn_implementation: str = opt("sdpa", "model", "transformers attention: sdpa, eager, flash_attention_2")
    lora_rank: int = opt(0, "model", "> 0: train LoRA adapters of this rank on the language model, vision frozen")
    lora_alpha: float = opt(16.0, "model", "LoRA alpha (the update is scaled by alpha / rank)")
    lora_dropout: float = opt(0.0, "model", "LoRA dropout, in [0, 1)")
    freeze_vision: bool = opt(False, "model", "freeze the vision tower (model.visual, merger included)")
    save_every: int = opt(0, "checkpointing", "steps between checkpoints; 0 = only at the end")
    keep_checkpoints: int = opt(2, "checkpointing", "newest checkpoints kept in RUN/checkpoints/")
    resume: bool = opt(
        True,
        "checkpointing",
        "continue the run in out (same data, model, options); --no-resume deletes its state and starts over",
    )
    progress: bool = opt(True, "logging", "progress bar on rank 0's terminal")
    log_every: int = opt(
        10,
        "logging",
        "a plain-text line at step 1 and every N steps (step/total, loss, lr, grad "
        "norm, tokens/s, data wait, ETA) in RUN/train.log, and on stdout unless a "
        "progress bar shows it there; 0 = none",
    )
    eval_data: str | tuple[DataSpec, ...] = opt(
        "",
        "eval",
        "held-out data, the forms of data; name=N,path=P once per "
        "eval set ([[eval_data]] in the TOML) for a loss per set; '' = no eval",
    )
    eval_every: int = opt(
        0,
        "eval",
        "steps between evals of the whole eval_data; 0 = only at the end (an eval "
        "always ends a run that has eval_data)",
    )
    tensorboard: bool = opt(
        TENSORBOARD_INSTALLED,
        "logging",
        "TensorBoard scalars in RUN/tb/ (rank 0)",
        shown="on when the tensorboard package is installed",
    )
    save_hf: bool = opt(
        False,
        "checkpointing",
        "at the end, export RUN/hf/: a transformers model dir with the dataset's processor (python -m trainer export)",
    )
    export_dtype: str = opt("bf16", "checkpointing", "weight dtype of the --save-hf export: bf16, fp32")

    def __post_init__(self):
        for check in (
            self._check_data,
            self._check_eval,
            self._check_model,
            self._check_counts,
            self._check_optimization,
            self._check_choices,
            self._check_batching,
        ):
            check()

    def _check_data(self) -> None:
        if not self.data:
            raise ConfigError("data is empty: pass --data DIR|PATTERN|URL")
        for key in ("data", "eval_data"):
            value = getattr(self, key)
            if not isinstance(value, str):
                specs = tuple(DataSpec.parse(v) for v in value)
                if len(specs) == 1 and not specs[0].name:
                    specs = specs[0].path  # one unnamed dataset is just a path
                object.__setattr__(self, key, specs)
            if not isinstance(getattr(self, key), str):
                check_mixture(key, getattr(self, key))

    def _check_eval(self) -> None:
        if any(d.weight != 1.0 or d.on_end != "repeat" for d in self.eval_sources):
            raise ConfigError(
                "eval_data entries take name and path only: every eval sample is read once, so weight "
                "and on_end do not apply"
            )
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every}: must be >= 0")
        if self.eval_every and not self.eval_data:
            raise ConfigError(f"eval_every={self.eval_every} without eval_data: pass --eval-data DIR|PATTERN|URL")

    def _check_model(self) -> None:
        if bool(self.model) == bool(self.tiny_random):
            raise ConfigError("pass exactly one of --model CHECKPOINT_DIR or --tiny-random " + "|".join(TINY_MODELS))
        if self.tiny_random and self.tiny_random not in TINY_MODELS:
            raise ConfigError(f"tiny_random={self.tiny_random!r}: choose one of {', '.join(TINY_MODELS)}")

    def _check_counts(self) -> None:
        for name in (
            "max_steps",
            "schedule_steps",
            "max_tokens_per_batch",
            "pack_to",
            "warmup_steps",
            "num_workers",
            "save_every",
            "lora_rank",
            "shuffle_span",
            "log_every",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("epochs", "micro_batch_size", "grad_accum", "prefetch_factor", "keep_checkpoints", "pack_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("max_tokens_per_batch", "pack_to"):  # token counts live in int64 arrays: refused, not overflowed
            if getattr(self, name) > MAX_BATCH_TOKENS:
                raise ConfigError(
                    f"{name}={getattr(self, name)}: more tokens than any batch holds (at most {MAX_BATCH_TOKENS})"
                )
        cache_limit_bytes(self.shard_cache_limit)
        if self.shard_prefetch < 1:
            raise ConfigError(f"shard_prefetch={self.shard_prefetch}: must be >= 1")
        if not self.read_timeout > 0:
            raise ConfigError(f"read_timeout={self.read_timeout}: seconds, > 0")

    def _check_optimization(self) -> None:
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}: need lr > 0 and 0 <= min_lr_ratio <= 1")
        if self.max_grad_norm < 0 or self.weight_decay < 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError("max_grad_norm and weight_decay must be >= 0, lora_dropout in [0, 1)")
        if self.warmup_steps and self.schedule_steps and self.warmup_steps > self.schedule_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} > schedule_steps={self.schedule_steps}")

    def _check_choices(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export_dtype={self.export_dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.tensorboard and not TENSORBOARD_INSTALLED:
            raise ConfigError(
                "tensorboard=true but the tensorboard package is not installed: "
                "pip install 'vlmprep[tb]', or pass --no-tensorboard"
            )

    def _check_batching(self) -> None:
        if self.pack_to and self.max_tokens_per_batch:
            raise ConfigError(
                f"pack_to={self.pack_to} and max_tokens_per_batch={self.max_tokens_per_batch}: pick one "
                "(packing fills rows to --pack-to; --micro-batch-size is then rows per micro-batch)"
            )

    def resume_identity(self) -> dict:
        """The options a resume must keep (every one outside RESUME_MAY_CHANGE), as run.json's identity holds them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RESUME_MAY_CHANGE}

    def to_toml(self) -> str:
        """The config as TOML text (config.toml in the run dir); parse_args(['--config', it]) gives it back."""
        # Every other field is a str, int, float or bool, and JSON's quoting of ASCII strings is valid TOML;
        # a mixture's [[data]] (and named [[eval_data]]) tables go last (top-level keys must precede tables).
        tables = [k for k in ("data", "eval_data") if not isinstance(getattr(self, k), str)]
        top = "".join(f"{k} = {json.dumps(getattr(self, k))}\n" for k in FIELDS if k not in tables)
        return top + "".join(d.to_toml(k) for k in tables for d in getattr(self, k))


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def default(name: str):
    """The declared default of TrainConfig field `name`: a library default that stands for an option is taken from
    here, so each option has one default (tests/trainer/test_options.py compares them)."""
    return FIELDS[name].default


# Options a resumed run may change: its length (the cosine then follows the new length from the current step),
# speed and bookkeeping, and where things are (checkpoint.run_identity compares the data and the image processor by
# content, the model by its resolved dir and config.json hash).
# Eval may change too: it reads its own data with its own loaders and leaves the RNG and the training stream as they
# were (tests/trainer/test_eval.py). Every other option shapes the data order or the optimization, so a resume
# requires it unchanged (docs/trainer.md).
RESUME_MAY_CHANGE = frozenset(
    {
        "data",
        "out",
        "processor",
        "model",
        "tiny_random",
        "resume",
        "max_steps",
        "epochs",
        "schedule_steps",
        "num_workers",
        "prefetch_factor",
        "activation_checkpointing",
        "attn_implementation",
        "device",
        "save_every",
        "keep_checkpoints",
        "progress",
        "log_every",
        "tensorboard",
        "shard_cache",
        "shard_cache_limit",
        "shard_prefetch",
        "read_timeout",
        "save_hf",
        "export_dtype",
        "eval_data",
        "eval_every",
        "verify_shards",
    }
)
