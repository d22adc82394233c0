"""Long agent traces: --long-traces split (every trained turn in exactly one sample, each sample the exact render of
its own message list), --keep-images last:N, --min/--max-pixels, determinism, and the per-record turn accounting."""

import base64
import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig
from vlmprep.render.traces import StepConversation, StepPolicy, keep_last_images, split_trace
from vlmprep.shards.reader import iter_dataset
from vlmprep.types import Conversation, ImageData, Message, Part, Source

ROOT = Path(__file__).resolve().parents[2]
TOOLS_TEMPLATE = str(ROOT / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")


def msg(role, text="", images=0):
    parts = [Part("text", text=text)] if text else []
    parts += [Part("image", image=ImageData(data=bytes([k]), origin="x")) for k in range(images)]
    return Message(role=role, parts=parts)


def trace(n_steps):
    """system, task (with a screenshot), then per step: assistant call + tool result with a screenshot."""
    ms = [msg("system", "sys"), msg("user", "task", images=1)]
    for k in range(n_steps):
        ms += [msg("assistant", f"act {k}"), msg("tool", f"result {k}", images=1)]
    ms.append(msg("assistant", "final answer"))
    return Conversation(id="t", source=Source("f", 1), messages=ms)


def cost(sc: StepConversation) -> int:
    # 10 tokens per message, 50 per image: additive, as for Qwen-style templates.
    return sum(10 + 50 * len(m.images) for m in sc.conv.messages)


def test_split_trains_every_turn_once_with_task_and_recent_history():
    conv = trace(6)
    trained = [i for i, m in enumerate(conv.messages) if m.role == "assistant"]
    samples, lost = split_trace(conv, trained, StepPolicy(long_traces="split"), cost, seq_len=260)
    assert not lost
    seen = [t for s in samples for t in s.trains]
    assert sorted(seen) == trained and len(seen) == len(set(seen))  # every trained turn exactly once
    for s in samples:
        assert s.source_messages[:2] == [0, 1]  # the system message and the task, always
        assert conv.messages[s.source_messages[-1]].role == "assistant" and s.source_messages[-1] in s.trains
        assert cost(s) <= 260
        for i in s.source_messages:  # a tool result never without the call that produced it
            if conv.messages[i].role == "tool":
                assert i - 1 in s.source_messages
        held = s.source_messages[2:]
        assert held == list(range(held[0], held[-1] + 1))  # the most recent history, contiguous
        # Context is untrained: only `trains` carry weight 1.
        assert [m.weight for m in s.conv.messages] == [int(i in s.trains) for i in s.source_messages]
    assert [s.split for s in samples] == list(range(len(samples))) and len(samples) > 1


def test_a_turn_that_cannot_fit_is_reported_and_the_rest_still_split():
    conv = trace(3)
    conv.messages[4] = msg("assistant", "huge " * 10, images=0)
    trained = [i for i, m in enumerate(conv.messages) if m.role == "assistant"]

    def big(sc):  # message 4 alone costs more than the budget
        return cost(sc) + (1000 if 4 in sc.source_messages else 0)

    samples, lost = split_trace(conv, trained, StepPolicy(long_traces="split"), big, seq_len=200)
    # Turn 6 acts on tool result 5, which comes with the call that produced it (4): it cannot fit either, and is
    # reported lost rather than trained without the screen it acts on.
    assert lost == [4, 6]
    assert sorted(t for s in samples for t in s.trains) == [t for t in trained if t not in (4, 6)]


def missing_observation(roles: list[str], held: list[int], trains: list[int]) -> list[int]:
    """The trained assistant turns of one sample that lack a message of what they act on: every message since the
    assistant turn before them (tool results, screenshots, user follow-ups); [] when each has all of it."""
    bad = []
    for t in trains:
        if roles[t] != "assistant":
            continue
        k = t - 1
        while k >= 0 and roles[k] != "assistant":
            if k not in held:
                bad.append(t)
                break
            k -= 1
    return bad


@st.composite
def step_traces(draw):
    """A trace after its head (system?, task): steps of assistant / tool / user messages in any order, a cost per
    message, the trained subset of its assistant turns, and a --seq-len."""
    roles = (["system"] if draw(st.booleans()) else []) + ["user"]
    roles += draw(st.lists(st.sampled_from(["assistant", "assistant", "tool", "user"]), min_size=1, max_size=24))
    costs = draw(st.lists(st.integers(1, 60), min_size=len(roles), max_size=len(roles)))
    assistants = [i for i, r in enumerate(roles) if r == "assistant"]
    trained = sorted(draw(st.sets(st.sampled_from(assistants)))) if assistants else []
    seq_len = draw(st.integers(20, 400))
    return roles, costs, trained, seq_len


@given(step_traces())
def test_every_trained_step_keeps_the_observation_it_acts_on_or_is_lost(case):
    """The property of --long-traces split: a trained turn lands in exactly one sample, with every message since the
    assistant turn before it (and the call a tool result answers), or is reported lost; never trained without it."""
    roles, costs, trained, seq_len = case
    conv = Conversation(id="t", source=Source("f", 1), messages=[msg(r, f"m{i}") for i, r in enumerate(roles)])
    by_text = {f"m{i}": c for i, c in enumerate(costs)}

    def count(sc: StepConversation) -> int:
        return sum(by_text[m.text] for m in sc.conv.messages)

    samples, lost = split_trace(conv, trained, StepPolicy(long_traces="split"), count, seq_len=seq_len)
    landed = [t for s in samples for t in s.trains]
    assert sorted(landed + lost) == sorted(set(trained) | set(lost)) and len(landed) == len(set(landed))
    assert not set(landed) & set(lost) and set(lost) <= set(trained)
    for s in samples:
        assert count(s) <= seq_len and s.source_messages == sorted(set(s.source_messages))
        assert missing_observation(roles, s.source_messages, s.trains) == []
        for i in s.source_messages:  # a tool result never without the call that produced it
            if roles[i] == "tool" and i > roles.index("user") + 1:
                j = i - 1
                while roles[j] == "tool":
                    j -= 1
                assert j in s.source_messages, (i, j, s.source_messages)
        assert [m.weight for m in s.conv.messages] == [int(i in s.trains) for i in s.source_messages]


def test_the_step_after_a_split_point_keeps_its_screenshot():
    """The bug this property guards: a sample that starts at a trained turn held the task, then the turn, but not the
    tool result (the screenshot) right before it."""
    conv = trace(6)
    trained = [i for i, m in enumerate(conv.messages) if m.role == "assistant"]
    samples, lost = split_trace(conv, trained, StepPolicy(long_traces="split"), cost, seq_len=200)
    assert not lost and len(samples) > 2
    roles = [m.role for m in conv.messages]
    for s in samples:
        assert missing_observation(roles, s.source_messages, s.trains) == []
        first = s.trains[0]
        if first > 2:  # its observation, the tool result before it, and the call that result answers
            assert {first - 2, first - 1} <= set(s.source_messages)


def test_keep_last_images_drops_or_replaces_earlier_ones():
    conv = trace(4)  # 5 images: task + 4 tool results
    kept, removed = keep_last_images(conv, 2, None)
    assert removed == [0, 1, 2] and len(kept.images) == 2
    assert kept.messages[1].parts == [Part("text", text="task")]
    kept, removed = keep_last_images(conv, 2, "[old screenshot]")
    assert len(kept.images) == 2 and kept.messages[1].text == "task[old screenshot]"
    assert keep_last_images(conv, 9, None) == (conv, [])


# ---- end to end on demo agent traces -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from scripts.demo_traces import write_traces

    p = tmp_path_factory.mktemp("steps") / "t.jsonl.zst"
    write_traces(
        p,
        n=6,
        seed=1,
        min_images=3,
        max_images=10,
        width=320,
        height=200,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    return p


def raw_records(path):
    import zstandard

    return [
        json.loads(line) for line in zstandard.ZstdDecompressor().stream_reader(open(path, "rb")).read().splitlines()
    ]


def build_steps(traces, out, **kw):
    kw.setdefault("chat_template", TOOLS_TEMPLATE)
    kw.setdefault("seq_len", 1024)
    kw.setdefault("samples_per_shard", 4)
    return build(BuildConfig(inputs=(str(traces),), out=str(out), progress=False, **kw))


def trained_runs(ids, mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [ids[s:e] for s, e in zip(edges[::2], edges[1::2])]


def coverage_from_shards(ds, records, tokenizer) -> tuple[int, int]:
    """(input assistant turns, turns trained in the shards): every trained run decoded and matched to its turn."""
    trained_by_record: dict[int, list[int]] = {}
    for s in iter_dataset(ds):
        meta = s.meta()
        rec = records[int(s.key[:10])]["messages"]
        runs = trained_runs(s.array("input_ids"), s.array("loss_mask"))
        # A truncated sample may end inside a turn: that partial run is not a trained turn (lost to the cut).
        assert len(runs) == len(meta["trains"]) + (meta["truncated"] and len(runs) > len(meta["trains"])), s.key
        for run, i in zip(runs, meta["trains"]):
            text = tokenizer.decode(run.tolist(), skip_special_tokens=False)
            content = rec[i].get("content") or ""
            content = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
            assert rec[i]["role"] == "assistant" and text.startswith(content) and text.endswith("<|im_end|>")
            trained_by_record.setdefault(int(s.key[:10]), []).append(i)
    n_input = sum(1 for r in records for m in r["messages"] if m["role"] == "assistant")
    for pos, turns in trained_by_record.items():
        assert len(turns) == len(set(turns)), f"record {pos}: a turn trained twice"
    return n_input, sum(len(t) for t in trained_by_record.values())


def test_split_covers_every_turn_and_truncate_reports_its_loss(traces, tmp_path, qwen2vl_processor):
    records = raw_records(traces)
    tok = qwen2vl_processor.tokenizer
    cut = build_steps(traces, tmp_path / "truncate", long_traces="truncate", min_turn_coverage=0.0)  # loss on purpose
    n, trained = coverage_from_shards(tmp_path / "truncate", records, tok)
    assert trained < n and cut.manifest.turns["trained_assistant_turns"] == trained
    assert cut.manifest.turns["lost"]["truncated"] == n - trained
    split = build_steps(traces, tmp_path / "split", long_traces="split")
    n2, trained2 = coverage_from_shards(tmp_path / "split", records, tok)
    assert n2 == trained2 == n and split.manifest.turns["coverage"] == 1.0
    assert split.manifest.totals["split_samples"] > 0 and split.manifest.turns["context_tokens_repeated"] > 0
    assert all(s.meta()["num_tokens"] <= 1024 and not s.meta()["truncated"] for s in iter_dataset(tmp_path / "split"))
    from vlmprep.tools.verify import verify_dataset

    assert verify_dataset(tmp_path / "split") == []


def reference_messages(record, meta, dropped_text=None, parse_arguments=False):
    """The sample's message list straight from the input record (not through vlmprep): the messages the meta names,
    images as PIL, those the history policy removed dropped (or replaced by the text). parse_arguments: tool-call
    arguments given as JSON strings become objects (templates that iterate them, like Qwen3.5's, need that)."""
    out, k = [], 0
    held = set(meta["messages"])
    for i, m in enumerate(record["messages"]):
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        new = []
        for p in parts:
            if p.get("type") == "image_url":
                removed = k in meta["removed_images"]
                if i in held and not removed:
                    url = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                    new.append(
                        {"type": "image", "image": Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))}
                    )
                elif i in held and dropped_text is not None:
                    new.append({"type": "text", "text": dropped_text})
                k += 1
            else:
                new.append(p)
        if i in held:
            m = {**m, "content": new}
            if parse_arguments and m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        **tc,
                        "function": {
                            **tc["function"],
                            "arguments": json.loads(a) if isinstance(a := tc["function"]["arguments"], str) else a,
                        },
                    }
                    for tc in m["tool_calls"]
                ]
            out.append(m)
    return out


