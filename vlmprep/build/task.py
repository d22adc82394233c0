"""One task of a build plan, top to bottom in flow order:

    plan cut --task_records--> RawRecord --parse/normalize--> Conversation --prepare_image--> PreparedImage
             --render_conversation--> RenderedSample --truncate_sample--> --encode_sample--> ShardSample
             --ShardWriter--> shard-*.tar  (+ tasks/task-NNNNN.rejects.jsonl, .samples.jsonl, task manifest last)

Records are processed by N worker processes but written strictly in input order, so the output is
byte-identical whatever N is. Every bad record becomes a counted reject, never a crash.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vlmprep.config import BuildConfig
from vlmprep.images import prepare_image
from vlmprep.videos import prepare_video
from vlmprep.build.journal import Journal, landed_ids, load_journal, save_journal
from vlmprep.normalize import NormalizeOptions, normalize_record
from vlmprep.build.plan import TASKS_DIR, check_inputs_unchanged, plan_digest, shard_prefix, task_file, task_records
from vlmprep.processors.load import apply_pixel_budget, apply_video_budget, load_saved_processor, resolve_chat_template
from vlmprep.records import parse_record
from vlmprep.render import MaskPolicy, RenderContext, count_tokens, render_conversation, trained_messages
from vlmprep.shards.format import FORMAT_VERSION, sample_key
from vlmprep.shards.reader import iter_shard
from vlmprep.shards.writer import ShardInfo, ShardWriter, encode_sample, write_json_atomic, write_text_atomic
from vlmprep.traces import StepPolicy, split_trace, whole_trace
from vlmprep.truncate import truncate_sample
from vlmprep.types import RawRecord, RecordError, RenderedSample, UserError, deterministic_message, printable


class BuildError(UserError):
    """A fatal, user-facing build fault (bad option, --strict reject): one clear line."""


class Renderer:
    """Everything one process needs to turn a RawRecord into a RenderedSample, exactly as `build` does.
    Also used by `vlmprep inspect` on raw input, so what a person sees is what build writes."""

    def __init__(self, cfg: BuildConfig, processor, *, saved: bool = False):
        """saved: `processor` is a dataset's saved copy, which already carries --chat-template and --min/--max-pixels
        (see renderer_from_saved), so neither is applied again."""
        self.cfg = cfg
        self.processor = processor
        if cfg.chat_template is not None and not saved:
            # Set on the processor itself, so the copy saved into the dataset carries the template that rendered it.
            template = resolve_chat_template(cfg.chat_template).read_text(encoding="utf-8")
            processor.chat_template = template
            if getattr(processor.tokenizer, "chat_template", None) is not None:
                processor.tokenizer.chat_template = template
        # vlmprep truncates to --seq-len itself (never inside an image); the tokenizer's "longer than the
        # specified maximum" warning about the untruncated render is noise. Mark it shown instead of changing
        # model_max_length, so the processor copy saved with the shards stays byte-identical.
        warned = getattr(processor.tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True
        policy = MaskPolicy(train_on_roles=frozenset(cfg.train_on_roles), train_on_eos=cfg.train_on_eos,
                            last_turn_only=cfg.last_turn_only, tool_calls=cfg.tool_calls, reasoning=cfg.reasoning)
        self.ctx = RenderContext(processor, policy=policy, role_boundaries=cfg.role_boundaries)
        self.norm = NormalizeOptions(image_root=cfg.image_root, allow_remote=cfg.allow_remote,
                                     max_images_per_record=cfg.max_images_per_record,
                                     videos=self.ctx.family.video is not None)
        if not saved:
            apply_pixel_budget(processor, self.ctx.family, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            apply_video_budget(processor, self.ctx.family, fps=cfg.video_fps, max_frames=cfg.video_max_frames)
        self.steps = StepPolicy(long_traces=cfg.long_traces, keep_images=cfg.keep_images,
                                dropped_image_text=cfg.dropped_image_text)
        self.turns: collections.Counter = collections.Counter()
        self.lost: list[int] = []

    def render(self, raw: RawRecord) -> list[RenderedSample]:
        """parse -> normalize -> prepare images -> history/split (steps.py) -> render + mask -> truncate; raises
        RecordError. One sample per record, or several when --long-traces split cuts a long trace; `self.turns`
        then holds the record's turn accounting and `self.lost` the trained turns that could not fit."""
        self.turns, self.lost = collections.Counter(), []
        conv = normalize_record(parse_record(raw), raw.source, self.norm)
        assistant = {i for i, m in enumerate(conv.messages) if m.role == "assistant"}
        self.turns["input_assistant_turns"] = len(assistant)
        reasoning = set(self.ctx.reasoning_messages(conv))
        self.turns["reasoning_turns"] = len(reasoning)
        try:
            images = [prepare_image(im, self.processor, self.ctx.family, max_pixels=self.cfg.max_image_pixels,
                                    min_side=self.cfg.min_image_side) for im in conv.images]
            # Videos go with their message (--keep-images counts images only); keyed by part, as steps keep parts.
            videos = {id(v): prepare_video(v, self.processor, self.ctx.family, max_pixels=self.cfg.max_image_pixels,
                                           min_side=self.cfg.min_image_side, max_tokens=self.cfg.seq_len)
                      for v in conv.videos}

            def vids(c):
                return [videos[id(v)] for v in c.videos]

            whole = whole_trace(conv, self.steps)
            steps = [whole]
            if self.cfg.long_traces == "split" and count_tokens(whole.conv, self.ctx, _pick(images, whole),
                                                                vids(whole.conv)) > self.cfg.seq_len:
                steps, self.lost = split_trace(conv, trained_messages(conv, self.ctx.policy), self.steps,
                                               lambda sc: count_tokens(sc.conv, self.ctx, _pick(images, sc),
                                                                       vids(sc.conv)),
                                               self.cfg.seq_len)
            samples = []
            for sc in steps:
                full = render_conversation(sc.conv, self.ctx, _pick(images, sc), vids(sc.conv))
                sample = truncate_sample(full, self.cfg.seq_len)
                before = {sc.source_messages[m] for m, _, _ in full.turn_spans}
                after = {sc.source_messages[m] for m, _, _ in sample.turn_spans}
                self.turns["trained_assistant_turns"] += len(after & assistant)
                self.turns["turns_lost_truncated"] += len((before - after) & assistant)
                self.turns["images_removed_by_history"] += len(sc.removed_images)
                if sc.split is not None and sc.split > 0 and sample.turn_spans:
                    self.turns["context_tokens_repeated"] += sample.turn_spans[0][1]
                samples.append(dataclasses.replace(
                    sample, id=conv.id if sc.split is None else f"{conv.id}#{sc.split}",
                    source_messages=sc.source_messages, trains=sorted(after), removed_images=sc.removed_images,
                    split=sc.split))
        except RecordError:
            self.turns["turns_lost_rejected"] = len(assistant)
            raise
        # Reasoning left out: by --reasoning drop, or by the template itself (Qwen3.5 prints it only after the last
        # user query), counted per input turn that no sample rendered it for.
        shown = {sc.source_messages[m] for sc, s in zip(steps, samples) for m in s.reasoning_rendered}
        key = "reasoning_turns_dropped" if self.ctx.policy.reasoning == "drop" else "reasoning_turns_not_rendered"
        self.turns[key] = len(reasoning - shown)
        self.turns["turns_lost_too_long"] = len(set(self.lost) & assistant)
        self.turns["turns_lost_policy"] = (len(assistant) - self.turns["trained_assistant_turns"]
                                           - self.turns["turns_lost_truncated"] - self.turns["turns_lost_too_long"])
        return samples

    def lost_turn_entry(self, raw: RawRecord, message: int) -> dict:
        return reject_entry(raw, "turn_too_long", f"messages[{message}]: this turn does not fit --seq-len "
                            f"{self.cfg.seq_len} even with only the system message and the task as context")

    def process(self, raw: RawRecord):
        """Returns (outcomes, turn accounting): outcomes are ("ok", ShardSample) per sample and ("reject", entry) per
        rejected record or lost turn, in order; never raises for a bad record."""
        self.turns = collections.Counter()
        try:
            samples = self.render(raw)
            outcomes = []
            for sample in samples:
                outcomes.append(("ok", encode_sample(sample, key=sample_key(raw.position, sample.split),
                                                     image_format=self.cfg.image_format,
                                                     zstd_level=self.cfg.zstd_level)))
            outcomes += [("reject", self.lost_turn_entry(raw, i)) for i in self.lost]
            return outcomes, dict(self.turns)
        except RecordError as e:
            reason, message = e.reason, e.message
        except Exception as e:  # noqa: BLE001 - a bad record must never stop the build; counted loudly instead
            reason, message = "internal_error", deterministic_message(f"{type(e).__name__}: {str(e)[:300]}")
        return [("reject", reject_entry(raw, reason, message))], dict(self.turns)


