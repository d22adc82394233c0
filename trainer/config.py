"""TrainConfig: every trainer option, validated once; built from an optional TOML file plus CLI overrides
(one `--flag` per field) and written into the run dir as `config.toml`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

TINY_MODELS = ("qwen2-vl",)
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A bad option or config file: reported as one line, exit code 1."""


ON_END = ("repeat", "stop")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """One dataset of a mixture: `[[data]]` in the TOML, `--data name=N,path=P,weight=W,on_end=E` on the CLI."""

    path: str
    name: str = ""
    weight: float = 1.0  # share of the run's trained tokens (normalized over the sources)
    on_end: str = "repeat"  # when the source runs out before the epoch ends: start it again, or leave it out

    @classmethod
    def parse(cls, value) -> "DataSpec":
        if isinstance(value, DataSpec):
            return value
        if isinstance(value, str):
            if "=" not in value.split("/", 1)[0] or "path=" not in value:
                return cls(path=value)
            parts = dict(p.split("=", 1) if "=" in p else (p, "") for p in value.split(","))
            value = {k.strip(): v.strip() for k, v in parts.items()}
            if "weight" in value:
                try:
                    value["weight"] = float(value["weight"])
                except ValueError:
                    raise ConfigError(f"--data {value}: weight must be a number") from None
        if not isinstance(value, dict):
            raise ConfigError(f"data entry {value!r}: expected a path or a table with name, path, weight, on_end")
        unknown = sorted(set(value) - {"path", "name", "weight", "on_end"})
        if unknown or "path" not in value:
            raise ConfigError(f"data entry {value!r}: {'unknown keys ' + ', '.join(unknown) if unknown else 'no path'}"
                              "; keys: name, path, weight, on_end")
        if isinstance(value.get("weight"), int) and not isinstance(value.get("weight"), bool):
            value = {**value, "weight": float(value["weight"])}
        spec = cls(**value)
        if not isinstance(spec.path, str) or not spec.path or not isinstance(spec.name, str):
            raise ConfigError(f"data entry {value!r}: path and name must be non-empty strings")
        if not isinstance(spec.weight, float) or not spec.weight > 0 or spec.weight == float("inf"):
            raise ConfigError(f"data entry {spec.name or spec.path}: weight={spec.weight!r} must be a number > 0")
        if spec.on_end not in ON_END:
            raise ConfigError(f"data entry {spec.name or spec.path}: on_end={spec.on_end!r}: choose "
                              f"{' or '.join(ON_END)}")
        return spec

    def to_toml(self) -> str:
        return "\n[[data]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataclasses.asdict(self).items())


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # shard dir, brace pattern, file:, http(s):// or pipe: URL; or several named datasets ([[data]] tables)
    data: str | tuple[DataSpec, ...]
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
    shuffle_shards: bool = True  # per-epoch order of each rank's shards, seeded (implied by shuffle)
    shuffle: bool = True  # per-epoch sample-level permutation (blocks of shuffle_span shards), seeded by seed
    shuffle_span: int = 0  # shards whose samples are permuted together; 0 = all of a rank's shards
    shard_cache: str = ""  # local copies of http(s)://, pipe: shards for random access; "" = OUT/shard-cache
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

    def __post_init__(self):
        if not self.data:
            raise ConfigError("data is empty: pass --data DIR|PATTERN|URL")
        if not isinstance(self.data, str):
            specs = tuple(DataSpec.parse(v) for v in self.data)
            if len(specs) == 1 and not specs[0].name:
                specs = specs[0].path  # one unnamed dataset is just a path
            object.__setattr__(self, "data", specs)
        if not isinstance(self.data, str):
            names = [d.name for d in self.data]
            if not all(names) or len(set(names)) != len(names):
                raise ConfigError(f"several datasets need distinct names (got {names}): "
                                  "--data name=N,path=P,weight=W for each, or [[data]] name = ... in the TOML")
            bad = [n for n in names if not _NAME.match(n)]
            if bad:
                raise ConfigError(f"dataset name {bad[0]!r}: letters, digits, '_', '-', '.' only")
        if bool(self.model) == bool(self.tiny_random):
            raise ConfigError("pass exactly one of --model CHECKPOINT_DIR or --tiny-random "
                              + "|".join(TINY_MODELS))
        if self.tiny_random and self.tiny_random not in TINY_MODELS:
            raise ConfigError(f"tiny_random={self.tiny_random!r}: choose one of {', '.join(TINY_MODELS)}")
        for name in ("max_steps", "schedule_steps", "max_tokens_per_batch", "pack_to", "warmup_steps", "num_workers",
                     "save_every", "lora_rank", "shuffle_span"):
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
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.pack_to and self.max_tokens_per_batch:
            raise ConfigError(f"pack_to={self.pack_to} and max_tokens_per_batch={self.max_tokens_per_batch}: pick one "
                              "(packing fills rows to --pack-to; --micro-batch-size is then rows per micro-batch)")
        if self.warmup_steps and self.schedule_steps and self.warmup_steps > self.schedule_steps:
            raise ConfigError(f"warmup_steps={self.warmup_steps} > schedule_steps={self.schedule_steps}")

    @property
    def sources(self) -> tuple[DataSpec, ...]:
        """The run's datasets: one unnamed for a plain --data, else the named mixture."""
        return (DataSpec(path=self.data),) if isinstance(self.data, str) else self.data

    def to_toml(self) -> str:
        # Every other field is a str, int, float or bool, and JSON's quoting of ASCII strings is valid TOML;
        # a mixture's [[data]] tables go last (top-level keys must precede tables).
        mix = not isinstance(self.data, str)
        top = "".join(f"{k} = {json.dumps(getattr(self, k))}\n" for k in FIELDS if not (mix and k == "data"))
        return top + ("".join(d.to_toml() for d in self.data) if mix else "")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# Options a resumed run may change: its length (the cosine then follows the new length from the current step),