@pytest.mark.parametrize(
    "name",
    [
        "qwen2-vl",
        pytest.param("qwen2.5-vl", marks=pytest.mark.slow),
        pytest.param("qwen3-vl", marks=pytest.mark.slow),
        pytest.param("qwen3.5", marks=pytest.mark.slow),
    ],
)
def test_each_split_sample_is_the_exact_render_of_its_own_messages(name, traces, tmp_path):
    """Qwen3.5's template rewrites earlier turns (think-stripping before the last user query): split samples are
    still exactly what it renders from their own message lists."""
    from transformers import AutoProcessor

    kw = {"chat_template": TOOLS_TEMPLATE} if name in ("qwen2-vl", "qwen2.5-vl") else {"chat_template": None}
    out = tmp_path / name
    res = build_steps(
        traces,
        out,
        processor=f"builtin:{name}",
        long_traces="split",
        keep_images=3,
        dropped_image_text="[earlier screenshot]",
        **kw,
    )
    assert res.manifest.totals["split_samples"] > 0
    proc = AutoProcessor.from_pretrained(str(out / "processor"), local_files_only=True)
    records = raw_records(traces)
    checked = 0
    for s in iter_dataset(out):
        meta = s.meta()
        msgs = reference_messages(records[int(s.key[:10])], meta, "[earlier screenshot]", name == "qwen3.5")
        tools = records[int(s.key[:10])].get("tools")
        ref = proc.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True, return_tensors="np")
        np.testing.assert_array_equal(s.array("input_ids"), ref["input_ids"][0], err_msg=s.key)
        assert len(s.array("image_grid_thw")) <= 3  # --keep-images last:3
        checked += meta["split"] is not None
    assert checked >= 3
    from vlmprep.tools.verify import verify_dataset

    assert verify_dataset(out) == []  # placeholders = grid rows, pixels at grid size, occurrence map


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_max_pixels_is_saved_and_gives_the_processors_own_grid(traces, tmp_path):
    from transformers import AutoProcessor

    out = tmp_path / "mp"
    build_steps(traces, out, max_pixels=128 * 28 * 28, min_pixels=4 * 28 * 28, seq_len=8192)
    proc = AutoProcessor.from_pretrained(str(out / "processor"), local_files_only=True)
    assert proc.image_processor.size.longest_edge == 128 * 28 * 28
    records = raw_records(traces)
    for s in list(iter_dataset(out))[:3]:
        msgs = reference_messages(records[int(s.key[:10])], {**s.meta(), "messages": s.meta()["messages"]})
        pils = [p["image"] for m in msgs for p in m["content"] if p["type"] == "image"]
        ref = proc.image_processor(images=pils, return_tensors="np")
        np.testing.assert_array_equal(s.array("image_grid_thw"), ref["image_grid_thw"])
        assert all(int(np.prod(g)) <= 128 * 4 for g in s.array("image_grid_thw"))
    with pytest.raises(ValueError, match="min_pixels"):
        BuildConfig(inputs=("x",), out="o", min_pixels=10, max_pixels=5)
    # The trainer reads the budgeted dataset unchanged: its decoder checks every grid against the pixels and the
    # placeholder count, with the image spec of the saved (budgeted) processor; then one batch collates.
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.decode import OriginalResizer, decode_sample
    from trainer.data.processors import load_image_processor_config
    from trainer.data.tars import iter_tar_samples
    from trainer.data.vision import ImageSpec, Patchifier

    spec = ImageSpec.from_config(load_image_processor_config(str(out / "processor")))
    decoded = [
        decode_sample(m, key=k, url=str(p), spec=spec, resize_original=OriginalResizer(spec))
        for p in sorted(out.glob("shard-*.tar"))
        for _, k, m in iter_tar_samples(str(p), lambda i: True)
    ]
    batch = collate(
        decoded[:2],
        CollateSpec(pad_id=151643, image_token_id=151655, patch_size=spec.patch_size, merge_size=spec.merge_size),
    )
    pixels = Patchifier(spec, "cpu")(batch.images, batch.image_index)
    assert pixels.shape[0] == int(batch.image_grid_thw.prod(dim=1).sum())