def _pick(images: list, sc) -> list:
    """The prepared images a step conversation keeps (all of them when sc is None)."""
    return images if sc is None else [images[k] for k in sc.images]


def reject_entry(raw: RawRecord, reason: str, message: str) -> dict:
    """The rejects.jsonl line of a bad record; holds only text that any file or terminal can take."""
    rid = None
    if raw.text is not None or raw.data is not None:
        try:
            v = parse_record(raw).get("id")  # checked there: a string of valid unicode, or an integer
            rid = v if isinstance(v, (str, int)) else None
        except Exception:  # noqa: BLE001 - the record is being rejected already; its id is only a nicety
            pass
    entry = {"source": {"file": printable(raw.source.file), "line": raw.source.line}, "id": rid, "reason": reason,
             "message": printable(message)}
    if raw.unread_bytes:  # a file-level fault: counted in the manifest's totals.unread_bytes
        entry["unread_bytes"] = raw.unread_bytes
    return entry


_RENDERER: Renderer | None = None
_CACHED: tuple[tuple, Renderer] | None = None
# Most of a worker's start-up is importing these (torch + torchvision + transformers: ~7 s of CPU). Workers fork from
# a forkserver that imported them once, instead of each spawned worker importing them again. Forking the server is
# safe where forking the build process is not: it never ran torch, tokenizers or jinja, it only imported them.
_WORKER_PRELOAD = ["vlmprep.build.task", "vlmprep.images", "torch", "torchvision",
                   "transformers.models.auto.processing_auto", "transformers.tokenization_mistral_common"]


