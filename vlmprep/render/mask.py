"""Loss mask: each message's text is located in the rendered string (sentinels, proven by rebuilding it; a per-slot
fallback for templates that trim or rewrite turns), trained spans are mapped to tokens by offsets, and every trained
span is decoded back as proof. Input: MaskInputs from render_conversation; output: the 0/1 mask and turn spans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from vlmprep.config import ROLES, check_mask_policy, default
from vlmprep.types import Conversation, RecordError

SENTINEL = "\ue000VLMPREP{}\ue001"
_SENTINEL_RE = re.compile("\ue000VLMPREP(\\d+)\ue001")


@dataclass(frozen=True, kw_only=True)
class MaskPolicy:
    """Which tokens get loss. Per-message `weight` (0|1) overrides the role rule; headers and template scaffolding
    outside a trained message's text are never trained."""

    # Each default is the option's (BuildConfig's): a library caller gets what `vlmprep build` does.
    train_on_roles: frozenset[str] = frozenset(default("train_on_roles"))
    train_on_eos: str = default("train_on_eos")  # all | turn (those of trained turns) | last | none
    last_turn_only: bool = default("last_turn_only")
    tool_calls: str = default("tool_calls")  # an assistant turn whose tool_calls the template does not render
    reasoning: str = default("reasoning")  # train | context (rendered, loss 0) | drop | reject

    def __post_init__(self):
        bad = set(self.train_on_roles) - set(ROLES)
        if bad or not self.train_on_roles:
            raise ValueError(
                f"train_on_roles={sorted(self.train_on_roles)}: use a non-empty subset of {', '.join(ROLES)}"
            )
        check_mask_policy(self.train_on_eos, self.tool_calls, self.reasoning)


@dataclass
class Located:
    """Where one text slot of a message landed in the rendered template string (a char span)."""

    slot: int
    start: int  # char span in the rendered string
    end: int


def trained_messages(conv: Conversation, policy: MaskPolicy) -> list[int]:
    """Indices of messages whose text is trained: the role rule, overridden by per-message weight, then last-turn."""
    idx = [
        i
        for i, m in enumerate(conv.messages)
        if m.weight == 1 or (m.weight is None and m.role in policy.train_on_roles)
    ]
    return idx[-1:] if policy.last_turn_only else idx


def _candidates(text: str) -> list[str]:
    # The rewrites templates apply to message text (jinja trim, Qwen's strip('\n'), mistral-common's rstrip(' ')),
    # most faithful first.
    out = []
    for c in (
        text,
        text.strip(),
        text.strip("\n"),
        text.lstrip(),
        text.rstrip(),
        text.lstrip("\n"),
        text.rstrip("\n"),
        text.rstrip(" "),
    ):
        if c not in out:
            out.append(c)
    return out


def locate_slots(ctx, conv: Conversation, slots: list, rendered: str) -> list[Located]:
    """Char span of every slot the template kept, proven either by rebuilding `rendered` from the sentinel rendering
    or, for templates that rewrite text (trim, think-stripping), slot by slot between identical scaffolding."""
    if any("\ue000VLMPREP" in s.text for s in slots):
        raise RecordError("sentinel_in_text", "text contains vlmprep's reserved sentinel marker")
    sentinels = ctx.messages(conv, [SENTINEL.format(k) for k in range(len(slots))])
    sentinel_text = ctx.sentinel_renders.render(sentinels, conv.tools)
    pieces = _SENTINEL_RE.split(sentinel_text)  # scaffold, id, scaffold, id, ..., scaffold
    order = [int(x) for x in pieces[1::2]]
    if order != sorted(set(order)):
        raise RecordError("template_not_verbatim", "the chat template repeats or reorders message text")
    for k in sorted(set(range(len(slots))) - set(order)):
        if slots[k].kind != "reasoning" and slots[k].text:
            raise RecordError(
                "template_not_verbatim", f"messages[{slots[k].msg}]: the chat template drops this message's text"
            )
    located, pos, rebuilt = [], 0, []
    for k, scaffold in zip(order, pieces[0::2]):
        pos += len(scaffold)
        located.append(Located(k, pos, pos + len(slots[k].text)))
        rebuilt += [scaffold, slots[k].text]
        pos += len(slots[k].text)
    rebuilt.append(pieces[-1])
    if "".join(rebuilt) == rendered:
        return located
    return _locate_by_segments(ctx, conv, slots, sentinel_text, rendered)


