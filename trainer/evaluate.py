"""Held-out eval: each eval set's loader (trainer/data/pipeline.py eval_loaders: its shards split over the ranks,
disjoint, no shuffle, the training collate or packing) -> forwards without gradients -> the token-weighted mean loss
over the whole set and all ranks, a metrics.jsonl row. The training stream is left as it was: own loaders, torch's
RNG and every module's mode restored.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from trainer.data import EvalSet, Patchifier
from trainer.model import forward_loss


def evaluate(
    net: torch.nn.Module, sets: list[EvalSet], *, step: int, device: torch.device, patchifier: Patchifier, log=None
) -> dict:
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
    record = {
        "step": step,
        "eval_loss": loss / tokens if tokens else None,
        "eval_tokens": int(tokens),
        "eval_samples": int(samples),
        "eval_time_s": time.perf_counter() - t0,
    }
    if len(sets) > 1:
        record["eval_loss_by_source"] = {s.name: (x / c if c else None) for s, (x, c, _) in zip(sets, totals)}
        record["eval_tokens_by_source"] = {s.name: int(c) for s, (_, c, _) in zip(sets, totals)}
    if log is not None:
        shown = f"{record['eval_loss']:.4f}" if tokens else "n/a (no trained tokens)"
        line = (
            f"trainer: eval at step {step}: loss {shown} over {int(tokens)} trained tokens of {int(samples)} "
            f"samples ({record['eval_time_s']:.1f}s)"
        )
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
                pixels, videos = patchifier.inputs(mb)
                loss += forward_loss(net, mb, pixels, pixel_values_videos=videos).double()
    finally:
        s.loader.close()
    return [float(loss), float(tokens), float(samples)]