def worker_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_WORKER_PRELOAD)  # no effect once the server runs: it already has them
    return ctx


def start_worker_server(workers: int) -> None:
    """With several worker processes, start the forkserver's imports now, in the background, so they overlap the main
    process's own set-up (load + save the processor, scan the plan) instead of following it. Does not wait."""
    if workers > 1:
        from multiprocessing import forkserver

        worker_context()
        forkserver.ensure_running()


def renderer_from_saved(cfg: BuildConfig, processor_dir: str | Path) -> Renderer:
    """The one way a worker of any kind (pool, task, Ray) gets ready: the dataset's saved processor dir, which carries
    the chat template and pixel budget that rendered it, so the --chat-template file need not exist where it runs."""
    import torch

    torch.set_num_threads(1)  # one core per worker: N workers scale instead of oversubscribing
    return Renderer(cfg, load_saved_processor(processor_dir), saved=True)


def cached_renderer(cfg: BuildConfig, processor_dir: Path) -> Renderer:
    """renderer_from_saved, kept per process: a pool or Ray worker that runs several tasks of one plan loads the
    processor once."""
    global _CACHED
    key = (str(processor_dir), json.dumps(cfg.to_json(), sort_keys=True))
    if _CACHED is None or _CACHED[0] != key:
        _CACHED = key, renderer_from_saved(cfg, processor_dir)
    return _CACHED[1]


def _init_worker(cfg: BuildConfig, processor_dir: str) -> None:
    global _RENDERER
    _RENDERER = renderer_from_saved(cfg, processor_dir)


def process_record(raw: RawRecord):
    return _RENDERER.process(raw)


