"""Long agent traces -> step samples: one Conversation -> the message lists that build renders, each a real
conversation (the screenshot-history policy applied, a trace too long for --seq-len cut into samples that each
train a run of its turns with the task and the most recent history as untrained context).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from vlmprep.config import default
from vlmprep.types import Conversation, Part


@dataclass(frozen=True, kw_only=True)
class StepPolicy:
    """How agent traces become samples: --long-traces (truncate or split per step), --keep-images last:N, and the
    text that stands for a removed image."""

    long_traces: str = default("long_traces")  # "truncate" | "split"
    keep_images: int | None = default("keep_images")  # only the last N images of each sample's messages stay
    dropped_image_text: str | None = default("dropped_image_text")  # what replaces a removed image (None: dropped)


@dataclass
class StepConversation:
    """A conversation to render, and where it came from in its input record."""

    conv: Conversation
    source_messages: list[int]  # input message index of each message of `conv`
    trains: list[int]  # input message indices this sample trains (empty: the policy decides, unsplit)
    removed_images: list[int] = field(default_factory=list)  # input image occurrences removed by keep_images
    images: list[int] = field(default_factory=list)  # input image occurrence of each image left in `conv`
    split: int | None = None  # the sample's number within its record when the record was split


def image_occurrences(conv: Conversation) -> list[tuple[int, int]]:
    """(message index, part index) of every image, in order."""
    return [(i, j) for i, m in enumerate(conv.messages) for j, p in enumerate(m.parts) if p.type == "image"]


def keep_last_images(
    conv: Conversation, keep: int | None, text: str | None, numbering: list[int] | None = None
) -> tuple[Conversation, list[int]]:
    """Only the last `keep` images stay; each earlier image part is dropped or replaced by `text`. Returns the new
    conversation and the removed occurrences (numbered by `numbering`: the input occurrence of each image)."""
    occ = image_occurrences(conv)
    if keep is None or len(occ) <= keep:
        return conv, []
    drop = set(occ[: len(occ) - keep])
    numbering = numbering if numbering is not None else list(range(len(occ)))
    removed = [numbering[k] for k, o in enumerate(occ) if o in drop]
    messages = []
    for i, m in enumerate(conv.messages):
        parts = []
        for j, p in enumerate(m.parts):
            if (i, j) not in drop:
                parts.append(p)
            elif text is not None:
                parts.append(Part("text", text=text))
        messages.append(dataclasses.replace(m, parts=parts))
    return dataclasses.replace(conv, messages=messages), removed


def _subset(conv: Conversation, keep: list[int], trains: set[int]) -> Conversation:
    """The messages `keep` (input order), weighted 1 if in `trains` else 0: context is never trained."""
    return dataclasses.replace(
        conv, messages=[dataclasses.replace(conv.messages[i], weight=int(i in trains)) for i in keep]
    )


def _image_numbering(conv: Conversation, keep: list[int]) -> list[int]:
    """Input occurrence numbers of the images in the messages `keep`."""
    first = {}
    n = 0
    for i, m in enumerate(conv.messages):
        first[i] = n
        n += len(m.images)
    return [first[i] + k for i in keep for k in range(len(conv.messages[i].images))]


def whole_trace(conv: Conversation, policy: StepPolicy) -> StepConversation:
    """The record as one sample (truncate mode, or a trace that fits), with the image history policy applied."""
    keep = list(range(len(conv.messages)))
    c, removed = keep_last_images(conv, policy.keep_images, policy.dropped_image_text)
    return StepConversation(
        conv=c,
        source_messages=keep,
        trains=[],
        removed_images=removed,
        images=[k for k in range(len(conv.images)) if k not in removed],
    )


@dataclass(frozen=True)
class _Trace:
    """A trace as split_trace packs it: the head (system messages and the first user message: the task), its units
    (a message with the tool results that follow it, so a tool result never loses the call that produced it), and
    the sample of any run of trained turns with what they act on and some earlier units as context."""

    conv: Conversation
    trained: list[int]
    policy: StepPolicy
    first_user: int
    head: list[int]
    unit_start: list[int]  # message -> the first message of its unit
    units: list[list[int]]  # the units after the head, in order

    @classmethod
    def of(cls, conv: Conversation, trained: list[int], policy: StepPolicy) -> _Trace:
        """The head and units of `conv`."""
        n = len(conv.messages)
        first_user = next((i for i, m in enumerate(conv.messages) if m.role == "user"), 0)
        unit_start = list(range(n))
        for i in range(1, n):  # tool results join the unit of the message before them
            if conv.messages[i].role == "tool" and i > first_user + 1:
                unit_start[i] = unit_start[i - 1]
        starts = sorted({unit_start[i] for i in range(first_user + 1, n)})
        return cls(
            conv=conv,
            trained=trained,
            policy=policy,
            first_user=first_user,
            head=list(range(first_user + 1)),
            unit_start=unit_start,
            units=[list(range(s, e)) for s, e in zip(starts, starts[1:] + [n])],
        )

    def observed_from(self, a: int) -> int:
        """The first message trained turn `a` acts on: what came since the assistant turn before it (tool results
        and their screenshots, user follow-ups); its sample holds all of it, and the call those tool results answer."""
        conv = self.conv
        q = next((k for k in range(a - 1, self.first_user, -1) if conv.messages[k].role == "assistant"), None)
        if q is None:
            return min(self.first_user + 1, a)
        return self.unit_start[q + 1] if q + 1 < a else a

    def sample(self, ctx_units: list[list[int]], a: int, b: int, head_trained: list[int]) -> StepConversation:
        """The head, the units `ctx_units` (untrained context), then the trained turns a..b with what they act on
        (head_trained: the head's trained turns, trained here too), the image history policy applied."""
        keep = self.head + [i for u in ctx_units for i in u] + list(range(self.observed_from(a), b + 1))
        trains = {t for t in self.trained if a <= t <= b} | set(head_trained)
        numbering = _image_numbering(self.conv, keep)
        c, removed = keep_last_images(
            _subset(self.conv, keep, trains), self.policy.keep_images, self.policy.dropped_image_text, numbering
        )
        return StepConversation(
            conv=c,
            source_messages=keep,
            trains=sorted(trains),
            removed_images=removed,
            images=[k for k in numbering if k not in removed],
        )


def split_trace(
    conv: Conversation,
    trained: list[int],
    policy: StepPolicy,
    count_tokens: Callable[[StepConversation], int],
    seq_len: int,
) -> tuple[list[StepConversation], list[int]]:
    """Cut a trace into samples that each fit `seq_len`: every message in `trained` is trained in exactly one sample.
    Each sample = the head (system messages and the first user message: the task) + as many of the most recent
    earlier units as fit (untrained context) + a run of trained turns, each with what it acts on: every message since
    the assistant turn before it (tool results, screenshots, user follow-ups). A unit is a message with the tool
    results that follow it, so a tool result never loses the call that produced it. Returns the samples and the
    trained messages that cannot fit even with the head and their own observation alone (lost, to be reported):
    a turn is never trained without the screen it acts on."""
    trace = _Trace.of(conv, trained, policy)
    head, units, observed_from = trace.head, trace.units, trace.observed_from
    head_trained = [t for t in trained if t in head]
    todo = [t for t in trained if t not in head]

    def build(ctx_units: list[list[int]], a: int, b: int, with_head_trained: bool) -> StepConversation:
        return trace.sample(ctx_units, a, b, head_trained if with_head_trained else [])

    def fits(sc: StepConversation) -> bool:
        return count_tokens(sc) <= seq_len

    samples: list[StepConversation] = []
    lost: list[int] = []
    i = 0
    if not todo and head_trained:  # only the task itself is trained: one sample of the head
        sc = build([], head[-1], head[-1], True)
        return ([sc] if fits(sc) else []), ([] if fits(sc) else head_trained)
    while i < len(todo):
        first = not samples
        if not fits(build([], todo[i], todo[i], first)):
            lost.append(todo[i])
            i += 1
            continue
        # The longest run of turns that fits with the head alone (binary search: cost grows with the run).
        lo, hi = i, len(todo) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(build([], todo[i], todo[mid], first)):
                lo = mid
            else:
                hi = mid - 1
        j = lo
        # Then as many of the most recent earlier units as fit, as untrained context.
        before = [u for u in units if u[-1] < observed_from(todo[i])]
        lo, hi = 0, len(before)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(build(before[len(before) - mid :], todo[i], todo[j], first)):
                lo = mid
            else:
                hi = mid - 1
        sc = build(before[len(before) - lo :] if lo else [], todo[i], todo[j], first)
        samples.append(sc)
        i = j + 1
    if head_trained and not samples:
        lost = head_trained + lost
    for k, sc in enumerate(samples):
        sc.split = k
    return samples, lost
