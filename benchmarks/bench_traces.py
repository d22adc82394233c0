"""Agent-trace benchmark: the demo traces (1280x720 screenshots) built with --long-traces truncate vs split at
--seq-len 8192 and 16384, with and without --keep-images last:3: assistant-turn coverage, samples, tokens,
trained tokens, shard bytes, build seconds (docs/build.md's agent-trace table)."""
from __future__ import annotations

from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

SETTINGS = [(mode, seq_len, keep) for seq_len in (8192, 16384) for mode in ("truncate", "split") for keep in (None, 3)]


def run(quick: bool, n: int | None = None) -> list[dict]:
    n = n or (6 if quick else 64)
    size = (320, 200) if quick else (1280, 720)
    inp = traces(n, width=size[0], height=size[1])
    rows = []
    for mode, seq_len, keep in (SETTINGS[:2] if quick else SETTINGS):
        ds = OUT / f"traces-{mode}-{seq_len}-{keep}"
        seconds, m = timed_build(inp, ds, seq_len=1024 if quick else seq_len, long_traces=mode, keep_images=keep,
                                 samples_per_shard=16, workers=1 if quick else 2)
        t, turns = m["totals"], m["turns"]
        rows.append(emit("traces", long_traces=mode, seq_len=seq_len, keep_images=f"last:{keep}" if keep else "all",
                         records=t["records"], samples=t["samples"], split_samples=t["split_samples"],
                         coverage=turns["coverage"], input_assistant_turns=turns["input_assistant_turns"],
                         trained_assistant_turns=turns["trained_assistant_turns"], turns_lost=turns["lost"],
                         tokens=t["tokens"], trained_tokens=t["trainable_tokens"], images=t["images"],
                         images_removed=turns["images_removed_by_history"],
                         context_tokens_repeated=turns["context_tokens_repeated"],
                         shard_bytes=sum(s["bytes"] for s in m["shards"]), seconds=round(seconds, 1)))
    return rows