def _locate_by_segments(ctx, conv, slots, sentinel_text: str, rendered: str) -> list[Located]:
    """Fallback: both renderings must share the same control-token skeleton; inside each plain segment the scaffold
    around a slot must match exactly and the slot must be a known rewrite of its text (see _candidates)."""
    split = ctx._special_re.split if ctx._special_re is not None else (lambda s: [s])
    specials = ctx._special_re.findall if ctx._special_re is not None else (lambda s: [])
    if specials(sentinel_text) != specials(rendered):
        raise RecordError("template_not_verbatim", "the chat template changes its control tokens with the message text")
    located, base = [], 0
    r_specials = specials(rendered)
    for j, (zseg, rseg) in enumerate(zip(split(sentinel_text), split(rendered))):
        parts = _SENTINEL_RE.split(zseg)
        scaffold, ks = parts[0::2], [int(k) for k in parts[1::2]]
        if not rseg.startswith(scaffold[0]):
            raise RecordError("template_not_verbatim", "the chat template rewrites scaffolding around message text")
        cur = len(scaffold[0])
        for n, k in enumerate(ks):
            nxt, last, slot = scaffold[n + 1], n == len(ks) - 1, slots[k]
            # After a turn's last text, tool-call rendering may depend on the text (e.g. only if non-empty).
            loose_tail = last and bool(conv.messages[slot.msg].tool_calls)
            found = None
            for cand in _candidates(slot.text):
                if not rseg.startswith(cand, cur):
                    continue
                after = cur + len(cand)
                if (rseg[after:] == nxt or loose_tail) if last else rseg.startswith(nxt, after):
                    found = cand
                    break
            if found is None:
                raise RecordError(
                    "template_not_verbatim",
                    f"messages[{slot.msg}]: rendered text is not a known rewrite of the message text",
                )
            located.append(Located(k, base + cur, base + cur + len(found)))
            cur += len(found) + len(nxt)
        if not ks and zseg != rseg:
            raise RecordError("template_not_verbatim", "the chat template rewrites scaffolding between messages")
        base += len(rseg) + (len(r_specials[j]) if j < len(r_specials) else 0)
    return located


def check_role_markers(ctx, conv: Conversation, slots, located, rendered: str) -> None:
    """--role-boundaries: each located slot must lie inside its role's region, from the nearest start marker of that
    role (with no other role's start after it) to that role's next end marker."""
    markers = ctx.family.role_markers
    starts = sorted(
        (m.start(), m.end(), role) for role, (st, _) in markers.items() for m in re.finditer(re.escape(st), rendered)
    )
    for loc in located:
        role = conv.messages[slots[loc.slot].msg].role
        if role not in markers:
            continue
        before = [(a, b, r) for a, b, r in starts if b <= loc.start]
        end = rendered.find(markers[role][1], before[-1][1]) if before else -1
        if not before or before[-1][2] != role or end < loc.end:
            raise RecordError(
                "role_boundary_mismatch",
                f"messages[{slots[loc.slot].msg}] ({role}) text is not inside its declared "
                f"{markers[role][0]!r}...{markers[role][1]!r} markers",
            )


def _tool_calls_rendered(gap: str, tool_calls) -> bool:
    """Each call's name, and its arguments string verbatim or each argument key and value, appear in the text the
    template put after the turn."""
    cur = 0
    for tc in tool_calls:
        at = gap.find(tc.name, cur)
        if at < 0:
            return False
        if isinstance(tc.arguments, str) and gap.find(tc.arguments, at) >= 0:
            cur = at + len(tc.name)
            continue
        args = json.loads(tc.arguments_json)
        items = args.items() if isinstance(args, dict) else [("", args)]
        for k, v in items:
            if k and gap.find(k, at) < 0:
                return False
            forms = {json.dumps(v), json.dumps(v, ensure_ascii=False)}
            if not isinstance(v, (dict, list)):
                forms.add(str(v))
            if not any(gap.find(f, at) >= 0 for f in forms):
                return False
        cur = at + len(tc.name)
    return True


@dataclass
class _Interval:
    """A trained char span of `rendered` and the message it belongs to."""

    start: int
    end: int
    msg: int = -1


@dataclass(frozen=True, eq=False)  # built positionally in sample.py: its locals carry these names
class MaskInputs:
    """What the mask is computed from: the located slots in `rendered`, and the tokens of `expanded` (the rendered
    text with each image and video expanded; `at` maps a char of `rendered` to its char in `expanded`)."""

    conv: Conversation
    ctx: Any  # render.RenderContext (render imports this module, not the other way round)
    slots: list  # chat_template.Slot of each text the template received
    located: list[Located]
    rendered: str
    expanded: str
    at: Callable[[int], int]
    ids: np.ndarray  # token ids of `expanded`
    starts: np.ndarray  # each token's char span in `expanded`
    ends: np.ndarray