@pytest.mark.slow  # two builds, one with 2 spawned workers (test_build.py keeps the byte-identity check in make test)
def test_split_build_is_byte_identical_for_any_worker_count(traces, tmp_path, qwen2vl_processor):
    def hashes(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}

    build_steps(traces, tmp_path / "a", long_traces="split", keep_images=3)
    build_steps(traces, tmp_path / "b", long_traces="split", keep_images=3, workers=2)
    assert hashes(tmp_path / "a") == hashes(tmp_path / "b")


def test_a_step_that_cannot_fit_is_rejected_with_its_reason_and_the_rest_lands(tmp_path, qwen2vl_processor):
    long = " ".join(f"w{i}" for i in range(600))
    rec = {
        "id": "r",
        "messages": [
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "step one"},
            {"role": "user", "content": "go on"},
            {"role": "assistant", "content": long},
            {"role": "user", "content": "and"},
            {"role": "assistant", "content": "step three"},
        ],
    }
    ok = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps(rec) + "\n" + json.dumps(ok) + "\n")
    res = build(
        BuildConfig(
            inputs=(str(p),),
            out=str(tmp_path / "o"),
            seq_len=128,
            long_traces="split",
            progress=False,
            min_turn_coverage=0.0,
        )
    )  # a lost turn on purpose
    rejects = [json.loads(line) for line in (tmp_path / "o" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["id"]) for r in rejects] == [("turn_too_long", "r")] and "messages[3]" in rejects[0][
        "message"
    ]
    ids = sorted(s.meta()["id"] for s in iter_dataset(tmp_path / "o"))
    assert "ok" in ids and any(i.startswith("r#") for i in ids)
    assert res.manifest.turns["lost"]["turn_too_long"] == 1
    trained = sorted(t for s in iter_dataset(tmp_path / "o") if s.meta()["id"] != "ok" for t in s.meta()["trains"])
    assert trained == [1, 5]


