"""Render: a Conversation and its pixels -> the processor's token ids, per-token loss mask, positions, cut to
--seq-len without splitting an image (README.md has the flow). The rest of vlmprep imports these names only.
"""

from vlmprep.render.mask import (
    MaskPolicy,
    trained_messages,
)
from vlmprep.render.sample import (
    RenderContext,
    count_tokens,
    render_conversation,
)
from vlmprep.render.traces import (
    StepConversation,
    StepPolicy,
    split_trace,
    whole_trace,
)
from vlmprep.render.truncate import (
    truncate_sample,
)

__all__ = [
    "MaskPolicy",
    "RenderContext",
    "StepConversation",
    "StepPolicy",
    "count_tokens",
    "render_conversation",
    "split_trace",
    "trained_messages",
    "truncate_sample",
    "whole_trace",
]