@dataclass
class _Marks:
    """The mask being built, the proofs it must pass, and each trained turn's token bounds."""

    mask: np.ndarray
    proofs: list[tuple[np.ndarray, str]]
    turn_tokens: dict[int, list[int]]


def compute_mask(inp: MaskInputs) -> tuple[np.ndarray, int, list[tuple[int, int, int]]]:
    """The uint8 loss mask, the number of turns whose tool calls the template did not render, and the (message,
    first, end) token span of each trained turn; a mask that cannot be proven is a RecordError."""
    by_msg: dict[int, list[Located]] = {}
    for loc in sorted(inp.located, key=lambda x: x.start):
        by_msg.setdefault(inp.slots[loc.slot].msg, []).append(loc)
    body_end, unrendered_msgs = _body_ends(inp, by_msg)
    trained = _trained(inp, by_msg, unrendered_msgs)
    intervals = _intervals(inp, by_msg, trained, body_end)
    marks = _Marks(np.zeros(len(inp.ids), dtype=bool), [], {})
    _mark_intervals(inp, intervals, marks)
    _mark_end_of_turns(inp, _eos_for(inp.ctx.policy, trained, by_msg), by_msg, intervals, body_end, marks)
    _prove(inp, marks.proofs)
    if not marks.mask.any():
        raise RecordError("no_trainable_tokens", "no token of this record is trained")
    spans = sorted((i, min(t), max(t)) for i, t in marks.turn_tokens.items())
    return marks.mask.astype(np.uint8), len(unrendered_msgs), spans


def _next_special(inp: MaskInputs, pos: int, skip: tuple[str, ...] = ()) -> int:
    special, rendered = inp.ctx._special_re, inp.rendered
    while True:
        m = special.search(rendered, pos) if special is not None else None
        if m is None or m.group() not in skip:
            return m.start() if m else len(rendered)
        pos = m.end()  # a control token the model generates as part of the turn (Mistral's [TOOL_CALLS])


def _body_ends(inp: MaskInputs, by_msg: dict[int, list[Located]]) -> tuple[dict[int, int], set[int]]:
    """Where each message's body ends in `rendered`: its last text, plus tool calls or whitespace the template
    prints before the next control token (the model must generate those too); and the turns whose tool calls the
    template did not render."""
    body_end, unrendered_msgs = {}, set()
    for i, locs in by_msg.items():
        e = locs[-1].end
        m = inp.conv.messages[i]
        gap = inp.rendered[e : _next_special(inp, e, inp.ctx.family.tool_call_tokens if m.tool_calls else ())]
        if m.tool_calls:
            if _tool_calls_rendered(gap, m.tool_calls):
                e += len(gap)
            else:
                unrendered_msgs.add(i)
        elif not gap.strip():
            e += len(gap)
        body_end[i] = e
    for i, m in enumerate(inp.conv.messages):
        if m.role == "assistant" and m.tool_calls and i not in by_msg:
            unrendered_msgs.add(i)
    return body_end, unrendered_msgs


def _trained(inp: MaskInputs, by_msg: dict[int, list[Located]], unrendered_msgs: set[int]) -> list[int]:
    policy = inp.ctx.policy
    trained = []
    for i in trained_messages(inp.conv, policy):
        if i in unrendered_msgs:
            if policy.tool_calls == "reject":
                raise RecordError(
                    "tool_calls_not_rendered",
                    f"messages[{i}]: the chat template does not render this turn's tool_calls; pass a "
                    "tool-aware --chat-template, or --tool-calls drop-from-loss",
                )
            if policy.tool_calls == "drop-from-loss":
                continue
        if i in by_msg:
            trained.append(i)
    return trained


def _intervals(
    inp: MaskInputs, by_msg: dict[int, list[Located]], trained: list[int], body_end: dict[int, int]
) -> list[_Interval]:
    special = inp.ctx._special_re
    intervals: list[_Interval] = []
    for i in trained:
        locs = by_msg[i]
        if inp.ctx.policy.reasoning == "context":  # the reasoning is context: training starts at the text after it
            kept = [loc for loc in locs if inp.slots[loc.slot].kind != "reasoning"]
            locs = kept or [Located(-1, locs[-1].end, locs[-1].end)]
        run = _Interval(locs[0].start, locs[0].end, msg=i)
        for loc in locs[1:]:
            between = inp.rendered[run.end : loc.start]
            if special is not None and special.search(between):
                intervals.append(run)  # an image or other control token splits the turn: never train it
                run = _Interval(loc.start, loc.end, msg=i)
            else:
                run.end = loc.end  # plain template text inside one turn (e.g. "</think>"): the model generates it
        run.end = body_end[i]
        intervals.append(run)
    return intervals