@pytest.mark.slow  # four builds of the 64 demo traces with 1280x720 screenshots: ~5 min on 2 cores
@pytest.mark.parametrize("seq_len", [8192, 16384])
def test_demo_traces_coverage_split_is_complete_and_truncate_reports_todays(seq_len, tmp_path, qwen2vl_processor):
    """On `make demo`'s own input: every input assistant turn trained exactly once with split (or lost loudly where
    what it acts on cannot fit), matched by decoding the trained spans of the shards; truncation's coverage reported as measured."""
    from scripts.demo_traces import write_traces

    inp = tmp_path / "demo.jsonl.zst"
    write_traces(inp, n=64, seed=0)
    records = raw_records(inp)
    tok = qwen2vl_processor.tokenizer
    for mode in ("truncate", "split"):
        res = build_steps(
            inp,
            tmp_path / mode,
            seq_len=seq_len,
            long_traces=mode,
            workers=2,
            samples_per_shard=16,
            min_turn_coverage=0.0 if mode == "truncate" else 0.95,
        )
        n, trained = coverage_from_shards(tmp_path / mode, records, tok)
        assert n == 888 and res.manifest.turns["trained_assistant_turns"] == trained
        if mode == "split":
            # Every turn but those whose observation alone (a tool result holding a ~13k-token page dump) cannot
            # fit: those are lost loudly, as turn_too_long, never trained without it.
            lost = res.manifest.turns["lost"]["turn_too_long"]
            assert trained == n - lost and lost == {8192: 2, 16384: 1}[seq_len]
        else:
            assert trained == {8192: 314, 16384: 618}[seq_len]  # the figures docs/build.md reports


