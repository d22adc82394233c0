"""How a run starts, before its first step: the optimizer and its LR schedule, the model (packing checked against
every dataset), the run dir and its config, FSDP2, rank 0's RunLog and the state a resume starts from. train.py calls
these in order.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import TrainState, check_resumable, load_latest, start_run_dir
from trainer.data import RunData, check_packing, log_plans
from trainer.export import keep_processor
from trainer.families import Vocab
from trainer.metrics import RunLog
from trainer.model import apply_fsdp, build_model
from trainer.options import Batching, Checkpointing, ModelOptions, Optimization
from vlmprep_schemas.boundary import open_no_follow
from vlmprep_schemas.terminal import for_terminal


def build_optimizer(optim: Optimization, net: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: weight decay on matrices, none on biases and norms (the options' lr,
    betas, eps)."""
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps
    )


def lr_at(step: int, *, lr: float, warmup_steps: int, total: int, min_lr_ratio: float) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio at `total`; `step` counts from 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total - warmup_steps, 1), 1.0)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def start_run(
    identity: dict, data: RunData, *, rank: int, ckpt: Checkpointing, config_toml: str, versions: dict
) -> None:
    """Every rank refuses a resume of another run (`identity`: what the run's checkpoints mean, run_identity); then
    rank 0 creates the run dir (or reopens it to resume), writes the resolved config and the dataset `versions` the
    run reads into it and keeps a copy of a processor in a bucket there (keep_processor)."""
    out = Path(ckpt.out)
    if ckpt.resume:
        check_resumable(out, identity, data.label)
    dist.barrier()  # every rank checked before rank 0 changes the run dir
    if rank == 0:
        start_run_dir(out, identity, data.label, resume=ckpt.resume, versions=versions)
        with open_no_follow(out / "config.toml", "w", encoding="utf-8") as f:
            f.write(config_toml)
        log_plans(data)
    keep_processor(data.processor, ckpt, rank=rank, world=data.world)


def make_model(
    options: ModelOptions, batching: Batching, data: RunData, *, rank: int, vocab: Vocab | None
) -> torch.nn.Module:
    """The model before FSDP (a tiny one sized to `vocab`); with packing, every dataset's seq_len checked against a
    row."""
    net = build_model(options, vocab)
    if batching.pack_to:
        # Every dataset's seq_len must fit a row; the log line speaks of the first.
        line = [
            check_packing(
                pack_to=batching.pack_to,
                pack_window=batching.pack_window,
                manifest=ds.manifest,
                model_type=str(net.config.model_type),
                world=data.world,
            )
            for ds in data.datasets
        ][0]
        if rank == 0:
            print(for_terminal(line), file=sys.stderr)
    return net


def run_log(
    progress: bool, tensorboard: bool, log_every: int, *, out: Path, total: int | None, step: int, rank: int
) -> RunLog | None:
    """Rank 0's RunLog from `step` on (the progress bar, TensorBoard, train.log lines), None on the other ranks; step
    lines go to stdout too unless a progress bar shows the run there (a terminal): Slurm and nohup logs read them."""
    if rank != 0:
        return None
    echo = not (progress and sys.stdout.isatty())
    return RunLog(
        out,
        total_steps=total,
        start_step=step,
        progress=progress,
        tensorboard=tensorboard,
        log_every=log_every,
        echo=echo,
    )


def shard_model(net: torch.nn.Module, *, precision: str, device: torch.device, world: int) -> None:
    """FSDP2 over every rank (trainer/model.py apply_fsdp), in bf16 where `precision` says so ("auto": on CUDA)."""
    from torch.distributed.device_mesh import init_device_mesh

    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    apply_fsdp(net, init_device_mesh(device.type, (world,)), bf16=bf16)


def resume_state(
    checkpointing: Checkpointing,
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    seed: int,
    packing: bool,
    device: torch.device,
    rank: int,
) -> TrainState:
    """The step, epoch, stream position and packer state to start from: with --resume and a checkpoint, the
    checkpoint's (model, optimizer and RNG states loaded too; `packing`: its packer state too); else zeros, and
    dropout seeded from `seed`."""
    found = None
    if checkpointing.resume:
        found = load_latest(Path(checkpointing.out), net=net, optimizer=optimizer, device=device, packing=packing)
    if found is None:
        torch.manual_seed(seed + 1 + rank)  # dropout masks differ per rank; a resume restores them instead
        return TrainState(step=0, epoch=0, position=0, pack_state=[])
    ckpt, r = found
    if rank == 0:
        print(f"trainer: resumed from {ckpt} (step {r.step}, epoch {r.epoch})", file=sys.stderr)
    return r