def _eos_for(policy: MaskPolicy, trained: list[int], by_msg: dict[int, list[Located]]) -> set[int]:
    if policy.train_on_eos == "turn":
        return set(trained)
    if policy.train_on_eos == "last" and trained:
        return {trained[-1]}
    if policy.train_on_eos == "all":
        return set(by_msg)
    return set()


def _mark_intervals(inp: MaskInputs, intervals: list[_Interval], marks: _Marks) -> None:
    starts, ends, expanded, ctx = inp.starts, inp.ends, inp.expanded, inp.ctx
    nonempty = ends > starts  # tokens that cover chars (once, not per interval)
    for iv in intervals:
        s, e = inp.at(iv.start), inp.at(iv.end)
        straddle = ((starts < s) & (ends > s)).nonzero()[0]
        if len(straddle):
            t0 = int(starts[straddle[0]])
            if expanded[t0:s].strip():
                raise RecordError(
                    "mask_boundary_misaligned", f"messages[{iv.msg}]: a token crosses the start of the message text"
                )
            s = t0  # a header's trailing space merged into the first token: generated by the model, so trained
        if ((starts < e) & (ends > e)).any():
            raise RecordError(
                "mask_boundary_misaligned", f"messages[{iv.msg}]: a token crosses the end of the message text"
            )
        sel = (starts >= s) & (ends <= e) & nonempty
        marks.mask |= sel
        marks.proofs.append((sel, expanded[s:e].replace(ctx.token_break, "") if ctx.token_break else expanded[s:e]))
        hit = sel.nonzero()[0]
        if len(hit):
            marks.turn_tokens.setdefault(iv.msg, []).extend([int(hit[0]), int(hit[-1]) + 1])


def _mark_end_of_turns(
    inp: MaskInputs,
    eos_for: set[int],
    by_msg: dict[int, list[Located]],
    intervals: list[_Interval],
    body_end: dict[int, int],
    marks: _Marks,
) -> None:
    """End-of-turn tokens: for a trained turn the one starting exactly where its body ends; with "all", for any
    other message the first one before the next message's text."""
    ids, starts, ctx, conv = inp.ids, inp.starts, inp.ctx, inp.conv
    last_interval_of = {iv.msg: iv for iv in intervals}
    msg_starts = sorted((inp.at(locs[0].start), i) for i, locs in by_msg.items())
    is_eot = np.logical_or.reduce([ids == t for t in ctx.eot_ids])  # np.isin's answer, without its set-up
    for i in sorted(eos_for):
        e = inp.at(last_interval_of[i].end if i in last_interval_of else body_end[i])
        limit = next((s for s, j in msg_starts if j > i), len(inp.expanded))
        hit = ((starts == e) & is_eot).nonzero()[0] if i in last_interval_of else []
        if not len(hit) and (i not in last_interval_of or conv.messages[i].role != "assistant"):
            hit = ((starts >= e) & (starts < limit) & is_eot).nonzero()[0]  # e.g. after a trailing image
        if len(hit):
            k = int(hit[0])
            marks.mask[k] = True
            if i in marks.turn_tokens:  # a trained turn ends with its end-of-turn: cut before it, it is not trained
                marks.turn_tokens[i].extend([k, k + 1])
            one = np.zeros(len(ids), dtype=bool)
            one[k] = True
            marks.proofs.append((one, ctx.eot_ids[int(ids[k])]))
        elif i in last_interval_of and conv.messages[i].role == "assistant" and inp.expanded[e:].strip():
            raise RecordError(
                "end_of_turn_not_found",
                f"messages[{i}]: no {'/'.join(ctx.family.end_of_turn)} right after the turn, so the "
                "model could not learn to stop; check the template or --role-boundaries",
            )


def _prove(inp: MaskInputs, proofs: list[tuple[np.ndarray, str]]) -> None:
    """Every trained span decodes back to exactly the rendered text it covers."""
    for sel, want in proofs:
        got = inp.ctx.text.decode(inp.ids[sel])
        if got != want:
            raise RecordError(
                "mask_verification_failed", f"trained span decodes to {got[:60]!r}, expected {want[:60]!r}"
            )
