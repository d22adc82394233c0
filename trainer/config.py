"""TrainConfig: every trainer option, validated once; built from an optional TOML file plus CLI overrides
(one `--flag` per field) and written into the run dir as `config.toml`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

TINY_MODELS = ("qwen2-vl",)
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
EXPORT_DTYPES = ("bf16", "fp32")


class ConfigError(ValueError):
    """A bad option or config file: reported as one line, exit code 1."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: str  # shard dir, brace pattern, file:, http(s):// or pipe: URL
    out: str = "runs/run"
    processor: str = ""  # processor dir for pixel math; "" = the dataset's own processor/
    model: str = ""  # HF checkpoint dir (AutoModelForImageTextToText)
    tiny_random: str = ""  # random-init tiny model instead of --model
    max_steps: int = 0  # 0 = train `epochs` full epochs
    epochs: int = 1
    schedule_steps: int = 0  # warmup + cosine length; 0 = the run's total steps
    micro_batch_size: int = 1  # samples per micro-batch (padded), or packed rows per micro-batch with pack_to
    max_tokens_per_batch: int = 0  # token budget per micro-batch, counted as rows x padded length
    pack_to: int = 0  # > 0: pack whole samples into rows of at most this many tokens (trainer/pack.py)
    pack_window: int = 64  # samples of look-ahead the packer chooses from (held decoded in memory)
    grad_accum: int = 1
    lr: float = 2e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 = no clipping
    seed: int = 0
    num_workers: int = 2
    prefetch_factor: int = 4
    shuffle_shards: bool = True  # per-epoch order of each rank's shards, seeded
    activation_checkpointing: bool = False
    precision: str = "auto"  # auto: bf16 params/compute on CUDA, fp32 on CPU
    device: str = "auto"
    attn_implementation: str = "sdpa"
    lora_rank: int = 0  # > 0: LoRA on the language model, vision tower frozen
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    freeze_vision: bool = False
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue the run in out/ (same data, model, options); False: clear its state, start over
    progress: bool = True
    save_hf: bool = False  # at the end: export RUN/hf/, model + the dataset's processor (trainer/export.py)
    export_dtype: str = "bf16"  # weight dtype of the --save-hf export

    def __post_init__(self):
        if not self.data:
            raise ConfigError("data is empty: pass --data DIR|PATTERN|URL")
        if bool(self.model) == bool(self.tiny_random):
            raise ConfigError("pass exactly one of --model CHECKPOINT_DIR or --tiny-random "
                              + "|".join(TINY_MODELS))
        if self.tiny_random and self.tiny_random not in TINY_MODELS:
            raise ConfigError(f"tiny_random={self.tiny_random!r}: choose one of {', '.join(TINY_MODELS)}")
        for name in ("max_steps", "schedule_steps", "max_tokens_per_batch", "pack_to", "warmup_steps", "num_workers",
                     "save_every", "lora_rank"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        for name in ("epochs", "micro_batch_size", "grad_accum", "prefetch_factor", "keep_checkpoints", "pack_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.lr <= 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}: need lr > 0 and 0 <= min_lr_ratio <= 1")
        if self.max_grad_norm < 0 or self.weight_decay < 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError("max_grad_norm and weight_decay must be >= 0, lora_dropout in [0, 1)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(f"export_dtype={self.export_dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.pack_to and self.max_tokens_per_batch:
            raise ConfigError(f"pack_to={self.pack_to} and max_tokens_per_batch={self.max_tokens_per_batch}: pick one "
                              "(packing fills rows to --pack-to; --micro-batch-size is then rows per micro-batch)")
        if self.warmup_steps and self.schedule_steps and self.warmup_steps > self.schedule_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} > schedule_steps={self.schedule_steps}")

    def to_toml(self) -> str:
        # Every field is a str, int, float or bool, and JSON's quoting of ASCII strings is valid TOML.
        return "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataclasses.asdict(self).items())


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Options a resumed run may change: its length (the cosine then follows the new length from the current step),
# speed and bookkeeping, and where things are (checkpoint.run_identity compares the data and the image processor by
# content, the model by its resolved dir and config.json hash).
# Every other option shapes the data order or the optimization, so a resume requires it unchanged (README, Trainer).
RESUME_MAY_CHANGE = frozenset({"data", "out", "processor", "model", "tiny_random", "resume", "max_steps", "epochs",
                               "schedule_steps", "num_workers", "prefetch_factor", "activation_checkpointing",
                               "attn_implementation", "device", "save_every", "keep_checkpoints", "progress",
                               "save_hf", "export_dtype"})


def _coerce(name: str, value):
    ftype = FIELDS[name].type
    want = {"str": str, "int": int, "float": float, "bool": bool}[ftype]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"{name} = {value!r}: expected {ftype}")
    return value


def load_toml(path: str) -> dict:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {', '.join(unknown)}; valid keys: {', '.join(FIELDS)}")
    return {k: _coerce(k, v) for k, v in data.items()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer", description="Train a VLM on vlmprep shards (FSDP2).",
                                 allow_abbrev=False)
    ap.add_argument("--config", help="TOML file with TrainConfig keys; command-line flags override it")
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if f.type == "bool":
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            ap.add_argument(flag, dest=name, type={"str": str, "int": int, "float": float}[f.type], default=None)
    return ap


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ns = _parser().parse_args(argv)
    values = load_toml(ns.config) if ns.config else {}
    values.update({k: v for k, v in vars(ns).items() if k != "config" and v is not None})
    if "data" not in values:
        raise ConfigError("data is missing: pass --data DIR|PATTERN|URL or set data in the TOML")
    return TrainConfig(**values)
