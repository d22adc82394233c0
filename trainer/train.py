"""Training: config -> distributed init -> data (trainer/data/: the datasets checked, this rank's read plan) -> model
-> FSDP2 -> optimizer -> the rank's step loader -> checkpoint load -> loop of train_step (loss = summed token losses /
global trained-token count) -> metrics, checkpoints -> cleanup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import TrainState, check_resumable, load_latest, own_run_dir, run_identity, start_run_dir
from trainer.cli import parse_args
from trainer.config import ConfigError, TrainConfig
from trainer.data import (
    DataError,
    RunData,
    check_packing,
    eval_loaders,
    keep_freed_buffers,
    log_plans,
    make_loader,
    open_data,
    processor_dir,
    read_plan,
    set_read_timeout,
)
from trainer.distributed import die_with_launcher, init_distributed
from trainer.families import Vocab
from trainer.loop import Session
from trainer.metrics import FlopCounter, RunLog
from trainer.model import apply_fsdp, build_model, collate_spec_of, model_identity, model_type_of, tiny_vocab
from trainer.options import Batching, Checkpointing, DataOptions, ModelOptions, Optimization, RunLength
from vlmprep_schemas.boundary import UnsafeWrite, open_no_follow


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


def start_run(identity: dict, data: RunData, *, rank: int, ckpt: Checkpointing, config_toml: str) -> None:
    """Every rank refuses a resume of another run (`identity`: what the run's checkpoints mean, run_identity); then
    rank 0 creates the run dir (or reopens it to resume) and writes the resolved config into it."""
    out = Path(ckpt.out)
    if ckpt.resume:
        check_resumable(out, identity, data.label)
    dist.barrier()  # every rank checked before rank 0 changes the run dir
    if rank == 0:
        start_run_dir(out, identity, data.label, resume=ckpt.resume)
        with open_no_follow(out / "config.toml", "w", encoding="utf-8") as f:
            f.write(config_toml)
        log_plans(data)


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
            print(line, file=sys.stderr)
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


def run(cfg: TrainConfig) -> dict | None:
    """A checked TrainConfig -> the trained run: distributed init (torchrun's ranks, or one process), data, model
    sharded with FSDP2, optimizer, resume from the newest complete checkpoint in RUN where there is one, then the
    step loop with its evals and checkpoints; returns the last step's metrics row. Every rank calls it; the process
    group and RUN's lock are released on the way out, error or not. Trade-off: data order, RNG and batching are saved
    so a resume repeats the same steps exactly, which ties a resume to the same world size and batching options."""
    keep_freed_buffers()
    die_with_launcher()
    set_read_timeout(cfg.read_timeout)
    rank, world, device = init_distributed(cfg.device)
    batching, optim, ckpt, length = Batching.of(cfg), Optimization.of(cfg), Checkpointing.of(cfg), RunLength.of(cfg)
    out = Path(ckpt.out)
    owner = contextlib.ExitStack()  # what the run holds, released in reverse: the log, loader, processor, RUN's lock
    try:
        model_type = model_type_of(model=cfg.model, tiny_random=cfg.tiny_random)
        data = open_data(DataOptions.of(cfg), model_type=model_type, packing=bool(cfg.pack_to), world=world)
        plan = read_plan(DataOptions.of(cfg), data, rank=rank)
        # under --shard-cache-limit: shuffle blocks that fit the cache, written to config.toml and compared on resume
        cfg = dataclasses.replace(cfg, shuffle_span=plan.shuffle_span)
        owner.enter_context(own_run_dir(out))  # before anything in RUN is read or written
        processor = processor_dir(data, owner, model_type=model_type, tiny=bool(cfg.tiny_random))
        vocab = tiny_vocab(cfg.tiny_random, processor)
        identity = run_identity(
            cfg.resume_identity(),
            datasets=list(zip(data.specs, data.datasets)),
            world=world,
            model=model_identity(model=cfg.model, tiny_random=cfg.tiny_random, vocab=vocab),
            image_config=data.image.config,
        )
        start_run(identity, data, rank=rank, ckpt=ckpt, config_toml=cfg.to_toml())
        net = make_model(ModelOptions.of(cfg), batching, data, rank=rank, vocab=vocab)
        flop_counter, collate_spec = FlopCounter(net), collate_spec_of(net, data, processor)
        data_options = DataOptions.of(cfg)
        evals = eval_loaders(
            data_options,
            plan,
            data,
            batching=batching,
            collate_spec=collate_spec,
            model_type=str(net.config.model_type),
            eval_every=cfg.eval_every,
        )
        shard_model(net, precision=cfg.precision, device=device, world=world)
        optimizer = build_optimizer(optim, net)
        loader, total, schedule_len = make_loader(
            data_options, plan, data, batching=batching, length=length, device=device, collate_spec=collate_spec
        )
        owner.callback(loader.close)
        resumed = resume_state(ckpt, net, optimizer, seed=cfg.seed, packing=bool(cfg.pack_to), device=device, rank=rank)
        loader.start(resumed.epoch, resumed.position, resumed.pack_state)
        log = run_log(cfg.progress, cfg.tensorboard, cfg.log_every, out=out, total=total, step=resumed.step, rank=rank)
        if log is not None:
            owner.callback(log.close)
        session = Session(
            length=length,
            optim=optim,
            ckpt=ckpt,
            batching=batching,
            eval_every=cfg.eval_every,
            data=data,
            net=net,
            optimizer=optimizer,
            loader=loader,
            evals=evals,
            log=log,
            flop_counter=flop_counter,
            total=total,
            schedule_len=schedule_len,
            rank=rank,
            device=device,
            resumed=resumed,
        )
        session.loop()
        session.finish()
        return session.last
    finally:
        owner.close()
        dist.destroy_process_group()


def _one_line(e: Exception) -> str:
    text = str(e)
    if "\nOriginal Traceback" in text:  # re-raised from a DataLoader worker: keep the worker's own message
        last = text.rstrip().splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


def main(argv: list[str] | None = None) -> int:
    """Command-line arguments -> exit status: runs `run(parse_args(argv))`; a ConfigError or DataError is one line on
    stderr (naming the rank) and exit 1, with the traceback only where TRAINER_DEBUG is set. So are a planted symlink
    where the run writes (UnsafeWrite) and a full disk."""
    try:
        run(parse_args(argv))
    except (ConfigError, DataError, OSError) as e:
        disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        known = not isinstance(e, OSError) or isinstance(e, UnsafeWrite) or disk_full
        if os.environ.get("TRAINER_DEBUG") or not known:
            raise
        rank = os.environ.get("RANK")
        hint = " (free space there, or write the run or --shard-cache elsewhere)" if disk_full else ""
        print(f"trainer: error{f' (rank {rank})' if rank else ''}: {_one_line(e)}{hint}", file=sys.stderr)
        return 1
    return 0
