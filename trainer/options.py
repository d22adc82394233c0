"""Option groups: the options a component takes together, passed as one object (torchtitan passes its config
sections): frozen keyword-only views of TrainConfig fields under their config names, with the fields' declared
defaults. The run (train.py) makes each from its TrainConfig with `Group.of(cfg)`; nothing past it takes the whole
config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config import FIELDS, DataSources, DataSpec, TrainConfig, default


class OptionGroup:
    """Options a component takes together, passed as one object (torchtitan passes its config sections): a frozen,
    keyword-only dataclass of TrainConfig fields under their config names, made by @option_group."""

    @classmethod
    def of(cls, cfg: TrainConfig):
        """The group's values in `cfg`."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def option_group(cls):
    """Makes `cls` (an OptionGroup listing TrainConfig field names with their types) a frozen keyword-only dataclass
    whose fields default to those TrainConfig fields' declared defaults."""
    for name in cls.__annotations__:
        assert name in FIELDS, f"{cls.__name__}.{name} is no TrainConfig field"
        setattr(cls, name, default(name))
    return dataclass(frozen=True, kw_only=True)(cls)


@option_group
class Batching(OptionGroup):
    """How a rank's samples become optimizer steps: micro-batches of micro_batch_size samples, or of as many as fit
    max_tokens_per_batch (rows x padded length), or of micro_batch_size rows packed to pack_to tokens from a
    pack_window look-ahead; grad_accum micro-batches a step."""

    micro_batch_size: int
    max_tokens_per_batch: int
    pack_to: int
    pack_window: int
    grad_accum: int


@option_group
class ModelOptions(OptionGroup):
    """Which model to build and how (trainer/model.py build_model): a checkpoint dir or a tiny random one, its init
    seed, attention, activation checkpointing, LoRA and a frozen vision tower."""

    model: str
    tiny_random: str
    seed: int
    attn_implementation: str
    activation_checkpointing: bool
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    freeze_vision: bool


@option_group
class DataOptions(OptionGroup, DataSources):
    """Where samples come from and how they are read (trainer/data/pipeline.py): the datasets (and whether a run
    follows their newer versions), eval sets and processor, the data order's seed and shuffles, the DataLoader
    workers, the shard cache (under `out` unless --shard-cache names another dir) and the sha256 checks."""

    data: str | tuple[DataSpec, ...]
    eval_data: str | tuple[DataSpec, ...]
    follow: bool
    processor: str
    seed: int
    shuffle: bool
    shuffle_span: int
    shuffle_shards: bool
    num_workers: int
    prefetch_factor: int
    out: str
    shard_cache: str
    shard_cache_limit: str
    shard_prefetch: int
    verify_shards: bool

    @property
    def scheduled(self) -> bool:
        """Whether samples are read by the epoch schedule (sample shuffle, or a mixture) rather than in sequence."""
        return self.shuffle or len(self.sources) > 1


@option_group
class RunLength(OptionGroup):
    """How long the run trains: --max-steps, else --epochs full epochs; and the LR schedule's length."""

    max_steps: int
    epochs: int
    schedule_steps: int


@option_group
class Optimization(OptionGroup):
    """AdamW and its learning rate: the peak lr, its linear warmup and cosine to lr x min_lr_ratio, weight decay,
    betas, epsilon and gradient clipping."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    max_grad_norm: float


@option_group
class Checkpointing(OptionGroup):
    """The run dir and what is kept in it: checkpoints and their cadence, resume, the HF export at the end."""

    out: str
    save_every: int
    keep_checkpoints: int
    resume: bool
    save_hf: bool
    export_dtype: str