# speed and bookkeeping, and where things are (checkpoint.run_identity compares the data and the image processor by
# content, the model by its resolved dir and config.json hash).
# Every other option shapes the data order or the optimization, so a resume requires it unchanged (README, Trainer).
RESUME_MAY_CHANGE = frozenset({"data", "out", "processor", "model", "tiny_random", "resume", "max_steps", "epochs",
                               "schedule_steps", "num_workers", "prefetch_factor", "activation_checkpointing",
                               "shard_cache",
                               "attn_implementation", "device", "save_every", "keep_checkpoints", "progress"})


def _coerce(name: str, value):
    if name == "data":
        if isinstance(value, list):
            return tuple(DataSpec.parse(v) for v in value)
        if not isinstance(value, str):
            raise ConfigError(f"data = {value!r}: expected a path or [[data]] tables")
        return value
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
        if name == "data":
            ap.add_argument(flag, dest=name, action="append", default=None,
                            help="DIR|PATTERN|URL, or name=N,path=P[,weight=W][,on_end=repeat|stop] once per dataset "
                                 "of a mixture")
        elif f.type == "bool":
            ap.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            ap.add_argument(flag, dest=name, type={"str": str, "int": int, "float": float}[f.type], default=None)
    return ap


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ns = _parser().parse_args(argv)
    values = load_toml(ns.config) if ns.config else {}
    values.update({k: v for k, v in vars(ns).items() if k != "config" and v is not None})
    if isinstance(values.get("data"), list):  # --data given on the CLI (repeatable)
        values["data"] = values["data"][0] if len(values["data"]) == 1 and "path=" not in values["data"][0] \
            else tuple(DataSpec.parse(v) for v in values["data"])
    if "data" not in values:
        raise ConfigError("data is missing: pass --data DIR|PATTERN|URL or set data in the TOML")
    return TrainConfig(**values)
