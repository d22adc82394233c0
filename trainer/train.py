"""Training: config -> distributed init -> model -> FSDP2 -> optimizer -> data -> checkpoint load -> loop of
train_step (loss = summed token losses / global trained-token count) -> metrics, checkpoints -> cleanup.
"""
from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import (check_resumable, latest_checkpoint, load_checkpoint, run_identity, save_checkpoint,
                                start_run_dir)
from trainer.collate import Batch, CollateSpec, keep_freed_buffers
from trainer.config import ConfigError, TrainConfig, parse_args
from trainer.data import StepLoader, steps_per_epoch
from trainer.metrics import FlopCounter, RunLog, peak_flops
from trainer.model import apply_fsdp, build_model, forward_loss, image_token_id, model_identity
from trainer.pack import check_packing, empty_state
from trainer.shards import DataError, load_image_processor_config, plan_shards, resolve_data
from trainer.vision import ImageSpec, Patchifier


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine to lr * min_ratio at `total`; `step` counts from 0."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


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


def all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def build_optimizer(cfg: TrainConfig, net: torch.nn.Module) -> torch.optim.AdamW:
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps)


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Batch], *,
               patchifier: Patchifier, device: torch.device, global_trained: float,
               max_grad_norm: float) -> tuple[float, float]:
    """Forward/backward every micro-batch, clip, step. Returns (this rank's summed token loss, global grad norm).
    Dividing each micro-batch's sum by the global count makes the summed gradient the exact token mean."""
    local_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        mb = mb.to(device)
        loss_sum = forward_loss(net, mb, patchifier(mb.images, mb.image_index))
        (loss_sum / max(global_trained, 1.0)).backward()
        local_sum += loss_sum.detach().double()
    params = [p for p in net.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(local_sum), float(norm)


def _load_spec(cfg: TrainConfig, processor: str | None) -> ImageSpec:
    location = cfg.processor or processor
    if not location:
        raise ConfigError(f"--data {cfg.data} has no manifest to find the processor: pass --processor DIR")
    try:
        return ImageSpec.from_config(load_image_processor_config(location))
    except ValueError as e:
        raise DataError(f"{location}: {e}") from None


def run(cfg: TrainConfig) -> dict | None:
    keep_freed_buffers()
    rank, world, device = init_distributed(cfg.device)
    out = Path(cfg.out)
    loader = log = None
    try:
        source = resolve_data(cfg.data)
        spec = _load_spec(cfg, source.processor)
        plan = plan_shards(source.shards, world)
        identity = run_identity(cfg, shards=source.shards, manifest=source.manifest, image_config=spec.config,
                                model=model_identity(model=cfg.model, tiny_random=cfg.tiny_random), world=world)
        if cfg.resume:
            check_resumable(out, identity, cfg.data)
        dist.barrier()  # every rank checked before rank 0 changes the run dir
        if rank == 0:
            start_run_dir(out, identity, cfg.data, resume=cfg.resume)
            (out / "config.toml").write_text(cfg.to_toml(), encoding="utf-8")
            counts = ", ".join(f"rank {r}: {len(s)} shards {t} {'tokens' if source.counted else 'shards'}"
                               for r, (s, t) in enumerate(zip(plan.per_rank, plan.rank_tokens)))
            if plan.stride:
                counts = f"fewer shards than ranks: every rank reads all shards and decodes one sample in {world}"
            print(f"trainer: {len(source.shards)} shards over {world} ranks ({counts}); max/mean imbalance "
                  f"{plan.imbalance:.3f}; remainder policy 'pad': ranks that run out first take empty "
                  f"micro-batches until all ranks are done, so no sample is dropped", file=sys.stderr)
        net = build_model(model=cfg.model, tiny_random=cfg.tiny_random, seed=cfg.seed,
                          attn_implementation=cfg.attn_implementation,
                          activation_checkpointing=cfg.activation_checkpointing, lora_rank=cfg.lora_rank,
                          lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, freeze_vision=cfg.freeze_vision)
        if cfg.pack_to:
            line = check_packing(pack_to=cfg.pack_to, window=cfg.pack_window, manifest=source.manifest,
                                 model_type=str(net.config.model_type))
            if rank == 0:
                print(line, file=sys.stderr)
        flop_counter, peak = FlopCounter(net), peak_flops(device)
        collate_spec = CollateSpec(pad_id=int(getattr(net.config, "pad_token_id", None) or 0),
                                   image_token_id=image_token_id(net), patch_size=spec.patch_size,
                                   merge_size=spec.merge_size)
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(net, init_device_mesh(device.type, (world,)), bf16=bf16)
        optimizer = build_optimizer(cfg, net)
        per_epoch = steps_per_epoch(list(plan.rank_samples), micro_batch_size=cfg.micro_batch_size,
                                    max_tokens=cfg.max_tokens_per_batch, grad_accum=cfg.grad_accum,
                                    pack_to=cfg.pack_to)
        total = cfg.max_steps or (per_epoch * cfg.epochs if per_epoch is not None else None)
        schedule = cfg.schedule_steps or total
        if schedule is None:
            raise ConfigError("the number of steps is not known up front (token budget, packing or no manifest): "
                              "pass --max-steps or --schedule-steps")
        loader = StepLoader([source.shards[i] for i in plan.per_rank[rank]], spec=spec, collate_spec=collate_spec,
                            seed=cfg.seed, shuffle=cfg.shuffle_shards, micro_batch_size=cfg.micro_batch_size,
                            max_tokens=cfg.max_tokens_per_batch, grad_accum=cfg.grad_accum,
                            num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                            stride=(rank, world) if plan.stride else (0, 1), pack_to=cfg.pack_to,
                            pack_window=cfg.pack_window)
        step, epoch, position, pack_state = 0, 0, 0, []
        ckpt = latest_checkpoint(out) if cfg.resume else None
        if ckpt is not None:
            r = load_checkpoint(ckpt, net=net, optimizer=optimizer, device=device, packing=bool(cfg.pack_to))
            step, epoch, position, pack_state = r.step, r.epoch, r.position, r.pack_state
            if rank == 0:
                print(f"trainer: resumed from {ckpt} (step {step}, epoch {epoch})", file=sys.stderr)
        if ckpt is None:
            torch.manual_seed(cfg.seed + 1 + rank)  # dropout masks differ per rank; a resume restores them instead
        loader.start(epoch, position, pack_state)
        patchifier = Patchifier(spec, device)
        log = RunLog(out, total_steps=total, start_step=step, progress=cfg.progress) if rank == 0 else None
        saved_at, steps_in_epoch, last = step, 0, None
        # A run resumed from its final checkpoint (epoch == epochs) has nothing left: the step count alone
        # does not say so when it is not known up front (token budget, packing).
        while (total is None or step < total) and (cfg.max_steps or epoch < cfg.epochs):
            t0 = time.perf_counter()
            micro_batches = loader.next_step()
            wait = time.perf_counter() - t0
            trained, samples, tokens = all_sum([sum(b.num_trained for b in micro_batches),
                                               sum(b.num_samples for b in micro_batches),
                                               sum(b.num_tokens for b in micro_batches)], device)
            if samples == 0:  # every rank is exhausted: the epoch is over everywhere at once
                if steps_in_epoch == 0 and position == 0:
                    raise DataError(f"--data {cfg.data} yielded no samples")
                epoch, position, steps_in_epoch = epoch + 1, 0, 0
                if not cfg.max_steps and epoch >= cfg.epochs:
                    break
                loader.start(epoch, 0)
                continue
            lr = lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, total=schedule, min_ratio=cfg.min_lr_ratio)
            for g in optimizer.param_groups:
                g["lr"] = lr
            local_loss, grad_norm = train_step(net, optimizer, micro_batches, patchifier=patchifier, device=device,
                                               global_trained=trained, max_grad_norm=cfg.max_grad_norm)
            step, steps_in_epoch = step + 1, steps_in_epoch + 1
            (loss_sum,) = all_sum([local_loss], device)
            mine = ([i for b in micro_batches for i in b.sample_ids], wait, sum(b.num_tokens for b in micro_batches),
                    sum(b.rows for b in micro_batches), flop_counter.step(micro_batches) if peak else 0.0)
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            dt = time.perf_counter() - t0
            last = {"step": step, "epoch": epoch, "loss": loss_sum / trained, "lr": lr, "grad_norm": grad_norm,
                    "num_samples": int(samples), "num_tokens": int(tokens), "num_trained_tokens": int(trained),
                    "tokens_per_s": tokens / dt, "samples_per_s": samples / dt, "step_time_s": dt,
                    "data_wait_s": max(g[1] for g in gathered), "data_wait_frac": max(g[1] for g in gathered) / dt,
                    "sample_ids": [i for g in gathered for i in g[0]], "samples_per_rank": [len(g[0]) for g in gathered],
                    "segments": int(samples), "tokens_per_rank": [g[2] for g in gathered],
                    "max_over_mean_tokens": max(g[2] for g in gathered) * world / max(tokens, 1)}
            if cfg.pack_to:
                last["pack_fill"] = tokens / max(sum(g[3] for g in gathered) * cfg.pack_to, 1)
                if rank == 0 and step == 1:
                    print(f"trainer: first step's rows are {last['pack_fill']:.1%} full", file=sys.stderr)
            if peak:
                last["mfu"] = sum(g[4] for g in gathered) / (dt * peak * world)
            if log is not None:
                log.step(last)
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint(out, step=step, epoch=epoch, position=loader.position, net=net, optimizer=optimizer,
                                device=device, keep=cfg.keep_checkpoints, pack_state=loader.pack_state)
                saved_at = step
        if step != saved_at:
            same = loader.epoch == epoch
            save_checkpoint(out, step=step, epoch=epoch, position=loader.position if same else 0, net=net,
                            optimizer=optimizer, device=device, keep=cfg.keep_checkpoints,
                            pack_state=(loader.pack_state if same else empty_state(cfg.pack_to, cfg.pack_window))
                            if cfg.pack_to else None)
        if cfg.save_hf and rank == 0:
            from trainer.export import ExportConfig, export_run

            hf = export_run(ExportConfig(run=str(out), out=str(out / "hf"), dtype=cfg.export_dtype, overwrite=True))
            print(f"trainer: exported {hf} ({cfg.export_dtype})", file=sys.stderr)
        if rank == 0 and last is not None:
            print(f"trainer: done at step {step}: loss {last['loss']:.4f}, lr {last['lr']:.3g}, "
                  f"grad_norm {last['grad_norm']:.3f}, run dir {out}")
        return last
    finally:
        if log is not None:
            log.close()
        if loader is not None:
            loader.close()
        dist.destroy_process_group()


def _one_line(e: Exception) -> str:
    text = str(e)
    if "\nOriginal Traceback" in text:  # re-raised from a DataLoader worker: keep the worker's own message
        last = text.rstrip().splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except (ConfigError, DataError) as e:
        if os.environ.get("TRAINER_DEBUG"):
            raise
        rank = os.environ.get("RANK")
        print(f"trainer: error{f' (rank {rank})' if rank else ''}: {_one_line(e)}", file=sys.stderr)
        return 1
    return 0