REAL_TRACES = Path(os.environ.get("VLMPREP_REAL_TRACES", ROOT.parent / "shared" / "data" / "real_traces"))


def test_real_agent_trajectories_train_no_step_without_the_screen_it_acts_on(tmp_path):
    """The real OpenCUA and WebVoyager trajectories built with the defaults (split at --seq-len 8192) and the
    tool-aware template: no sample trains an assistant turn without every message since the assistant turn before
    it; the 9 of 159 turns that used to lose their screenshot now keep it."""
    files = [REAL_TRACES / "opencua.jsonl", REAL_TRACES / "webvoyager.jsonl"]
    if not all(f.is_file() for f in files):
        pytest.skip(f"real trajectories not found under {REAL_TRACES} (VLMPREP_REAL_TRACES names another place)")
    res = build(
        BuildConfig(
            inputs=tuple(map(str, files)),
            out=str(tmp_path / "o"),
            chat_template="qwen2_vl_tools",
            progress=False,
            workers=2,
        )
    )
    roles = {
        (str(f), i + 1): [m["role"] for m in json.loads(line)["messages"]]
        for f in files
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines())
    }
    checked, split = 0, 0
    for s in iter_dataset(tmp_path / "o"):
        meta = s.meta()
        r = roles[(meta["source"]["file"], meta["source"]["line"])]
        assert missing_observation(r, meta["messages"], meta["trains"]) == [], meta["id"]
        checked += sum(r[t] == "assistant" for t in meta["trains"])
        split += meta["split"] is not None
    turns = res.manifest.turns
    assert checked == turns["trained_assistant_turns"] == 159 and split >= 9
    assert turns["trained_assistant_turns"] + turns["lost"]["turn_too_long"] == turns["input_assistant_turns"]