@contextlib.contextmanager
def worker_pool(workers: int, **kw) -> Iterator[ProcessPoolExecutor]:
    """`workers` forkserver processes. Unlike multiprocessing.Pool (which silently replaces a dead worker and waits
    forever for its task), the executor fails every pending future with BrokenProcessPool when a worker dies
    (killed, out of memory, crashed) or a result cannot be read. Leaving early (an error, --strict) stops the
    workers instead of waiting for their work."""
    pool = ProcessPoolExecutor(workers, mp_context=worker_context(), **kw)
    try:
        yield pool
    except BaseException:
        for p in list((getattr(pool, "_processes", None) or {}).values()):  # public terminate_workers: Python 3.14
            p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def pool_failure(e: BrokenProcessPool, where: str) -> str:
    """One line for a broken worker pool: what broke, where in the input it was, what to do."""
    cause = [line.strip() for line in str(e.__cause__ or "").splitlines() if line.strip("'\" ")]  # a quoted traceback
    what = (f"a worker's result could not be read ({cause[-1]})" if cause else
            "a worker process stopped abruptly (killed, out of memory, or crashed)")
    return (f"{what} while {where}; finished work is kept: run the same command again to resume, "
            "or with --workers 1 to see the record in this process")


def task_start(plan: dict, index: int) -> str:
    """Where task `index` of the plan starts reading: FILE:LINE, for messages."""
    cut = plan["cuts"][index]
    if cut["file"] >= len(plan["inputs"]):
        return "the end of the input"
    return f"{plan['inputs'][cut['file']]['path']}:{cut['seek']['line'] + 1}"


def _ordered_results(cfg: BuildConfig, records, processor_dir: Path, renderer: Renderer):
    """Yield (position, result) in input order with a bounded read-ahead window (constant memory)."""
    if cfg.workers == 1:  # in-process, reusing the loaded processor: one copy of the tokenizer in memory
        for raw in records:
            yield raw.position, renderer.process(raw)
        return
    window: collections.deque = collections.deque()  # (position, source, future), oldest first
    with worker_pool(cfg.workers, initializer=_init_worker, initargs=(cfg, str(processor_dir))) as pool:
        try:
            for raw in records:
                window.append((raw.position, raw.source, pool.submit(process_record, raw)))
                if len(window) >= cfg.workers * 4:
                    yield window[0][0], window[0][2].result()
                    window.popleft()
            while window:
                yield window[0][0], window[0][2].result()
                window.popleft()
        except BrokenProcessPool as e:
            src = window[0][1] if window else None
            where = f"rendering the records from {src.file}:{src.line} on" if src else "rendering records"
            raise BuildError(pool_failure(e, where)) from None


def _progress(cfg: BuildConfig):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]build"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
                    TextColumn("{task.fields[rate]:.1f} rec/s"), TextColumn("{task.fields[samples]} samples"),
                    TextColumn("{task.fields[rejects]} rejects"), TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(),
                    disable=not cfg.progress, transient=False, console=None)


TOTAL_KEYS = ("records", "samples", "rejected", "tokens", "trainable_tokens", "image_tokens", "images",
              "truncated_samples", "dropped_images", "unrendered_tool_call_turns", "split_samples",
              "input_assistant_turns", "trained_assistant_turns", "turns_lost_truncated", "turns_lost_too_long",
              "turns_lost_policy", "turns_lost_rejected", "images_removed_by_history", "context_tokens_repeated",
              "unread_bytes", "reasoning_turns", "reasoning_turns_dropped", "reasoning_turns_not_rendered",
              "videos", "video_tokens", "dropped_videos")


@dataclass(frozen=True)
class TaskFiles:
    """Where task `index` of a plan keeps its state inside the dataset dir (all but the shards under tasks/)."""

    out: Path
    index: int
    prefix: str  # its shard names start with this

    def path(self, suffix: str) -> Path:
        return self.out / task_file(self.index, suffix)

    @property
    def manifest(self) -> Path:  # written last: its presence means the task is complete
        return self.path(".json")

    def shards(self) -> list[Path]:
        return sorted(self.out.glob(f"{self.prefix}[0-9]*.tar"))


def _start_or_resume(files: TaskFiles, identity: dict) -> Journal:
    """Resume this task's matching interrupted run, or clear every trace of an older one and start fresh."""
    journal_path, partial, final = files.path(".journal.json"), files.path(".rejects.jsonl.partial"), files.path(".rejects.jsonl")
    journal = load_journal(files.out, journal_path, partial, final, identity)
    stale = [p for p in files.out.glob(f"{files.prefix}*.tar.tmp")]
    if journal is None:
        journal = Journal(identity=identity)
        stale += files.shards() + [final, partial, journal_path, files.path(".samples.jsonl")]
    else:
        done = {s["name"] for s in journal.shards}
        stale += [p for p in files.shards() if p.name not in done]
    for p in stale:
        if p.exists():
            p.unlink()
    with open(partial, "a+b") as f:  # drop rejects written after the last durable point
        f.truncate(journal.rejects_bytes)
    return journal


