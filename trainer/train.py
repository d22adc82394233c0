"""Training: config -> distributed init -> data (trainer/data/: the datasets checked, this rank's read plan) -> model
-> FSDP2 -> optimizer -> the rank's step loader -> checkpoint load -> loop of train_step (loss = summed token losses /
global trained-token count) -> metrics, checkpoints -> cleanup. The set-up steps are trainer/startup.py's; the loop is
a rank's Session here, from its start step to its final checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import sys
import time
from dataclasses import InitVar, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import TrainState, own_run_dir, recorded_versions, save_checkpoint
from trainer.cli import parse_args
from trainer.config import ConfigError, TrainConfig
from trainer.data import (
    Batch,
    DataError,
    EvalSet,
    Patchifier,
    RunData,
    StepLoader,
    data_streams,
    empty_state,
    eval_loaders,
    keep_freed_buffers,
    make_loader,
    open_data,
    processor_dir,
    read_plan,
    set_read_timeout,
    token_sources,
)
from trainer.distributed import all_sum, die_with_launcher, init_distributed
from trainer.evaluate import evaluate
from trainer.export import ExportConfig, export_ready, export_run
from trainer.follow import RunVersions
from trainer.metrics import FlopCounter, RunLog, eval_logged, peak_flops
from trainer.model import collate_spec_of, forward_loss, model_identity, model_type_of, routed_line, tiny_vocab
from trainer.options import Batching, Checkpointing, DataOptions, ModelOptions, Optimization, RunLength
from trainer.startup import build_optimizer, lr_at, make_model, resume_state, run_log, shard_model, start_run
from vlmprep_schemas.boundary import UnsafeWrite
from vlmprep_schemas.terminal import for_terminal


def train_step(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Batch],
    *,
    patchifier: Patchifier,
    global_trained: float,
    max_grad_norm: float,
    by_source: torch.Tensor | None = None,
) -> tuple[float, float]:
    """Forward/backward every micro-batch on the patchifier's device, clip, step. Returns (this rank's summed token
    loss, global grad norm). Dividing each micro-batch's sum by the global count makes the summed gradient the exact
    token mean. `by_source` ([2, S] zeros, a mixture of S datasets) receives this rank's loss sums and trained tokens
    per source."""
    device = patchifier.device
    local_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        mb = mb.to(device)
        # Qwen's families and GLM: pixels patchified here, on the device (Gemma 3's normalized, Gemma 4's patchified
        # and padded, Mllama's tiled, Llama 4's, InternVL's and SmolVLM's uint8 from the host rescaled + normalized);
        # the others' came made by the host (mb.vision).
        pixels, videos = patchifier.inputs(mb)
        if by_source is None:
            loss_sum = forward_loss(net, mb, pixels, pixel_values_videos=videos)
        else:
            loss_sum, losses, counts = forward_loss(
                net, mb, pixels, sources=(token_sources(mb), by_source.shape[1]), pixel_values_videos=videos
            )
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


@dataclass(kw_only=True, eq=False)
class Session:
    """One rank's training from its start step to its final checkpoint: what the loop uses, and the state it
    advances (`last`: the newest step's metrics row)."""

    length: RunLength
    optim: Optimization
    ckpt: Checkpointing
    batching: Batching
    eval_every: int
    data: RunData
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: StepLoader
    evals: list[EvalSet]
    log: RunLog | None
    flop_counter: FlopCounter
    total: int | None  # the run's steps; None: until the data ends
    schedule_len: int  # the LR schedule's length
    rank: int
    device: torch.device
    resumed: InitVar[TrainState]  # where this session starts (resume_state): its step, epoch and stream position
    versions: RunVersions | None = None  # the datasets' versions epoch by epoch (a --follow run moves them)
    # made from the above by __post_init__
    world: int = field(init=False)
    out: Path = field(init=False)
    patchifier: Patchifier = field(init=False)
    peak: float | None = field(init=False)  # the device's peak FLOP/s (MFU); None where unknown
    step: int = field(init=False)
    epoch: int = field(init=False)
    position: int = field(init=False)  # the stream position this session entered its epoch at (0 once an epoch ends)
    saved_at: int = field(init=False)  # the step of the newest checkpoint
    mixed_so_far: list[float] = field(init=False)  # trained tokens per source (mixtures)
    last: dict | None = None

    def __post_init__(self, resumed: TrainState) -> None:
        """The session's place (ranks, run dir, device) and its state at the resumed step."""
        self.world, self.out = self.data.world, Path(self.ckpt.out)
        self.patchifier, self.peak = Patchifier(self.data.image, self.device), peak_flops(self.device)
        self.step, self.epoch, self.position = resumed.step, resumed.epoch, resumed.position
        self.saved_at = resumed.step
        self.mixed_so_far = [0.0] * len(self.data.specs)

    @property
    def names(self) -> list[str]:
        """The datasets' names, in mixture order."""
        return [d.name for d in self.data.specs]

    def loop(self) -> None:
        """Steps until the step budget or the epochs run out: each step trains one batch of micro-batches, logs, and
        evaluates and checkpoints on their cadence; a new epoch starts its data afresh."""
        length, ckpt, eval_every, steps_in_epoch = self.length, self.ckpt, self.eval_every, 0
        # A run resumed from its final checkpoint (epoch == epochs) has nothing left: the step count alone
        # does not say so when it is not known up front (token budget, packing).
        while (self.total is None or self.step < self.total) and (length.max_steps or self.epoch < length.epochs):
            t0 = time.perf_counter()
            if self.data.watch is not None:
                self.data.watch.check()  # a build replacing the dataset stops the run here (trainer/data/integrity.py)
            micro_batches = self.loader.next_step()
            wait = time.perf_counter() - t0
            totals = all_sum(
                [
                    sum(b.num_trained for b in micro_batches),
                    sum(b.num_samples for b in micro_batches),
                    sum(b.num_tokens for b in micro_batches),
                ],
                self.device,
            )
            if totals[1] == 0:  # every rank is exhausted: the epoch is over everywhere at once
                if steps_in_epoch == 0 and self.position == 0:
                    raise DataError(f"--data {self.data.label} yielded no samples")
                self.epoch, self.position, steps_in_epoch = self.epoch + 1, 0, 0
                if not length.max_steps and self.epoch >= length.epochs:
                    break
                if self.versions is not None and self.versions.options.follow:  # newer versions from this epoch on
                    self.data = self.versions.at_epoch(self.epoch, self.step, self.data, self.loader, self.log)
                self.loader.start(self.epoch, 0)
                continue
            self.train_one(micro_batches, totals, t0=t0, wait=wait)
            steps_in_epoch += 1
            # eval before the checkpoint: a resume keeps its row
            if self.evals and eval_every and self.step % eval_every == 0:
                evaluate(
                    self.net, self.evals, step=self.step, device=self.device, patchifier=self.patchifier, log=self.log
                )
            if ckpt.save_every and self.step % ckpt.save_every == 0:
                state = TrainState(
                    step=self.step,
                    epoch=self.epoch,
                    position=self.loader.position,
                    pack_state=self.loader.pack_state,
                    versions=self.data.versions(),
                )
                save_checkpoint(
                    self.out,
                    state,
                    net=self.net,
                    optimizer=self.optimizer,
                    device=self.device,
                    keep_checkpoints=ckpt.keep_checkpoints,
                )
                self.saved_at = self.step

    def train_one(self, micro_batches: list[Batch], totals: list[float], *, t0: float, wait: float) -> None:
        """One optimizer step over the global (trained, samples, tokens) `totals`, and its metrics row."""
        optim, names, world = self.optim, self.names, self.world
        trained, samples, tokens = totals
        lr = lr_at(
            self.step,
            lr=optim.lr,
            warmup_steps=optim.warmup_steps,
            total=self.schedule_len,
            min_lr_ratio=optim.min_lr_ratio,
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        by_source = torch.zeros(2, len(names), dtype=torch.float64) if len(names) > 1 else None
        local_loss, grad_norm = train_step(
            self.net,
            self.optimizer,
            micro_batches,
            patchifier=self.patchifier,
            global_trained=trained,
            max_grad_norm=optim.max_grad_norm,
            by_source=by_source,
        )
        self.step += 1
        (loss_sum, *per_source) = all_sum(
            [local_loss] + (by_source.flatten().tolist() if len(names) > 1 else []), self.device
        )
        mine = (
            [i for b in micro_batches for i in b.sample_ids],
            wait,
            sum(b.num_tokens for b in micro_batches),
            sum(b.rows for b in micro_batches),
            self.flop_counter.step(micro_batches) if self.peak else 0.0,
            sum(b.input_ids.numel() for b in micro_batches),  # token positions, padding included
        )
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        dt = time.perf_counter() - t0
        last = {
            "step": self.step,
            "epoch": self.epoch,
            "loss": loss_sum / trained,
            "lr": lr,
            "grad_norm": grad_norm,
            "num_samples": int(samples),
            "num_tokens": int(tokens),
            "num_trained_tokens": int(trained),
            "tokens_per_s": tokens / dt,
            "samples_per_s": samples / dt,
            "step_time_s": dt,
            "data_wait_s": max(g[1] for g in gathered),
            "data_wait_frac": max(g[1] for g in gathered) / dt,
            "sample_ids": [i for g in gathered for i in g[0]],
            "samples_per_rank": [len(g[0]) for g in gathered],
            "segments": int(samples),
            "tokens_per_rank": [g[2] for g in gathered],
            "max_over_mean_tokens": max(g[2] for g in gathered) * world / max(tokens, 1),
            "padding_frac": 1.0 - tokens / max(sum(g[5] for g in gathered), 1),
        }
        if len(names) > 1:
            losses, counts = per_source[: len(names)], per_source[len(names) :]
            last["tokens_by_source"] = {n: int(c) for n, c in zip(names, counts)}
            last["loss_by_source"] = {n: (x / c if c else None) for n, x, c in zip(names, losses, counts)}
            self.mixed_so_far = [a + c for a, c in zip(self.mixed_so_far, counts)]
        if self.batching.pack_to:
            last["pack_fill"] = tokens / max(sum(g[3] for g in gathered) * self.batching.pack_to, 1)
            if self.rank == 0 and self.step == 1:
                print(f"trainer: first step's rows are {last['pack_fill']:.1%} full", file=sys.stderr)
        if self.rank == 0 and self.step == 1 and (line := routed_line(sum(g[5] for g in gathered), tokens, self.net)):
            print(line, file=sys.stderr)
        if self.peak:
            last["mfu"] = sum(g[4] for g in gathered) / (dt * self.peak * world)
        self.last = last
        if self.log is not None:
            self.log.step(last)

    def finish(self) -> None:
        """After the loop: the last eval and checkpoint where the last step did not make them, the HF export and
        rank 0's closing lines."""
        length, ckpt, batching = self.length, self.ckpt, self.batching
        step, loader, out, last = self.step, self.loader, self.out, self.last
        if last is None and self.rank == 0:  # resumed from its final checkpoint: say so, then do what is left
            until = f"--max-steps {length.max_steps}" if length.max_steps else f"--epochs {length.epochs}"
            self._say(
                f"trainer: nothing left to train: {out} finished at step {step} ({until}); raise --max-steps "
                "or --epochs to train further"
            )
        if self.evals and (
            not (self.eval_every and step % self.eval_every == 0) if last is not None else not self._eval_logged()
        ):
            evaluate(self.net, self.evals, step=step, device=self.device, patchifier=self.patchifier, log=self.log)
        if step != self.saved_at:
            same = loader.epoch == self.epoch
            state = TrainState(
                step=step,
                epoch=self.epoch,
                position=loader.position if same else 0,
                pack_state=(loader.pack_state if same else empty_state(batching.pack_to, batching.pack_window))
                if batching.pack_to
                else [],
                versions=self.data.versions(),
            )
            save_checkpoint(
                out,
                state,
                net=self.net,
                optimizer=self.optimizer,
                device=self.device,
                keep_checkpoints=ckpt.keep_checkpoints,
            )
        if ckpt.save_hf and self.rank == 0:
            hf = export_run(ExportConfig(run=str(out), out=str(out / "hf"), dtype=ckpt.export_dtype, overwrite=True))
            print(f"trainer: exported {hf} ({ckpt.export_dtype})", file=sys.stderr)
        if self.rank == 0 and last is not None:
            names, specs, mixed_so_far = self.names, self.data.specs, self.mixed_so_far
            if len(names) > 1 and sum(mixed_so_far):
                weights = sum(x.weight for x in specs)
                shares = ", ".join(
                    f"{n} {c / sum(mixed_so_far):.3f} (weight {d.weight / weights:.3f})"
                    for n, c, d in zip(names, mixed_so_far, specs)
                )
                print(f"trainer: realized trained-token shares this session: {shares}", file=sys.stderr)
            self._say(
                f"trainer: done at step {step}: loss {last['loss']:.4f}, lr {last['lr']:.3g}, "
                f"grad_norm {last['grad_norm']:.3f}, run dir {out}"
            )

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
    batching, optim, ckpt, length = Batching.of(cfg), Optimization.of(cfg), Checkpointing.of(cfg), RunLength.of(cfg)
    out = Path(ckpt.out)
    owner = contextlib.ExitStack()  # what the run holds, released in reverse: the log, loader, processor, RUN's lock
    try:
        model_type = model_type_of(model=cfg.model, tiny_random=cfg.tiny_random)
        pins = recorded_versions(out) if ckpt.resume else None  # a resumed run reads the versions it read
        data = open_data(DataOptions.of(cfg), model_type=model_type, packing=bool(cfg.pack_to), world=world, pins=pins)
        plan = read_plan(DataOptions.of(cfg), data, rank=rank)
        # under --shard-cache-limit: shuffle blocks that fit the cache, written to config.toml and compared on resume
        data_options = DataOptions.of(cfg := dataclasses.replace(cfg, shuffle_span=plan.shuffle_span))
        owner.enter_context(own_run_dir(out))  # before anything in RUN is read or written
        export_ready(data.processor, ckpt, data_options, rank=rank, world=world)  # --save-hf's needs, now
        processor = processor_dir(data, owner, model_type=model_type, tiny=bool(cfg.tiny_random))
        vocab = tiny_vocab(cfg.tiny_random, processor)
        model = model_identity(model=cfg.model, tiny_random=cfg.tiny_random, vocab=vocab)
        versions = RunVersions.of(
            data, pins, data_options, plan, batching=batching, length=length, device=device, model_type=model_type
        )
        identity = versions.identity(cfg.resume_identity(), data, model=model, world=world)
        start_run(identity, data, rank=rank, ckpt=ckpt, config_toml=cfg.to_toml(), versions=versions.record)
        net = make_model(ModelOptions.of(cfg), batching, data, rank=rank, vocab=vocab)
        flop_counter, collate_spec = FlopCounter(net), collate_spec_of(net, data, processor)
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
        read = data_streams(data_options, plan, data, batching=batching, length=length, device=device)
        loader, total, schedule_len = make_loader(read, data_options, collate_spec, batching=batching, length=length)
        owner.callback(loader.close)
        total, schedule_len = versions.lengths(total, schedule_len)
        resumed = resume_state(ckpt, net, optimizer, seed=cfg.seed, packing=bool(cfg.pack_to), device=device, rank=rank)
        data = versions.resume(resumed, data, loader)  # a --follow run back at its checkpoint's versions
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
            versions=versions,
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
        line = f"trainer: error{f' (rank {rank})' if rank else ''}: {_one_line(e)}{hint}"
        print(for_terminal(line), file=sys.stderr)  # it may quote a dataset's text or a server's: escaped
        return 1
    return 0
