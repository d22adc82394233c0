"""Option groups: the options a component takes together, passed as one object (torchtitan passes its config
sections): frozen keyword-only views of TrainConfig fields under their config names, with the fields' declared
defaults.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config import FIELDS, TrainConfig, default


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

