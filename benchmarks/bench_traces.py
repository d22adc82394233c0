"""Agent-trace benchmark: the demo traces (1280x720 screenshots) built with --long-traces truncate vs split at
--seq-len 8192 and 16384, with and without --keep-images last:3: assistant-turn coverage, samples, tokens,
trained tokens, shard bytes, build seconds (docs/build.md's agent-trace table). First, what the images the output
drops cost: one worker builds the same traces keeping all images and then --keep-images last:3, back to back in this
process, counting each image decode (docs/performance.md)."""

from __future__ import annotations

import collections

from benchmarks.bench_build import timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

GOAL_KEEP_3 = 0.5  # the --keep-images last:3 build's seconds over the keep-all build's

SETTINGS = [(mode, seq_len, keep) for seq_len in (8192, 16384) for mode in ("truncate", "split") for keep in (None, 3)]


def run(quick: bool, n: int | None = None) -> list[dict]:
    n = n or (6 if quick else 64)
    size = (320, 200) if quick else (1280, 720)
    inp = traces(n, width=size[0], height=size[1])
    rows = keep_images_cost(inp, seq_len=1024 if quick else 16384)
    for mode, seq_len, keep in SETTINGS[:2] if quick else SETTINGS:
        ds = OUT / f"traces-{mode}-{seq_len}-{keep}"
        seconds, m = timed_build(
            inp,
            ds,
            seq_len=1024 if quick else seq_len,
            long_traces=mode,
            keep_images=keep,
            samples_per_shard=16,
            workers=1 if quick else 2,
        )
        t, turns = m["totals"], m["turns"]
        rows.append(
            emit(
                "traces",
                long_traces=mode,
                seq_len=seq_len,
                keep_images=f"last:{keep}" if keep else "all",
                records=t["records"],
                samples=t["samples"],
                split_samples=t["split_samples"],
                coverage=turns["coverage"],
                input_assistant_turns=turns["input_assistant_turns"],
                trained_assistant_turns=turns["trained_assistant_turns"],
                turns_lost=turns["lost"],
                tokens=t["tokens"],
                trained_tokens=t["trainable_tokens"],
                images=t["images"],
                images_removed=turns["images_removed_by_history"],
                context_tokens_repeated=turns["context_tokens_repeated"],
                shard_bytes=sum(s["bytes"] for s in m["shards"]),
                seconds=round(seconds, 1),
            )
        )
    return rows


def keep_images_cost(inp, *, seq_len: int) -> list[dict]:
    """Keep-all vs --keep-images last:3, one worker in this process (so every decode and encode is counted here), same
    input, back to back: build seconds, their ratio, and the images decoded that no sample holds (goal: 0)."""
    import vlmprep.pixels.images as images
    from vlmprep.shards import writer

    decode, encode = images.decode_image, writer.encode_image
    rows, seconds = [], {}
    for keep in (None, 3):
        decoded, encoded = collections.Counter(), collections.Counter()

        def counting_decode(img, _count=decoded, **kw):
            _count[img.data] += 1
            return decode(img, **kw)

        def counting_encode(image, *a, _count=encoded, **kw):
            _count[image.source.data] += 1
            return encode(image, *a, **kw)

        images.decode_image, writer.encode_image = counting_decode, counting_encode
        try:
            s, m = timed_build(
                inp,
                OUT / f"traces-keep-{keep}",
                seq_len=seq_len,
                long_traces="truncate",
                keep_images=keep,
                samples_per_shard=16,
                workers=1,
            )
        finally:
            images.decode_image, writer.encode_image = decode, encode
        seconds[keep] = s
        t, turns = m["totals"], m["turns"]
        ratio = {"ratio_vs_keep_all": round(s / seconds[None], 3), "goal": GOAL_KEEP_3} if keep else {}
        rows.append(
            emit(
                "traces",
                metric="keep_images_cost",
                long_traces="truncate",
                seq_len=seq_len,
                keep_images=f"last:{keep}" if keep else "all",
                workers=1,
                records=t["records"],
                samples=t["samples"],
                coverage=turns["coverage"],
                tokens=t["tokens"],
                images=t["images"],
                images_removed=turns["images_removed_by_history"],
                images_decoded=sum(decoded.values()),
                images_encoded=sum(encoded.values()),
                dropped_images_decoded=sum(k for b, k in decoded.items() if b not in encoded),
                shard_bytes=sum(x["bytes"] for x in m["shards"]),
                seconds=round(s, 1),
                **ratio,
            )
        )
    return rows
