"""Training: config -> distributed init -> model -> FSDP2 -> optimizer -> data (trainer/data/pipeline.py) -> checkpoint
load -> loop of train_step (loss = summed token losses / global trained-token count) -> metrics, checkpoints -> cleanup.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import (
    TrainState,
    check_resumable,
    load_latest,
    own_run_dir,
    run_identity,
    save_checkpoint,
    start_run_dir,
)
from trainer.cli import parse_args
from trainer.config import ConfigError, TrainConfig
from trainer.data.batches import StepLoader
from trainer.data.collate import Batch, keep_freed_buffers, token_sources
from trainer.data.errors import DataError
from trainer.data.pack import check_packing, empty_state
from trainer.data.pipeline import (
    RunData,
    collate_spec_of,
    fit_span,
    log_plans,
    make_loader,
    open_data,
    processor_dir,
    shard_check,
)
from trainer.data.storage import set_read_timeout
from trainer.data.vision import Patchifier
from trainer.evaluate import EvalSet, eval_sets, evaluate
from trainer.families import BY_NAME, Vocab
from trainer.metrics import FlopCounter, RunLog, eval_logged, peak_flops
from trainer.model import apply_fsdp, build_model, forward_loss, model_identity, tiny_vocab
from trainer.options import ModelOptions
from vlmprep_schemas.boundary import UnsafeWrite, open_no_follow


def lr_at(step: int, *, lr: float, warmup_steps: int, total: int, min_lr_ratio: float) -> float:
    """Linear warmup, then cosine to lr * min_lr_ratio at `total`; `step` counts from 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total - warmup_steps, 1), 1.0)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def die_with_launcher() -> None:
    """A rank ends when torchrun does: a `kill -9` of torchrun (an OOM killer, a careless kill) would otherwise leave
    the ranks training on to the end, writing checkpoints into a run dir that a restart is refused. Linux's
    parent-death signal (SIGTERM), set by each rank on itself."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    launcher = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # it died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(device_kind: str) -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; plain `python -m trainer` becomes a one-rank group, so one code path."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible")
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """Each of `values` summed (or reduced by `op`) over all ranks, as floats; the values themselves on one rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t.tolist()


def build_optimizer(cfg: TrainConfig, net: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: weight decay on matrices, none on biases and norms (cfg's lr, betas,
    eps)."""
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps)


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
               patchifier: Patchifier, global_trained: float, max_grad_norm: float,
               by_source: torch.Tensor | None = None) -> tuple[float, float]:
    """Forward/backward every micro-batch on the patchifier's device, clip, step. Returns (this rank's summed token
    loss, global grad norm). Dividing each micro-batch's sum by the global count makes the summed gradient the exact
    token mean. `by_source` ([2, S] zeros, a mixture of S datasets) receives this rank's loss sums and trained tokens
    per source."""
    device = patchifier.device
    local_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        mb = mb.to(device)
        # Qwen's families: pixels patchified here, on the device; the others' came made by the host (mb.vision).
        pixels, videos = (None, None) if mb.vision else (patchifier(mb.images, mb.image_index),
                                                         patchifier.videos(mb.videos))
        if by_source is None:
            loss_sum = forward_loss(net, mb, pixels, pixel_values_videos=videos)
        else:
            loss_sum, losses, counts = forward_loss(net, mb, pixels, sources=(token_sources(mb), by_source.shape[1]),
                                                    pixel_values_videos=videos)
            by_source[0] += losses.detach().to(by_source.device)
            by_source[1] += counts.to(by_source.device)
        (loss_sum / max(global_trained, 1.0)).backward()
        local_sum += loss_sum.detach().double()
    params = [p for p in net.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(local_sum), float(norm)


def start_run(cfg: TrainConfig, data: RunData, *, rank: int, world: int, out: Path, vocab: Vocab | None) -> None:
    """Every rank refuses a resume of another run; then rank 0 creates the run dir (or reopens it to resume)."""
    identity = run_identity(cfg, datasets=list(zip(data.specs, data.datasets)), image_config=data.image.config,
                            model=model_identity(model=cfg.model, tiny_random=cfg.tiny_random, vocab=vocab),
                            world=world)
    if cfg.resume:
        check_resumable(out, identity, data.label)
    dist.barrier()  # every rank checked before rank 0 changes the run dir
    if rank == 0:
        start_run_dir(out, identity, data.label, resume=cfg.resume)
        with open_no_follow(out / "config.toml", "w", encoding="utf-8") as f:
            f.write(cfg.to_toml())
        log_plans(data, world)


def make_model(cfg: TrainConfig, data: RunData, *, rank: int, world: int, vocab: Vocab | None) -> torch.nn.Module:
    """The model before FSDP (a tiny one sized to `vocab`); with packing, every dataset's seq_len checked against a
    row."""
    net = build_model(ModelOptions.of(cfg), vocab)
    if cfg.pack_to:
        # Every dataset's seq_len must fit a row; the log line speaks of the first.
        line = [check_packing(pack_to=cfg.pack_to, pack_window=cfg.pack_window, manifest=ds.manifest,
                              model_type=str(net.config.model_type), world=world) for ds in data.datasets][0]
        if rank == 0:
            print(line, file=sys.stderr)
    return net


def resume_state(cfg: TrainConfig, out: Path, *, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, rank: int) -> TrainState:
    """The step, epoch, stream position and packer state to start from: with --resume and a checkpoint, the
    checkpoint's (model, optimizer and RNG states loaded too); else zeros."""
    found = load_latest(out, net=net, optimizer=optimizer, device=device, packing=bool(cfg.pack_to)) \
        if cfg.resume else None
    if found is None:
        torch.manual_seed(cfg.seed + 1 + rank)  # dropout masks differ per rank; a resume restores them instead
        return TrainState(step=0, epoch=0, position=0, pack_state=[])
    ckpt, r = found
    if rank == 0:
        print(f"trainer: resumed from {ckpt} (step {r.step}, epoch {r.epoch})", file=sys.stderr)
    return r


