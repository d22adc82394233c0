"""Truncate a RenderedSample to seq_len without ever cutting inside an image wrapper or a video's expansion.
Images and videos past the cut are dropped with their grid rows and bytes; a sample left untrainable is rejected.
"""

from __future__ import annotations

import dataclasses

from vlmprep.types import RecordError, RenderedSample


def truncate_sample(sample: RenderedSample, seq_len: int) -> RenderedSample:
    """A RenderedSample -> the same sample cut to at most `seq_len` tokens (unchanged when it fits). The cut never
    splits an image or a video: one that would straddle it goes whole, with everything after it, and the sample
    records what it dropped; turns cut short stop counting as trained turns. A cut that leaves no trained token is a
    RecordError (no_trainable_tokens_after_truncation), with a --max-pixels hint where one image alone fills most of
    the budget. Trade-off: keeping media whole can leave the sample well under seq_len; --long-traces split keeps
    every turn instead, as several samples."""
    n = len(sample.input_ids)
    if n <= seq_len:
        return sample
    cut = seq_len
    for start, end in sample.image_spans + sample.video_spans:
        if start < cut < end:
            cut = start  # the whole wrapper goes: a partial image or video is what crashes trainers
            break
    kept = sum(1 for _, end in sample.image_spans if end <= cut)
    kept_videos = sum(1 for _, end in sample.video_spans if end <= cut)
    if not sample.loss_mask[:cut].any():
        why = f"{n} tokens cut to {cut} (seq_len={seq_len}) leaves no trained token"
        raise RecordError("no_trainable_tokens_after_truncation", why + _large_image(sample, cut, seq_len))
    # Causal positions of a prefix do not depend on what follows, so slicing position_ids is exact.
    return dataclasses.replace(
        sample,
        input_ids=sample.input_ids[:cut],
        loss_mask=sample.loss_mask[:cut],
        mm_token_type_ids=sample.mm_token_type_ids[:cut],
        position_ids=sample.position_ids[:, :cut],
        image_grid_thw=sample.image_grid_thw[:kept],
        images=sample.images[:kept],
        image_spans=sample.image_spans[:kept],
        video_grid_thw=sample.video_grid_thw[:kept_videos],
        second_per_grid_ts=sample.second_per_grid_ts[:kept_videos],
        videos=sample.videos[:kept_videos],
        video_spans=sample.video_spans[:kept_videos],
        truncated=True,
        dropped_images=sample.dropped_images + (len(sample.images) - kept),
        dropped_videos=sample.dropped_videos + (len(sample.videos) - kept_videos),
        turn_spans=[(m, a, b) for m, a, b in sample.turn_spans if b <= cut],  # a turn cut short is not trained
    )


def _large_image(sample: RenderedSample, cut: int, seq_len: int) -> str:
    """The hint where the cut fell at an image that alone takes most of seq_len: a smaller pixel budget fits it."""
    for k, (start, end) in enumerate(sample.image_spans):
        if start == cut and end - start > seq_len // 2:
            w, h = sample.images[k].source_size
            size = f" ({w}x{h})" if w else ""
            return f"; image {k + 1}{size} alone takes {end - start} tokens: lower --max-pixels, or raise --seq-len"
    return ""
