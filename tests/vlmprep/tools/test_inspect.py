import io
import json
import re
import shutil
import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig

SEQ_LEN = 1024
# Rich must see a plain pipe, whatever the environment running the tests asks for.
PLAIN_ENV = {"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "TTY_INTERACTIVE": None, "NO_COLOR": None}
JP_ID = "jp-greeting"
JP_ANSWER = "\u3053\u3093\u306b\u3061\u306f \U0001f44b \u00e9t\u00e9"  # multi-byte characters split across tokens


def write_inputs(path):
    """6 demo traces (one overlong: truncated at SEQ_LEN, dropping an image), a multi-byte record and 3 rejects."""
    from scripts.demo_traces import generate_traces

    recs = list(
        generate_traces(
            n=6,
            seed=1,
            min_images=1,
            max_images=3,
            width=320,
            height=200,
            overlong_fraction=0.2,
            text_only_fraction=0.1,
        )
    )
    lines = [json.dumps(r) for r in recs]
    lines.append(
        json.dumps(
            {
                "id": JP_ID,
                "messages": [
                    {"role": "user", "content": "Greet me in Japanese."},
                    {"role": "assistant", "content": JP_ANSWER},
                ],
            }
        )
    )
    lines.append("{not json")
    lines.append(json.dumps({"id": "no-answer", "messages": [{"role": "user", "content": "hello?"}]}))
    lines.append(lines[0])  # same id again: build rejects it as duplicate_id
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    inp = write_inputs(d / "traces.jsonl")
    out = d / "shards"
    # The demo's tool calls are not rendered by the Qwen2-VL template: train their text content anyway.
    build(
        BuildConfig(
            inputs=(str(inp),),
            out=str(out),
            seq_len=SEQ_LEN,
            samples_per_shard=3,
            tool_calls="train-content",
            progress=False,
            max_reject_fraction=1.0,  # rejects on purpose,
            long_traces="truncate",
            min_turn_coverage=0.0,
        )
    )  # and truncated samples
    return inp, out


def read_shards(out):
    """Plain tarfile + np.load: the reference the inspect output is checked against."""
    samples = {}
    for tar in sorted(out.glob("shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {"shard": tar.name})[ext] = tf.extractfile(m).read()
    for s in samples.values():
        for name in ("input_ids", "loss_mask", "mm_token_type_ids", "image_grid_thw"):
            s[name] = np.load(io.BytesIO(s[name + ".npy"]), allow_pickle=False)
        s["meta"] = json.loads(s["json"])
    return samples


def runs(flags):
    """[start, end) of each maximal run of True."""
    f = np.concatenate([[0], np.asarray(flags, dtype=np.int8), [0]])
    d = np.diff(f)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def invoke(*args):
    return CliRunner().invoke(app, ["inspect", *map(str, args)], env=PLAIN_ENV)


def blocks(output):
    """{key: text of that sample's block} from plain output."""
    parts = re.split(r"^=== sample (\d{10}) .*===$", output, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


MARKER = re.compile(r"\[image (\d+): (\d+)x(\d+) patches -> (\d+) tokens\]")


def test_plain_output_marks_exactly_the_trained_spans(built, qwen2vl_processor):
    _, out = built
    ref = read_shards(out)
    res = invoke(out, "--limit", 100)
    assert res.exit_code == 0, res.output
    assert "\x1b[" not in res.output  # no ANSI codes without a TTY
    got = blocks(res.stdout)
    assert sorted(got) == sorted(ref)
    tok = qwen2vl_processor.tokenizer
    for key, s in ref.items():
        block = got[key]
        want = [tok.decode(s["input_ids"][a:b].tolist(), skip_special_tokens=False) for a, b in runs(s["loss_mask"])]
        assert re.findall(r"\[T\](.*?)\[/T\]", block, flags=re.S) == want, key
        # Every image placeholder run is one marker with its grid and exact token count.
        image_runs = runs(s["mm_token_type_ids"] == 1)
        markers = MARKER.findall(block)
        assert [int(m[0]) for m in markers] == list(range(1, len(image_runs) + 1))
        for (_k, h, w, n), (a, b), grid in zip(markers, image_runs, s["image_grid_thw"]):
            # the image's whole unit: <|vision_start|>, its placeholders, <|vision_end|>
            assert (int(h), int(w)) == (grid[1], grid[2]) and int(n) == b - a + 2 == grid.prod() // 4 + 2
        assert "<|image_pad|>" not in block and "<|vision_start|>" not in block and "<|vision_end|>" not in block
        assert "<|im_start|>assistant" in block  # special tokens stay visible
        m = s["meta"]
        assert f"tokens {len(s['input_ids'])} | trained {int(s['loss_mask'].sum())} (" in block
        assert f"source {m['source']['file']}:{m['source']['line']}" in block
    jp = next(k for k, s in ref.items() if s["meta"]["id"] == JP_ID)
    assert f"[T]{JP_ANSWER}<|im_end|>[/T]" in got[jp]


def test_messages_and_roles_are_shown(built):
    _, out = built
    res = invoke(out, "--index", 0)
    assert res.exit_code == 0, res.output
    roles = re.findall(r"^--- (\w+)(?: \((\d+)/(\d+) tokens trained\))? ---$", res.stdout, flags=re.M)
    assert [r[0] for r in roles][:3] == ["system", "user", "assistant"]
    assert all(bool(r[1]) == (r[0] == "assistant") for r in roles)


def test_only_truncated_with_nothing_cut_says_so_and_exits_0(built):
    """No truncated sample is the good news --only truncated looks for (split, the default, cuts none), not an
    error; a selection that names a sample that is not there still is."""
    _, out = built
    shard_of = {}
    for s in read_shards(out).values():
        shard_of.setdefault(s["shard"], []).append(s["meta"]["truncated"])
    clean = sorted(name for name, cut in shard_of.items() if not any(cut))
    assert clean, "fixture must have a shard with no truncated sample"
    res = invoke(out, "--only", "truncated", "--shard", clean[0].removesuffix(".tar"))
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"no truncated sample in {out} {clean[0].removesuffix('.tar')}"
    assert invoke(out, "--only", "truncated", "--index", 999).exit_code == 1


def test_truncated_sample_shows_dropped_images(built):
    _, out = built
    ref = {k: s for k, s in read_shards(out).items() if s["meta"]["truncated"]}
    assert ref and any(s["meta"]["dropped_images"] for s in ref.values()), "fixture must truncate away an image"
    res = invoke(out, "--only", "truncated", "--limit", 100)
    assert res.exit_code == 0, res.output
    got = blocks(res.stdout)
    assert sorted(got) == sorted(ref)
    for key, s in ref.items():
        m = s["meta"]
        n = m["dropped_images"]
        assert (
            f"truncated: yes, {m['num_tokens_before_truncation']} -> {SEQ_LEN} tokens, "
            f"{n} image{'s' if n != 1 else ''} dropped by the cut"
        ) in got[key]


def strip_where(output):
    return re.sub(r"^(=== sample \d{10}  id .*)  \(.*\) ===$", r"\1", output, flags=re.M)


def test_raw_input_gives_the_same_view_as_the_built_shard(built):
    inp, out = built
    shard_view = invoke(out, "--limit", 100)
    raw_view = invoke(inp, "--like", out, "--limit", 100)
    assert shard_view.exit_code == 0 and raw_view.exit_code == 0, raw_view.output
    raw_lines = raw_view.stdout.splitlines(keepends=True)
    raw_samples = "".join(line for line in raw_lines if not line.startswith("rejected  "))
    assert "(rendered from input)" in raw_samples
    assert strip_where(raw_samples) == strip_where(shard_view.stdout)
    # Without --only, raw mode says inline which records build would reject.
    assert sum(line.startswith("rejected  ") for line in raw_lines) == 3
    # One record alone, selected by the position that is also its shard key.
    one_raw = invoke(
        inp,
        "--seq-len",
        SEQ_LEN,
        "--tool-calls",
        "train-content",
        "--long-traces",
        "truncate",
        "--index",
        4,
        "--tokens",
    )
    one_dir = invoke(out, "--index", 4, "--tokens")
    assert strip_where(one_raw.stdout) == strip_where(one_dir.stdout)


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_only_rejected_raw_input_matches_build_rejects(built):
    inp, out = built
    built_rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in built_rejects] == ["invalid_json", "no_assistant_turn", "duplicate_id"]
    raw = invoke(inp, "--like", out, "--only", "rejected", "--limit", 100)
    from_dir = invoke(out, "--only", "rejected", "--limit", 100)
    assert raw.exit_code == 0 and from_dir.exit_code == 0, raw.output
    expected = [
        f"rejected  {r['source']['file']}:{r['source']['line']}"
        + (f"  id {r['id']}" if r["id"] is not None else "")
        + f"  {r['reason']}: {r['message']}"
        for r in built_rejects
    ]
    assert raw.stdout.splitlines() == expected
    assert from_dir.stdout.splitlines() == expected


def test_tokens_table(built):
    _, out = built
    s = read_shards(out)["0000000000"]
    res = invoke(out, "--index", 0, "--tokens")
    assert res.exit_code == 0, res.output
    row = re.compile(r"^\s*\d+(-\d+)?\s+\d+\s+[01]\s")
    rows = [line.split(None, 4) for line in res.stdout.splitlines()[2:] if row.match(line)]
    units = [(a - 1, b + 1) for a, b in runs(s["mm_token_type_ids"] == 1)]  # with <|vision_start|>, <|vision_end|>
    assert units == [tuple(im["span"]) for im in s["meta"]["images"]]
    assert len(rows) == len(s["input_ids"]) - sum(b - a for a, b in units) + len(units)
    for idx, tid, mask, typ, _piece in rows:
        i = int(idx.split("-")[0])
        want = 1 if "-" in idx else s["mm_token_type_ids"][i]
        assert (int(tid), int(mask), int(typ)) == (s["input_ids"][i], s["loss_mask"][i], want)
    assert [r[0] for r in rows if r[3] == "1"] == [f"{a}-{b - 1}" for a, b in units]


def test_selection_by_id_and_shard(built):
    _, out = built
    ref = read_shards(out)
    by_id = invoke(out, "--id", JP_ID)
    assert list(blocks(by_id.stdout)) == [k for k, s in ref.items() if s["meta"]["id"] == JP_ID]
    in_shard = invoke(out, "--shard", "shard-000001", "--limit", 100)
    assert sorted(blocks(in_shard.stdout)) == sorted(k for k, s in ref.items() if s["shard"] == "shard-000001.tar")
    assert len(blocks(invoke(out).stdout)) == 3  # default limit


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--index", 999], "no sample in"),
        (["--shard", "shard-000099"], "no such shard"),
        (["--processor", "builtin:qwen2-vl"], "only for raw input"),
        (["--only", "everything"], "choose one of truncated, rejected"),
    ],
)
def test_user_errors_are_one_line(built, args, msg):
    _, out = built
    res = invoke(out, *args)
    assert res.exit_code == 1
    assert res.stderr.count("\n") == 1 and msg in res.stderr and res.stderr.startswith("error: ")


class _Boom:
    """Unpickling this creates a file: the proof that inspect never unpickles."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rewrite_first_shard(src, dst, edit):
    shutil.copytree(src, dst)
    tar = dst / "shard-000000.tar"
    with tarfile.open(tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(tar, "w") as tf:
        for name, data in edit(members):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def test_refuses_unexpected_members_and_pickles(built, tmp_path):
    _, out = built
    marker = tmp_path / "unpickled"
    buf = io.BytesIO()
    np.save(buf, np.array([_Boom(str(marker))], dtype=object), allow_pickle=True)
    evil = buf.getvalue()

    pickled = tmp_path / "pickled"
    _rewrite_first_shard(out, pickled, lambda ms: [(n, evil if n == "0000000000.input_ids.npy" else d) for n, d in ms])
    res = invoke(pickled, "--index", 0)
    assert res.exit_code == 1 and "refusing to unpickle" in res.stderr and "input_ids.npy" in res.stderr

    extra = tmp_path / "extra"
    _rewrite_first_shard(out, extra, lambda ms: ms[:1] + [("0000000000.state.pyd", evil)] + ms[1:])
    res = invoke(extra, "--limit", 100)
    assert res.exit_code == 1 and "0000000000.state.pyd" in res.stderr and "refusing" in res.stderr
    assert not marker.exists()


def test_rich_terminal_view_colours_trained_tokens(built):
    from rich.console import Console

    from vlmprep.tools.inspector import InspectConfig, run_inspect

    _, out = built
    buf = io.StringIO()
    run_inspect(
        InspectConfig(path=str(out), id=JP_ID),
        console=Console(file=buf, force_terminal=True, width=200, color_system="standard"),
    )
    text = buf.getvalue()
    assert "[T]" not in text
    assert re.search(r"\x1b\[30;42m" + re.escape(JP_ANSWER), text)  # trained: black on green
    assert "\x1b[2m" in text  # masked: dim


def test_segmentation_decodes_runs_not_tokens(qwen2vl_processor):
    """A 30k-token sample is decoded with one call per run of equal mask/type, whatever its length."""
    from vlmprep.tools.view import InspectedSample, TokenizerView, segment_sample

    tv = TokenizerView.from_processor(qwen2vl_processor)
    calls = []
    decode = tv._decode
    tv._decode = lambda ids: calls.append(len(ids)) or decode(ids)
    rng = np.random.default_rng(0)
    n = 30_000
    ids = rng.integers(100, 50_000, n).astype(np.int32)
    mask = np.zeros(n, np.uint8)
    mask[1000:9000] = mask[20000:29000] = 1
    types = np.zeros(n, np.uint8)
    ids[12000:12576] = 151655
    types[12000:12576] = 1
    sample = InspectedSample(
        key="0",
        id="x",
        source=("f", 1),
        where="t",
        input_ids=ids,
        loss_mask=mask,
        mm_token_type_ids=types,
        image_grid_thw=np.array([[1, 36, 64]]),
        images=[],
        num_tokens_before_truncation=n,
        truncated=False,
        dropped_images=0,
    )
    messages = segment_sample(sample, tv)
    segs = [seg for m in messages for seg in m.segments]
    assert len(calls) == 6 and sum(calls) == n - 576  # 6 text runs around 2 trained runs and 1 image
    assert [seg.text for seg in segs if seg.kind == "image"] == ["[image 1: 36x64 patches -> 576 tokens]"]
    assert [(seg.start, seg.end) for seg in segs if seg.trained] == [(1000, 9000), (20000, 29000)]


def test_only_rejected_on_a_dir_refuses_position_selectors(built):
    _, out = built
    res = invoke(out, "--only", "rejected", "--index", 7)
    assert res.exit_code == 1 and "rejects.jsonl" in res.stderr


def test_id_and_index_are_found_through_the_sample_index_without_scanning_shards(built, monkeypatch):
    """--id / --index read the shards' sample index files and then only the samples they select."""
    import vlmprep.tools.inspector as inspector

    _, out = built
    ref = read_shards(out)
    want = {k: s for k, s in ref.items() if s["meta"]["id"] == JP_ID}

    def no_scan(*a, **kw):
        raise AssertionError("inspect scanned a shard")

    monkeypatch.setattr(inspector, "iter_shard", no_scan)
    assert list(blocks(invoke(out, "--id", JP_ID).stdout)) == list(want)
    position = int(next(iter(want))[:10])
    by_index = invoke(out, "--index", position, "--limit", 100)
    assert list(blocks(by_index.stdout)) == sorted(k for k in ref if int(k[:10]) == position)
    assert invoke(out, "--id", "no-such-id").exit_code == 1


def test_html_collapses_the_system_prompt_and_tool_list(built, tmp_path):
    """In the HTML report each sample opens on its conversation: the system message, which holds the tool list under
    the tool template, is a closed <details> (one click shows it); no other message is collapsed."""
    from tests.vlmprep.conftest import TOOLS

    inp, _ = built
    page = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["inspect", str(inp), "--chat-template", TOOLS, "--limit", "2", "--html", str(page)])
    assert res.exit_code == 0, res.output
    sections = page.read_text(encoding="utf-8").split('<section class="sample"')[1:]
    assert len(sections) == 2
    for s in sections:
        assert s.count("<details") == s.count('data-role="system"') == 1
        assert '<details class="msg" data-role="system"><summary class="role">--- system --- <small>' in s
        folded = s[s.index("<details") : s.index("</details>")]
        assert "&lt;tools&gt;" in re.sub(r"<[^>]+>", "", folded) and "click to show" in folded  # the tool list
        assert " open" not in s[s.index("<details") : s.index("<summary")]  # closed by default
        assert s.index("</details>") < s.index('data-role="user"')  # the conversation follows, open


LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}"


def test_like_never_renders_a_datasets_own_template(built, tmp_path):
    """--like DIR takes DIR's saved processor, not Jinja that came with the dataset: a template nested to 10^10
    steps (it would hang the render) is refused in one line; the user may name the template it was built with."""
    inp, out = built
    foreign = tmp_path / "foreign"
    shutil.copytree(out, foreign)
    (foreign / "processor" / "chat_template.jinja").write_text(LOOPING_TEMPLATE)
    res = invoke(inp, "--like", foreign, "--index", 0)
    assert res.exit_code != 0 and "its saved chat template is not one vlmprep ships" in res.output, res.output
    assert "--chat-template" in res.output and "Traceback" not in res.output
    named = invoke(inp, "--like", foreign, "--index", 0, "--chat-template", "qwen2_vl")
    assert named.exit_code == 0, named.output
    mine = invoke(inp, "--like", out, "--index", 0)  # vlmprep's own template: rendered as before
    assert mine.exit_code == 0 and strip_where(mine.stdout) == strip_where(named.stdout)


def _family_names():
    from vlmprep.processors.tiny import tiny_names

    return tiny_names()


@pytest.mark.parametrize("name", _family_names())
def test_every_familys_turns_each_get_their_own_header(name, tmp_path):
    """A record (an image and a question, an answer, a question, an answer) inspected with each family's tiny
    processor: one `--- role ---` header per turn, in order (a leading header-less run of special tokens, the BOS, and
    a system message the template adds aside), each turn's text under its own header, the trained tokens under the
    assistant's (Gemma's `model`). SmolVLM's turns open with no token of their own (`User:` after the previous turn's
    `<end_of_utterance>`): all four were under one header before."""
    from PIL import Image

    Image.new("RGB", (64, 64), (200, 10, 10)).save(tmp_path / "red.png")
    image = {"type": "image_url", "image_url": {"url": "red.png"}}
    msgs = [
        {"role": "user", "content": [image, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "r", "messages": msgs}) + "\n")
    res = invoke(tmp_path / "r.jsonl", "--processor", f"tiny:{name}")
    assert res.exit_code == 0 and "rejected" not in res.stdout, res.output
    parts = re.split(r"^--- (.+?)(?: \((\d+)/\d+ tokens trained\))? ---$", res.stdout, flags=re.M)
    turns = [(role, int(trained or 0), body) for role, trained, body in zip(parts[1::3], parts[2::3], parts[3::3])]
    if turns[0][0] == "(no turn header)":
        assert not re.sub(r"<[^<>]*>|\[[^\[\]]*\]|\s", "", turns[0][2]), turns[0]  # special tokens only
        turns = turns[1:]
    turns = [t for t in turns if t[0].lower() != "system"]
    roles = [{"model": "assistant"}.get(r.lower(), r.lower()) for r, _, _ in turns]
    assert roles == ["user", "assistant", "user", "assistant"], res.stdout
    for (role, trained, body), text, other in zip(
        turns, ["What colour?", "Red.", "Sure?", "Yes."], ["Red.", "Sure?", "Yes.", "What"]
    ):
        assert text in body and other not in body, (role, body)
        # the assistant's turn trains; a user turn at most the one token that also closes the answer before it (GLM)
        assert trained > 0 if roles[turns.index((role, trained, body))] == "assistant" else trained <= 1, (role, body)