def load_task_manifest(files: TaskFiles) -> dict | None:
    try:
        return json.loads(files.manifest.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def run_task(out: Path, plan: dict, index: int, *, cfg: BuildConfig, renderer: Renderer | None = None,
             processor_dir: Path | None = None) -> dict:
    """One task of the plan: its records -> its shards (final names), tasks/task-NNNNN.rejects.jsonl and .samples.jsonl,
    then the task manifest, last and atomically. A task whose manifest exists is skipped; a killed one resumes
    from its journal and ends byte-identical. Returns the task manifest."""
    out = Path(out)
    digest = plan_digest(plan)
    files = TaskFiles(out, index, shard_prefix(plan, index))
    done = load_task_manifest(files)
    if done is not None and done.get("plan") == digest:
        # killed between its manifest and its clean-up: only the clean-up is left to do
        for p in [files.path(".journal.json"), files.path(".rejects.jsonl.partial")] + list(
                (out / TASKS_DIR).glob(f"task-{index:05d}.*.tmp")):
            p.unlink(missing_ok=True)
        return done
    check_inputs_unchanged(plan)
    processor_dir = Path(processor_dir or out / plan["processor"]["dir"])
    if renderer is None:
        renderer = cached_renderer(cfg, processor_dir)
    (out / TASKS_DIR).mkdir(exist_ok=True)
    journal = _start_or_resume(files, {"plan": digest, "task": index})
    journal_path, partial = files.path(".journal.json"), files.path(".rejects.jsonl.partial")
    samples_path = files.path(".samples.jsonl")

    writer = ShardWriter(out, samples_per_shard=cfg.samples_per_shard,
                         shard_size_bytes=int(cfg.shard_size_mb * 1024 * 1024), prefix=files.prefix,
                         done=[ShardInfo(**s) for s in journal.shards])
    rejects = collections.Counter(journal.rejects)
    totals = collections.Counter(journal.totals)
    seen_ids = landed_ids(out, journal.shards)
    cut = plan["cuts"][index]
    records = (r for r in task_records(plan, index, max_line_bytes=cfg.max_line_bytes,
                                       max_zstd_window=cfg.max_zstd_window)
               if r.position >= max(journal.next_position, cut["position"]))
    t0 = time.monotonic()
    with open(partial, "a", encoding="utf-8") as rej, _progress(cfg) as progress:
        bar = progress.add_task("build", total=cut["records"], rate=0.0, samples=totals["samples"],
                                rejects=totals["rejected"], completed=totals["records"])

        def checkpoint(next_position: int) -> None:
            rej.flush()
            os.fsync(rej.fileno())
            journal.shards = [s.to_json() for s in writer.shards]
            journal.next_position = next_position
            journal.rejects_bytes = rej.tell()
            journal.totals = dict(totals)
            journal.rejects = dict(rejects)
            save_journal(journal_path, journal)

        for pos, (outcomes, turns) in _ordered_results(cfg, records, processor_dir, renderer):
            totals["records"] += 1
            totals.update(turns)
            completed = False
            for status, payload in outcomes:
                if status == "ok" and payload.meta["id"] in seen_ids:
                    status, payload = "reject", duplicate_reject(payload.meta)
                if status == "ok":
                    seen_ids.add(payload.meta["id"])
                    count_sample(totals, payload.meta)
                    completed |= writer.write(payload)
                else:
                    rejects[payload["reason"]] += 1
                    totals["rejected"] += 1
                    totals["unread_bytes"] += payload.get("unread_bytes", 0)
                    rej.write(json.dumps(payload, ensure_ascii=False, sort_keys=True) + "\n")
                    if cfg.strict:
                        raise BuildError(f"--strict: {payload['source']['file']}:{payload['source']['line']}: "
                                         f"{payload['reason']}: {payload['message']}")
            if completed:  # a shard closed inside this record: the journal's durable point is the record's end
                writer.finish_shard()
                checkpoint(pos + 1)
            elapsed = max(time.monotonic() - t0, 1e-9)
            progress.update(bar, advance=1, rate=totals["records"] / elapsed, samples=totals["samples"],
                            rejects=totals["rejected"])
        writer.close()
        checkpoint(1 << 62)  # everything consumed: a kill from here on resumes straight to the task manifest
    # Every landed sample's id, shard and counts, in order: merge finds ids repeated across tasks (and what removing
    # one changes) without reading shards.
    lines = [json.dumps({"shard": s.name, **{k: v for k, v in sample.meta().items() if k in _SAMPLE_FIELDS}},
                        ensure_ascii=False, sort_keys=True) + "\n"
             for s in writer.shards for sample in iter_shard(out / s.name, version=FORMAT_VERSION)]
    write_text_atomic(samples_path, "".join(lines))
    os.replace(partial, files.path(".rejects.jsonl"))
    manifest = {"plan": digest, "task": index, "config": plan["config"],
                "processor": plan["processor"]["fingerprint"],
                "records": {"first_position": cut["position"], "count": cut["records"]},
                "shards": [s.to_json() for s in writer.shards], "totals": {k: int(totals[k]) for k in TOTAL_KEYS},
                "rejects": dict(sorted(rejects.items()))}
    write_json_atomic(files.manifest, manifest)
    journal_path.unlink()
    return manifest


_SAMPLE_FIELDS = ("id", "source", "num_tokens", "num_trainable_tokens", "num_image_tokens", "num_images", "truncated",
                  "dropped_images", "unrendered_tool_calls", "split", "num_videos", "num_video_tokens",
                  "dropped_videos")


def count_sample(totals: collections.Counter, m: dict, sign: int = 1) -> None:
    """Add a landed sample's counts to the totals (sign=-1: take back one that merge removes)."""
    for key, field in (("tokens", "num_tokens"), ("trainable_tokens", "num_trainable_tokens"),
                       ("image_tokens", "num_image_tokens"), ("images", "num_images"),
                       ("dropped_images", "dropped_images"), ("unrendered_tool_call_turns", "unrendered_tool_calls")):
        totals[key] += sign * m[field]
    for key, field in (("videos", "num_videos"), ("video_tokens", "num_video_tokens"),
                       ("dropped_videos", "dropped_videos")):
        totals[key] += sign * m.get(field, 0)  # absent from image-only samples
    totals["samples"] += sign
    totals["truncated_samples"] += sign * int(m["truncated"])
    totals["split_samples"] += sign * int(m["split"] is not None)


def duplicate_reject(meta: dict) -> dict:
    return {"source": dict(meta["source"]), "id": meta["id"], "reason": "duplicate_id",
            "message": f"id {meta['id']!r} already used by an earlier record"}


def turn_coverage(totals) -> dict:
    """Assistant turns of the input that the shards train, and where the others went."""
    n = int(totals["input_assistant_turns"])
    return {"input_assistant_turns": n, "trained_assistant_turns": int(totals["trained_assistant_turns"]),
            "coverage": round(totals["trained_assistant_turns"] / n, 6) if n else 1.0,
            "lost": {"truncated": int(totals["turns_lost_truncated"]), "turn_too_long": int(totals["turns_lost_too_long"]),
                     "not_trained_by_policy": int(totals["turns_lost_policy"]),
                     "record_rejected": int(totals["turns_lost_rejected"])},
            "images_removed_by_history": int(totals["images_removed_by_history"]),
            "context_tokens_repeated": int(totals["context_tokens_repeated"])}


class task_progress:
    """A progress bar over tasks, fed by each finished task's totals (local pool and Ray alike)."""

    def __init__(self, cfg: BuildConfig, n: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.progress = Progress(TextColumn("[bold]build tasks"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[records]} records"),
                                 TextColumn("{task.fields[samples]} samples"),
                                 TextColumn("{task.fields[rejects]} rejects"), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), disable=not cfg.progress)
        self.n = n
        self.totals: collections.Counter = collections.Counter()

    def __enter__(self):
        self.progress.__enter__()
        self.bar = self.progress.add_task("tasks", total=self.n, records=0, samples=0, rejects=0)
        return self.tick

    def tick(self, totals: dict) -> None:
        self.totals.update(totals)
        self.progress.update(self.bar, advance=1, records=self.totals["records"], samples=self.totals["samples"],
                             rejects=self.totals["rejected"])

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)