@dataclass(kw_only=True, eq=False)
class Session:
    """One rank's training from its start step to its final checkpoint: what the loop uses, and the state it
    advances (`last`: the newest step's metrics row)."""

    cfg: TrainConfig
    data: RunData
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: StepLoader
    patchifier: Patchifier
    evals: list[EvalSet]
    log: RunLog | None
    flop_counter: FlopCounter
    peak: float | None
    total: int | None  # the run's steps; None: until the data ends
    schedule_len: int  # the LR schedule's length
    rank: int
    world: int
    device: torch.device
    out: Path
    step: int
    epoch: int
    position: int  # the stream position this session entered its epoch at (0 once an epoch ends)
    saved_at: int  # the step of the newest checkpoint
    last: dict | None = None
    mixed_so_far: list[float] = field(default_factory=list)  # trained tokens per source (mixtures)

    @property
    def names(self) -> list[str]:
        """The datasets' names, in mixture order."""
        return [d.name for d in self.data.specs]

    def loop(self) -> None:
        """Steps until the step budget or the epochs run out: each step trains one batch of micro-batches, logs, and
        evaluates and checkpoints on their cadence; a new epoch starts its data afresh."""
        cfg, steps_in_epoch = self.cfg, 0
        # A run resumed from its final checkpoint (epoch == epochs) has nothing left: the step count alone
        # does not say so when it is not known up front (token budget, packing).
        while (self.total is None or self.step < self.total) and (cfg.max_steps or self.epoch < cfg.epochs):
            t0 = time.perf_counter()
            if self.data.watch is not None:
                self.data.watch.check()  # a build replacing the dataset stops the run here (trainer/data/integrity.py)
            micro_batches = self.loader.next_step()
            wait = time.perf_counter() - t0
            totals = all_sum([sum(b.num_trained for b in micro_batches), sum(b.num_samples for b in micro_batches),
                              sum(b.num_tokens for b in micro_batches)], self.device)
            if totals[1] == 0:  # every rank is exhausted: the epoch is over everywhere at once
                if steps_in_epoch == 0 and self.position == 0:
                    raise DataError(f"--data {self.data.label} yielded no samples")
                self.epoch, self.position, steps_in_epoch = self.epoch + 1, 0, 0
                if not cfg.max_steps and self.epoch >= cfg.epochs:
                    break
                self.loader.start(self.epoch, 0)
                continue
            self.train_one(micro_batches, totals, t0=t0, wait=wait)
            steps_in_epoch += 1
            # eval before the checkpoint: a resume keeps its row
            if self.evals and cfg.eval_every and self.step % cfg.eval_every == 0:
                evaluate(self.net, self.evals, step=self.step, device=self.device, patchifier=self.patchifier,
                         log=self.log)
            if cfg.save_every and self.step % cfg.save_every == 0:
                state = TrainState(step=self.step, epoch=self.epoch, position=self.loader.position,
                                   pack_state=self.loader.pack_state)
                save_checkpoint(self.out, state, net=self.net, optimizer=self.optimizer, device=self.device,
                                keep_checkpoints=cfg.keep_checkpoints)
                self.saved_at = self.step

    def train_one(self, micro_batches: list[Batch], totals: list[float], *, t0: float, wait: float) -> None:
        """One optimizer step over the global (trained, samples, tokens) `totals`, and its metrics row."""
        cfg, names, world = self.cfg, self.names, self.world
        trained, samples, tokens = totals
        lr = lr_at(self.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total=self.schedule_len,
                   min_lr_ratio=cfg.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        by_source = torch.zeros(2, len(names), dtype=torch.float64) if len(names) > 1 else None
        local_loss, grad_norm = train_step(self.net, self.optimizer, micro_batches, patchifier=self.patchifier,
                                           global_trained=trained, max_grad_norm=cfg.max_grad_norm,
                                           by_source=by_source)
        self.step += 1
        (loss_sum, *per_source) = all_sum([local_loss] + (by_source.flatten().tolist() if len(names) > 1 else []),
                                          self.device)
        mine = ([i for b in micro_batches for i in b.sample_ids], wait, sum(b.num_tokens for b in micro_batches),
                sum(b.rows for b in micro_batches), self.flop_counter.step(micro_batches) if self.peak else 0.0)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        dt = time.perf_counter() - t0
        last = {"step": self.step, "epoch": self.epoch, "loss": loss_sum / trained, "lr": lr, "grad_norm": grad_norm,
                "num_samples": int(samples), "num_tokens": int(tokens), "num_trained_tokens": int(trained),
                "tokens_per_s": tokens / dt, "samples_per_s": samples / dt, "step_time_s": dt,
                "data_wait_s": max(g[1] for g in gathered), "data_wait_frac": max(g[1] for g in gathered) / dt,
                "sample_ids": [i for g in gathered for i in g[0]], "samples_per_rank": [len(g[0]) for g in gathered],
                "segments": int(samples), "tokens_per_rank": [g[2] for g in gathered],
                "max_over_mean_tokens": max(g[2] for g in gathered) * world / max(tokens, 1)}
        if len(names) > 1:
            losses, counts = per_source[:len(names)], per_source[len(names):]
            last["tokens_by_source"] = {n: int(c) for n, c in zip(names, counts)}
            last["loss_by_source"] = {n: (x / c if c else None) for n, x, c in zip(names, losses, counts)}
            self.mixed_so_far = [a + c for a, c in zip(self.mixed_so_far, counts)]
        if cfg.pack_to:
            last["pack_fill"] = tokens / max(sum(g[3] for g in gathered) * cfg.pack_to, 1)
            if self.rank == 0 and self.step == 1:
                print(f"trainer: first step's rows are {last['pack_fill']:.1%} full", file=sys.stderr)
        if self.peak:
            last["mfu"] = sum(g[4] for g in gathered) / (dt * self.peak * world)
        self.last = last
        if self.log is not None:
            self.log.step(last)

    def finish(self) -> None:
        """After the loop: the last eval and checkpoint where the last step did not make them, the HF export and
        rank 0's closing lines."""
        cfg, step, loader, out, last = self.cfg, self.step, self.loader, self.out, self.last
        if last is None and self.rank == 0:  # resumed from its final checkpoint: say so, then do what is left
            length = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--epochs {cfg.epochs}"
            self._say(f"trainer: nothing left to train: {out} finished at step {step} ({length}); raise --max-steps "
                      "or --epochs to train further")
        if self.evals and (not (cfg.eval_every and step % cfg.eval_every == 0) if last is not None
                           else not self._eval_logged()):
            evaluate(self.net, self.evals, step=step, device=self.device, patchifier=self.patchifier, log=self.log)
        if step != self.saved_at:
            same = loader.epoch == self.epoch
            state = TrainState(step=step, epoch=self.epoch, position=loader.position if same else 0,
                               pack_state=(loader.pack_state if same else empty_state(cfg.pack_to, cfg.pack_window))
                               if cfg.pack_to else [])
            save_checkpoint(out, state, net=self.net, optimizer=self.optimizer, device=self.device,
                            keep_checkpoints=cfg.keep_checkpoints)
        if cfg.save_hf and self.rank == 0:
            from trainer.export import ExportConfig, export_run

            hf = export_run(ExportConfig(run=str(out), out=str(out / "hf"), dtype=cfg.export_dtype, overwrite=True))
            print(f"trainer: exported {hf} ({cfg.export_dtype})", file=sys.stderr)
        if self.rank == 0 and last is not None:
            names, specs, mixed_so_far = self.names, self.data.specs, self.mixed_so_far
            if len(names) > 1 and sum(mixed_so_far):
                weights = sum(x.weight for x in specs)
                shares = ", ".join(f"{n} {c / sum(mixed_so_far):.3f} (weight {d.weight / weights:.3f})"
                                   for n, c, d in zip(names, mixed_so_far, specs))
                print(f"trainer: realized trained-token shares this session: {shares}", file=sys.stderr)
            self._say(f"trainer: done at step {step}: loss {last['loss']:.4f}, lr {last['lr']:.3g}, "
                      f"grad_norm {last['grad_norm']:.3f}, run dir {out}")

    def _say(self, line: str) -> None:
        """A closing line: on stdout and in RUN/train.log (rank 0)."""
        print(line)
        if self.log is not None:
            self.log.note(line)

    def _eval_logged(self) -> bool:
        """Whether metrics.jsonl holds this step's eval of these sets already (rank 0 reads, every rank agrees)."""
        names = [s.name for s in self.evals]
        done = float(self.rank == 0 and eval_logged(self.out, self.step, names if len(names) > 1 else None))
        return all_sum([done], self.device)[0] > 0


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
    out = Path(cfg.out)
    loader = log = None
    owner = contextlib.ExitStack()
    try:
        data = open_data(cfg, world)
        cfg = fit_span(cfg, data, world)  # under --shard-cache-limit: shuffle blocks that fit the cache
        datasets, spec = data.datasets, data.image
        owner.enter_context(own_run_dir(out))  # before anything in RUN is read or written
        processor = processor_dir(cfg, data, BY_NAME.get(cfg.tiny_random), owner)
        vocab = tiny_vocab(cfg.tiny_random, processor)
        start_run(cfg, data, rank=rank, world=world, out=out, vocab=vocab)
        net = make_model(cfg, data, rank=rank, world=world, vocab=vocab)
        flop_counter, peak = FlopCounter(net), peak_flops(device)
        collate_spec = collate_spec_of(net, data, processor)
        check = shard_check(cfg, out, rank)
        evals = eval_sets(cfg, rank=rank, world=world, spec=spec, collate_spec=collate_spec,
                          train_data=datasets[0], model_type=str(net.config.model_type), check=check)
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(net, init_device_mesh(device.type, (world,)), bf16=bf16)
        optimizer = build_optimizer(cfg, net)
        loader, total, schedule_len = make_loader(cfg, data, rank=rank, world=world, device=device,
                                                  collate_spec=collate_spec, out=out, check=check)
        resumed = resume_state(cfg, out, net=net, optimizer=optimizer, device=device, rank=rank)
        step, epoch, position = resumed.step, resumed.epoch, resumed.position
        loader.start(epoch, position, resumed.pack_state)
        patchifier = Patchifier(spec, device)
        # Step lines on stdout unless a progress bar shows the run there (a terminal): Slurm and nohup logs read them.
        log = RunLog(out, total_steps=total, start_step=step, progress=cfg.progress, tensorboard=cfg.tensorboard,
                     log_every=cfg.log_every, echo=not (cfg.progress and sys.stdout.isatty())) if rank == 0 else None
        session = Session(cfg=cfg, data=data, net=net, optimizer=optimizer, loader=loader, patchifier=patchifier,
                          evals=evals, log=log, flop_counter=flop_counter, peak=peak, total=total,
                          schedule_len=schedule_len, rank=rank, world=world, device=device, out=out, step=step,
                          epoch=epoch, position=position, saved_at=step,
                          mixed_so_far=[0.0] * len(data.specs))
        session.loop()
        session.finish()
        return session.last
    finally:
        if log is not None:
            log.close()
        if loader is not None:
            loader.close()
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
