"""Held-out eval: each eval set's shards split over the ranks (disjoint, no shuffle) -> the training collate or
packing -> forwards without gradients -> the token-weighted mean loss over the whole set and all ranks, a
metrics.jsonl row. The training stream is left as it was: own loaders, torch's RNG and every module's mode restored.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from trainer.config import ConfigError, TrainConfig
from trainer.data.batches import StepLoader
from trainer.data.collate import CollateSpec
from trainer.data.decode import trains_videos
from trainer.data.integrity import ShardCheck, check_local_shards
from trainer.data.pack import check_packing
from trainer.data.processors import processor_difference
from trainer.data.sources import DataSource, plan_shards, resolve_data
from trainer.data.streams import ShardSequence
from trainer.data.vision import ImageSpec, Patchifier
from trainer.metrics import plural
from trainer.model import forward_loss
from trainer.options import Batching


@dataclass
class EvalSet:
    """One held-out dataset: its name ('' for a single unnamed set) and this rank's loader over it."""

    name: str  # '' for a single unnamed eval set
    loader: StepLoader  # this rank's part, started afresh at every eval


def eval_sets(cfg: TrainConfig, *, rank: int, world: int, spec: ImageSpec, collate_spec: CollateSpec,
              train_data: DataSource, model_type: str, check: ShardCheck | None = None) -> list[EvalSet]:
    """This rank's loader per eval set: whole shards planned over the ranks as for training (with fewer shards
    than ranks, every rank strides over all samples), read in manifest order, batched exactly as training. A set
    that holds videos runs the video pass in every micro-batch (the placeholder video where it has none), whether
    or not training does: the ranks' vision all-gathers then pair up in eval as in training."""
    out = []
    for d in cfg.eval_sources:
        ds = resolve_data(d.path, option="--eval-data")
        if ds.processor and train_data.processor:  # a loss under another tokenizer or pixel math means nothing
            diff = processor_difference(train_data, ds, cfg.processor)
            if diff:
                raise ConfigError(f"--eval-data {d.path} was built with another processor than --data "
                                  f"({'; '.join(diff)}): rebuild it with the training data's --processor")
        if cfg.pack_to:
            check_packing(pack_to=cfg.pack_to, pack_window=cfg.pack_window, manifest=ds.manifest, model_type=model_type)
        videos = trains_videos([ds], model_type)  # from the manifest: the same on every rank
        if videos and spec.video is None:
            raise ConfigError(f"--eval-data {d.path} holds videos, but the training data's processor saved no video "
                              "processor to make their pixel_values_videos: pass --processor with one")
        plan = plan_shards(ds.shards, world)
        shards = [ds.shards[i] for i in plan.per_rank[rank]]
        signatures = check_local_shards(shards, ds, check) if check is not None else None  # sha256 before reading
        streams = ShardSequence(shards, spec=spec, seed=cfg.seed, shuffle_shards=False,
                                stride=(rank, world) if plan.stride else (0, 1), signatures=signatures)
        loader = StepLoader(streams, collate_spec=replace(collate_spec, videos=videos), batching=Batching.of(cfg),
                            num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor)
        out.append(EvalSet(d.name, loader))
        if rank == 0:
            print(f"trainer: eval set {d.name or d.path}: {plural(len(ds.shards), 'shard')} over "
                  f"{plural(world, 'rank')}"
                  f"{' (fewer shards than ranks: each rank strides over all samples)' if plan.stride else ''}; "
                  + (f"every {cfg.eval_every} steps and at the end" if cfg.eval_every else "at the end"),
                  file=sys.stderr)
    return out


def evaluate(net: torch.nn.Module, sets: list[EvalSet], *, step: int, device: torch.device, patchifier: Patchifier,
             log=None) -> dict:
    """Every rank runs the same number of forwards (a rank that runs out takes empty micro-batches, or FSDP's
    all-gathers would hang); returns the metrics row (rank 0 also logs it when given `log`)."""
    t0 = time.perf_counter()
    modes = [(m, m.training) for m in net.modules()]  # mixed under peft (and from_pretrained): restore each
    net.eval()
    # The eval DataLoaders draw their base seed from torch's generator: fork it so training's dropout masks and
    # loaders see the same RNG stream with and without eval.
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            sums = [x for s in sets for x in _eval_set(net, s, device=device, patchifier=patchifier)]
    finally:
        for m, mode in modes:
            m.training = mode
    t = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    totals = t.view(len(sets), 3).tolist()  # [loss sum, trained tokens, samples] per set
    loss, tokens, samples = (sum(row[k] for row in totals) for k in range(3))
    record = {"step": step, "eval_loss": loss / tokens if tokens else None, "eval_tokens": int(tokens),
              "eval_samples": int(samples), "eval_time_s": time.perf_counter() - t0}
    if len(sets) > 1:
        record["eval_loss_by_source"] = {s.name: (x / c if c else None) for s, (x, c, _) in zip(sets, totals)}
        record["eval_tokens_by_source"] = {s.name: int(c) for s, (_, c, _) in zip(sets, totals)}
    if log is not None:
        shown = f"{record['eval_loss']:.4f}" if tokens else "n/a (no trained tokens)"
        line = (f"trainer: eval at step {step}: loss {shown} over {int(tokens)} trained tokens of {int(samples)} "
                f"samples ({record['eval_time_s']:.1f}s)")
        log.eval(record, line)
        print(line, file=sys.stderr)
    return record


def _eval_set(net, s: EvalSet, *, device: torch.device, patchifier: Patchifier) -> list[float]:
    """This rank's [summed token loss, trained tokens, samples] over its part of one eval set."""
    loss = torch.zeros((), dtype=torch.float64, device=device)
    tokens = samples = 0
    s.loader.start(0, 0)
    try:
        while True:
            micro_batches = s.loader.next_step()
            mine = torch.tensor([sum(b.num_samples for b in micro_batches)], dtype=torch.float64, device=device)
            dist.all_reduce(mine)
            if mine.item() == 0:  # every rank has read its whole part
                break
            for mb in micro_batches:
                tokens, samples = tokens + mb.num_trained, samples + mb.num_samples
                mb = mb.to(device)
                pixels, videos = (None, None) if mb.vision else (patchifier(mb.images, mb.image_index),
                                                                 patchifier.videos(mb.videos))
                loss += forward_loss(net, mb, pixels, pixel_values_videos=videos).double()
    finally:
        s.loader.close()
    return [float(loss), float(tokens), float(samples)]
