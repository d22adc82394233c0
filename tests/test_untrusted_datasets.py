"""A dataset from elsewhere cannot reach outside itself (docs/untrusted-datasets.md): the three unsafe cases of
issue 32 through every reader, with nothing outside the dataset opened (a Python audit hook watches every open()) and
nothing from it run; plus the boundary's rule on literal names. `trainer export` has its cases in
tests/trainer/test_export.py (they reuse its trained run)."""

import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

_WATCHED: list[tuple[str, list[str]]] = []  # (dir, opened paths under it) while a `watch` block runs


def _audit(event, args):
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, Path)):
        path = str(Path(args[0].decode() if isinstance(args[0], bytes) else args[0]).resolve())
        for top, seen in _WATCHED:
            if path == top or path.startswith(top + "/"):
                seen.append(path)


sys.addaudithook(_audit)  # hooks cannot be removed: it records only inside `watch`


@contextmanager
def watch(outside: Path):
    """Yields the list of files under `outside` that Python opened inside the block (it must stay empty)."""
    seen: list[str] = []
    _WATCHED.append((str(outside.resolve()), seen))
    try:
        yield seen
    finally:
        _WATCHED.pop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """4 records with small screenshots, 2 shards, built with builtin:qwen2-vl."""
    from scripts.demo_traces import write_traces
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    tmp = tmp_path_factory.mktemp("untrusted")
    write_traces(
        tmp / "t.jsonl.zst",
        n=4,
        seed=5,
        min_images=1,
        max_images=1,
        width=160,
        height=96,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    build(
        BuildConfig(
            inputs=(str(tmp / "t.jsonl.zst"),),
            out=str(tmp / "ds"),
            processor="builtin:qwen2-vl",
            seq_len=2048,
            samples_per_shard=2,
            progress=False,
            tool_calls="train-content",
        )
    )
    return tmp / "ds"


def _copy(dataset: Path, tmp_path: Path, edit=None) -> Path:
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    if edit is not None:
        m = json.loads((ds / "manifest.json").read_text())
        edit(m)
        (ds / "manifest.json").write_text(json.dumps(m))
    return ds


def _one_line(e: BaseException, *must: str) -> str:
    text = str(e)
    assert "\n" not in text and all(m in text for m in must), text
    return text


def _verify_fails(ds: Path, *must: str) -> None:
    from vlmprep.cli import app

    res = CliRunner().invoke(app, ["verify", str(ds)])
    assert res.exit_code == 1 and "OK" not in res.output and all(m in res.output for m in must), res.output


def _trainer_refuses(ds: Path, tmp_path: Path, capsys, *must: str) -> None:
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                str(ds),
                "--out",
                str(tmp_path / "run"),
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "1",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 1
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("trainer: error: ") and all(m in err[0] for m in must), err


# --- 1. A manifest that names its processor by an absolute path anywhere on the machine ---


@pytest.fixture
def absolute_processor(dataset, tmp_path):
    """The dataset's processor moved outside, next to a private key, and the manifest pointing there."""
    keys = tmp_path / "home" / "keys"
    shutil.copytree(dataset / "processor", keys)
    (keys / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    ds = _copy(dataset, tmp_path, lambda m: m["processor"].update(dir=str(keys)))
    shutil.rmtree(ds / "processor")
    return ds, keys


def test_an_absolute_processor_dir_is_refused_by_every_reader(absolute_processor, tmp_path, capsys):
    from trainer.data.errors import DataError
    from trainer.data.sources import resolve_data
    from vlmprep.clients.collate import Collator
    from vlmprep.shards.reader import ShardFormatError
    from vlmprep.tools.inspector import InspectConfig, select
    from vlmprep.tools.stats import compute_stats

    ds, keys = absolute_processor
    must = (str(ds / "manifest.json"), "processor dir", repr(str(keys)))
    with watch(keys) as opened:
        _verify_fails(ds, *must)
        with pytest.raises(DataError) as e:
            resolve_data(str(ds))
        _one_line(e.value, *must)
        _trainer_refuses(ds, tmp_path, capsys, *must)
        for read in (lambda: Collator(ds), lambda: compute_stats(ds), lambda: select(InspectConfig(path=str(ds)))):
            with pytest.raises(ShardFormatError) as e:
                read()
            _one_line(e.value, *must)
    assert opened == []


# --- 2. A saved processor that asks for custom code (auto_map) ---

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import Qwen2VLProcessor as EvilProcessor\n"


def _plant_custom_code(proc: Path, marker: Path, where: str) -> None:
    """A module that would write `marker` when imported, and `where` (a config file) naming it in auto_map, with
    no processor_class transformers knows, so transformers would ask "run custom code? [y/N]"."""
    (proc / "evil.py").write_text(EVIL.format(marker=str(marker)))
    name, _, nested = where.partition(":")
    path = proc / name
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg.pop("processor_class", None)
    (cfg.setdefault(nested, {}) if nested else cfg)["auto_map"] = {
        "AutoProcessor": "evil.EvilProcessor",
        "AutoImageProcessor": "evil.EvilProcessor",
    }
    path.write_text(json.dumps(cfg))
    tok = json.loads((proc / "tokenizer_config.json").read_text())
    tok.pop("processor_class", None)
    (proc / "tokenizer_config.json").write_text(json.dumps(tok))


@pytest.fixture
def no_prompt(monkeypatch):
    """Answers "y" to any prompt (so without the boundary the dataset's code would run) and records that one came."""
    prompts = []

    def answer(text=""):
        prompts.append(text)
        return "y"

    monkeypatch.setattr("builtins.input", answer)
    return prompts


@pytest.mark.parametrize(
    "where",
    [
        "processor_config.json",
        "processor_config.json:image_processor",
        "tokenizer_config.json",
        "preprocessor_config.json",
    ],
)
def test_custom_code_in_a_saved_processor_is_refused_before_transformers_sees_it(dataset, tmp_path, where, no_prompt):
    from vlmprep.clients.collate import Collator
    from vlmprep.processors.load import load_saved_processor
    from vlmprep.shards.reader import ShardFormatError

    ds, marker = _copy(dataset, tmp_path), tmp_path / "ran"
    _plant_custom_code(ds / "processor", marker, where)
    file = str(ds / "processor" / where.partition(":")[0])
    with pytest.raises(ValueError) as e:  # the processor dir named directly: refused when it loads
        _ = Collator(ds / "processor").processor
    _one_line(e.value, file, "custom code", "auto_map")
    with pytest.raises(ValueError) as e:
        load_saved_processor(ds / "processor")
    _one_line(e.value, file, "custom code")
    with pytest.raises(ShardFormatError) as e:  # the dataset dir: refused as it opens
        Collator(ds)
    _one_line(e.value, file, "custom code")
    assert no_prompt == [] and not marker.exists()


def test_custom_code_in_a_datasets_processor_is_refused_by_the_trainer_and_verify(dataset, tmp_path, capsys, no_prompt):
    from trainer.data.errors import DataError
    from trainer.data.sources import resolve_data

    ds, marker = _copy(dataset, tmp_path), tmp_path / "ran"
    _plant_custom_code(ds / "processor", marker, "processor_config.json")
    must = (str(ds / "processor" / "processor_config.json"), "custom code")
    with pytest.raises(DataError) as e:
        resolve_data(str(ds))
    _one_line(e.value, *must)
    _trainer_refuses(ds, tmp_path, capsys, *must)
    _verify_fails(ds, *must)
    assert no_prompt == [] and not marker.exists()


def test_the_trainer_refuses_custom_code_in_a_processor_the_user_names(dataset, tmp_path, capsys, no_prompt):
    from trainer.train import main

    proc, marker = tmp_path / "proc", tmp_path / "ran"
    shutil.copytree(dataset / "processor", proc)
    _plant_custom_code(proc, marker, "processor_config.json:image_processor")
    assert (
        main(
            [
                "--data",
                str(dataset),
                "--processor",
                str(proc),
                "--out",
                str(tmp_path / "run"),
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "1",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "custom code" in err[0] and str(proc / "processor_config.json") in err[0], err
    assert no_prompt == [] and not marker.exists()


# --- 3. A manifest shard name that leads out of the dataset ---


def _shard_outside(kind: str):
    def plant(dataset: Path, tmp_path: Path) -> tuple[Path, Path]:
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        shutil.copy(dataset / "shard-000000.tar", outside / "shard-000000.tar")
        name = {
            "dotdot": "../elsewhere/shard-000000.tar",
            "absolute": str(outside / "shard-000000.tar"),
            "symlink": "shard-000000.tar",
        }[kind]
        ds = _copy(dataset, tmp_path, lambda m: m["shards"][0].update(name=name))
        if kind == "symlink":  # a plain name in the manifest, a symlink out on disk
            (ds / "shard-000000.tar").unlink()
            (ds / "shard-000000.tar").symlink_to(outside / "shard-000000.tar")
        return ds, outside

    return plant


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_a_shard_outside_the_dataset_is_refused_by_every_client(dataset, tmp_path, kind):
    import vlmprep.clients.hf
    import vlmprep.clients.wds
    from trainer.data.errors import DataError
    from trainer.data.sources import resolve_data
    from vlmprep.clients.collate import Collator
    from vlmprep.shards.reader import ShardFormatError

    ds, outside = _shard_outside(kind)(dataset, tmp_path)
    must = (str(ds / "manifest.json"), "shard name")
    with watch(outside) as opened:
        for read in (
            lambda: vlmprep.clients.wds.shard_urls(ds),
            lambda: vlmprep.clients.hf.iterable_dataset(ds),
            lambda: Collator(ds),
        ):
            with pytest.raises(ShardFormatError) as e:
                read()
            _one_line(e.value, *must)
        with pytest.raises(DataError) as e:
            resolve_data(str(ds))
        _one_line(e.value, *must)
        _verify_fails(ds, "shard")
    assert opened == []


def test_a_fixed_file_linking_out_is_refused(dataset, tmp_path):
    """manifest.json and rejects.jsonl are read by their fixed names: a symlink out of the dataset is refused too."""
    from trainer.data.errors import DataError
    from trainer.data.sources import resolve_data
    from vlmprep.shards.reader import ShardFormatError, load_manifest
    from vlmprep.tools.inspector import InspectConfig, select
    from vlmprep.tools.stats import compute_stats

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret").write_text('{"reason": "-----BEGIN OPENSSH PRIVATE KEY-----"}\n')
    ds = _copy(dataset, tmp_path)
    (ds / "rejects.jsonl").unlink(missing_ok=True)
    (ds / "rejects.jsonl").symlink_to(outside / "secret")
    with watch(outside) as opened:
        for read in (lambda: compute_stats(ds), lambda: select(InspectConfig(path=str(ds), only="rejected"))):
            with pytest.raises(ShardFormatError) as e:
                read()
            _one_line(e.value, "'rejects.jsonl'", "outside the dataset")
        shutil.move(ds / "manifest.json", outside / "manifest.json")
        (ds / "manifest.json").symlink_to(outside / "manifest.json")
        with pytest.raises(ShardFormatError) as e:
            load_manifest(ds)
        _one_line(e.value, "'manifest.json'", "outside the dataset")
        with pytest.raises(DataError) as e:
            resolve_data(str(ds))
        _one_line(e.value, "'manifest.json'", "outside the dataset")
    assert opened == []


def test_energon_refuses_a_shard_outside_the_dataset(dataset, tmp_path):
    """prepare() checks the manifest first; energon's own loader refuses an index (.nv-meta) that names a shard the
    manifest does not list, e.g. `../` (energon joins such a name as given)."""
    pytest.importorskip("megatron.energon")
    from megatron.energon import WorkerConfig, get_train_dataset

    from vlmprep.clients.energon import prepare
    from vlmprep.shards.reader import ShardFormatError

    ds, outside = _shard_outside("dotdot")(dataset, tmp_path)
    with watch(outside) as opened, pytest.raises(ShardFormatError) as e:
        prepare(ds)
    _one_line(e.value, str(ds / "manifest.json"), "../elsewhere/shard-000000.tar")
    assert opened == []
    clean = tmp_path / "clean"
    shutil.copytree(dataset, clean)
    assert prepare(clean) == 4
    info = json.loads((clean / ".nv-meta" / ".info.json").read_text())
    info["shard_counts"] = {"../elsewhere/shard-000000.tar": 2, "shard-000001.tar": 2}
    (clean / ".nv-meta" / ".info.json").write_text(json.dumps(info))
    (clean / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n  - ../elsewhere/shard-000000.tar\n  - shard-000001.tar\n  val: []\n  test: []\n"
        "exclude: []\n"
    )
    with watch(outside) as opened, pytest.raises(ShardFormatError) as e:
        get_train_dataset(
            str(clean),
            batch_size=1,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        )
    _one_line(e.value, ".nv-meta", "'../elsewhere/shard-000000.tar'", str(clean / "manifest.json"), "prepare")
    assert opened == []


def test_energon_prepare_rewrites_a_foreign_dataset_yaml(dataset, tmp_path):
    """energon imports the class DIR/.nv-meta/dataset.yaml names: prepare() puts vlmprep's own back first."""
    pytest.importorskip("megatron.energon")
    from vlmprep.clients.energon import prepare
    from vlmprep.clients.energon_meta import DATASET_YAML

    ds = _copy(dataset, tmp_path)
    (ds / ".nv-meta" / "dataset.yaml").write_text("__module__: os\n__class__: system\n")
    assert prepare(ds) == 4
    assert (ds / ".nv-meta" / "dataset.yaml").read_text() == DATASET_YAML


# --- The rule itself, on literal names ---

from vlmprep_schemas.boundary import (  # noqa: E402 - imported here so the reader cases above run on any version
    UnsafeDataset,
    dataset_file,
    dataset_paths,
)
from vlmprep_schemas.processor_dir import processor_files, refuse_custom_code  # noqa: E402


@pytest.mark.parametrize("name", ["processor", "sub/processor", "shard-000000.tar", ".nv-meta", "a..b"])
def test_plain_relative_names_are_joined_to_the_base(tmp_path, name):
    assert dataset_file(str(tmp_path), name, where="m", what="x") == str(tmp_path.joinpath(*name.split("/")))
    assert dataset_file("https://h/d/", name, where="m", what="x") == f"https://h/d/{name}"


@pytest.mark.parametrize(
    "name",
    [
        "/etc",
        "../x",
        "a/../../x",
        "..",
        ".",
        "",
        "a//b",
        "a/",
        "https://evil/x",
        "%2e%2e/x",
        "a\\..\\b",
        "~/x",
        "a b",
        None,
        3,
        ["x"],
    ],
)
def test_names_that_could_leave_the_dataset_are_refused(tmp_path, name):
    for base in (str(tmp_path), "https://h/d"):
        with pytest.raises(UnsafeDataset, match=r"^m: x .* is not a relative path inside the dataset"):
            dataset_file(base, name, where="m", what="x")


def test_a_symlink_out_is_refused_and_one_inside_is_not(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "real.tar").write_bytes(b"")
    (tmp_path / "ds" / "in.tar").symlink_to("real.tar")
    (tmp_path / "ds" / "out.tar").symlink_to(tmp_path / "secret")
    (tmp_path / "ds" / "sub").symlink_to(tmp_path)  # a dir link out: anything under it is outside
    assert dataset_file(str(tmp_path / "ds"), "in.tar", where="m", what="x").endswith("in.tar")
    for name in ("out.tar", "sub/secret"):
        with pytest.raises(UnsafeDataset, match="outside the dataset"):
            dataset_file(str(tmp_path / "ds"), name, where="m", what="x")
    # The dataset dir itself may be a link: what counts is where it really is.
    (tmp_path / "link").symlink_to(tmp_path / "ds")
    assert dataset_file(str(tmp_path / "link"), "in.tar", where="m", what="x") == str(tmp_path / "link" / "in.tar")


def test_manifest_shapes_that_are_not_lists_of_names_are_refused(tmp_path):
    for manifest in (
        {},
        {"shards": "x.tar"},
        {"shards": ["x.tar"]},
        {"shards": [{"name": "sub/x.tar"}]},
        {"shards": [{"name": "x.json"}]},
        {"shards": [{}]},
        {"shards": [], "processor": {"dir": "/p"}},
    ):
        with pytest.raises(UnsafeDataset):
            dataset_paths(str(tmp_path), manifest, where="m")
    paths = dataset_paths("https://h/d", {"shards": [{"name": "a.tar"}], "processor": {"dir": "proc"}}, where="m")
    assert paths.shards == ("https://h/d/a.tar",) and paths.processor == "https://h/d/proc"


def test_processor_files_are_the_processors_own_and_stay_inside(dataset, tmp_path):
    proc = tmp_path / "proc"
    shutil.copytree(dataset / "processor", proc)
    (proc / "id_rsa").write_text("secret")
    (proc / "additional_chat_templates").mkdir()
    (proc / "additional_chat_templates" / "tools.jinja").write_text("{{ messages }}")
    assert sorted(str(f.relative_to(proc)) for f in processor_files(proc)) == [
        "additional_chat_templates/tools.jinja",
        "chat_template.jinja",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    (proc / "vocab.json").symlink_to(proc / "id_rsa")  # inside: fine
    assert proc / "vocab.json" in processor_files(proc)
    (proc / "merges.txt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeDataset, match="merges.txt: resolves to .* outside the processor dir"):
        processor_files(proc)


def test_refuse_custom_code_finds_auto_map_anywhere():
    refuse_custom_code({"auto_map": {}, "image_processor": {"auto_map": None}, "x": [1, {"y": 2}]}, "f")
    for cfg in (
        {"auto_map": {"AutoProcessor": "m.C"}},
        {"image_processor": {"auto_map": {"A": "m.C"}}},
        {"a": [{"b": [{"auto_map": ["m.C", None]}]}]},
    ):
        with pytest.raises(UnsafeDataset, match=r"^f: asks to run custom code \(auto_map "):
            refuse_custom_code(cfg, "f")


def test_dataset_paths_refuses_a_shard_or_sample_index_linking_out(tmp_path):
    """The manifest-wide check (one listing of the dir, then only its symlinks resolved) refuses what dataset_file
    refuses name by name: a shard, a shard's sample index or the dataset's sample index that links out."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (tmp_path / "secret").write_bytes(b"")
    (ds / "shard-000000.tar").write_bytes(b"")
    (ds / "shard-000001.tar").symlink_to("shard-000000.tar")  # inside: fine
    entries = [{"name": "shard-000000.tar"}, {"name": "shard-000001.tar"}]
    paths = dataset_paths(str(ds), {"shards": entries}, where="m")
    assert paths.shards == (str(ds / "shard-000000.tar"), str(ds / "shard-000001.tar")) and paths.sample_index is None
    for link, manifest in (
        ("shard-000002.tar", {"shards": [*entries, {"name": "shard-000002.tar"}]}),
        (
            "shard-000000.tar.index.npy",
            {"shards": [{"name": "shard-000000.tar", "index": {"name": "shard-000000.tar.index.npy"}}]},
        ),
        ("samples.index.npy", {"shards": entries, "sample_index": {"name": "samples.index.npy"}}),
    ):
        (ds / link).symlink_to(tmp_path / "secret")
        with pytest.raises(UnsafeDataset, match=f"{link}' resolves to .*secret, outside the dataset"):
            dataset_paths(str(ds), manifest, where="m")
        (ds / link).unlink()
    with pytest.raises(UnsafeDataset, match="the dataset's sample index '../x.index.npy' is not a plain"):
        dataset_paths(str(ds), {"shards": entries, "sample_index": {"name": "../x.index.npy"}}, where="m")


# --- A sample index file that claims more bytes than its samples take: refused before a byte of it is read ---


@pytest.mark.parametrize("which", ["sidecar", "sidecar grown", "dataset index"])
def test_an_index_file_larger_than_its_samples_is_refused_unread(dataset, tmp_path, which):
    """A 64 MiB index file (sparse) for a few samples, its manifest entry listing that size and its true sha256
    (an attacker can make both agree), or a sidecar grown past the size its manifest lists: the trainer and vlmprep's
    reader (inspect --id, verify) refuse it in one line from its size alone, allocating nothing like it."""
    import hashlib
    import tracemalloc

    from trainer.config import DataSpec
    from trainer.data.errors import DataError
    from trainer.data.pipeline import rank_sources
    from trainer.data.sources import plan_shards, resolve_data
    from vlmprep.shards.manifest import FileEntry, ShardEntry
    from vlmprep.shards.reader import ShardFormatError, load_sample_index, read_index_file

    big = 64 << 20
    ds = _copy(dataset, tmp_path)
    m = json.loads((ds / "manifest.json").read_text())
    if which == "dataset index":
        entry, rows = m["sample_index"], sum(s["num_samples"] for s in m["shards"])
    else:  # the trainer reads the sidecars where the manifest lists no dataset index
        (ds / m.pop("sample_index")["name"]).unlink()
        entry, rows = m["shards"][0]["index"], m["shards"][0]["num_samples"]
    path = ds / entry["name"]
    with open(path, "r+b") as f:
        f.truncate(big)
    if which != "sidecar grown":
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        entry.update(bytes=big, sha256=h.hexdigest())
    (ds / "manifest.json").write_text(json.dumps(m))
    tracemalloc.start()
    try:
        data = resolve_data(str(ds))
        with pytest.raises(DataError) as e:
            rank_sources(
                (DataSpec(path=str(ds)),),
                [data],
                [plan_shards(data.shards, 1)],
                rank=0,
                world=1,
                cache=tmp_path / "cache",
            )
        _one_line(e.value, entry["name"], f"{big} bytes", "refusing to read it")
        with pytest.raises(ShardFormatError) as e:
            if which == "dataset index":
                read_index_file(path, FileEntry.from_json(entry), rows=rows)
            else:
                load_sample_index(ds, ShardEntry.from_json(m["shards"][0]))
        _one_line(e.value, entry["name"], f"{big} bytes", "refusing to read it")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated while refusing a {big}-byte index file"
    _verify_fails(ds, entry["name"])


# --- A manifest claiming more samples than its index files hold: refused before anything is sized by the claim ---


@pytest.mark.parametrize("claim", [10**12, 10**8])
@pytest.mark.parametrize("which", ["dataset index", "sidecar"])
def test_a_sample_count_the_index_does_not_hold_is_refused_before_allocating(dataset, tmp_path, claim, which):
    """Issue 44.7: a shard entry claiming 10^12 samples beside the dataset's 448-byte sample index made the trainer
    size the rows it reads by the claim (a 43.7 TiB allocation traceback; 10^8 reserved 4.8 GB before the refusal).
    The rows are now sized by the file: the claim is one line naming the index file, under an address-space limit
    far below either; the shard's own sidecar (no dataset index) and `vlmprep verify` say so in one line too."""
    from tests.support.hostile import address_space
    from trainer.config import DataSpec
    from trainer.data.errors import DataError
    from trainer.data.pipeline import rank_sources
    from trainer.data.sources import plan_shards, resolve_data

    def claim_more(m):
        m["shards"][0]["num_samples"] = claim
        if which == "sidecar":  # the trainer then reads each shard's own sidecar
            (tmp_path / "ds" / m.pop("sample_index")["name"]).unlink()

    ds = _copy(dataset, tmp_path, claim_more)
    m = json.loads((ds / "manifest.json").read_text())
    rows = sum(s["num_samples"] for s in m["shards"])
    data = resolve_data(str(ds))
    with address_space(256 << 20), pytest.raises(DataError) as e:
        rank_sources(
            (DataSpec(path=str(ds)),), [data], [plan_shards(data.shards, 1)], rank=0, world=1, cache=tmp_path / "cache"
        )
    if which == "dataset index":
        _one_line(e.value, "samples.index.npy", f"but the manifest's shards hold {rows} samples")
    else:
        _one_line(e.value, "shard-000000.tar.index.npy", f"rows for {claim} samples")
    _verify_fails(ds, "shard-000000.tar", f"manifest says {claim}")


@pytest.mark.parametrize(
    "field,value,said",
    [("num_tokens", 2**63, "past its maximum"), ("num_tokens", -1, "below its minimum 0"), ("bytes", 2**64, "past")],
)
def test_a_count_past_int64_in_the_manifest_is_one_line(dataset, tmp_path, field, value, said):
    """A shard entry's token or byte count that no column holds (past int64, or negative: JSON has no bound; the
    readers' fuzz found 2^63 tokens an OverflowError in the trainer's vectorized row check): one line naming the
    field, when the manifest is loaded (issue 53.6: the schema's bounds are checked with its types)."""
    from trainer.data.errors import DataError
    from trainer.data.sources import resolve_data
    from vlmprep.shards.manifest import ShardFormatError, load_manifest

    ds = _copy(dataset, tmp_path, lambda m: m["shards"][0].update({field: value}))
    with pytest.raises(DataError) as e:
        resolve_data(str(ds))
    _one_line(e.value, f"manifest.json does not match the manifest schema: shards[0].{field} is {value}", said)
    with pytest.raises(ShardFormatError) as e:
        load_manifest(ds)
    _one_line(e.value, f"shards[0].{field} is {value}", said)


def test_a_shard_size_of_minus_one_is_named_not_blamed_on_storage(dataset, tmp_path):
    """Before: `vlmprep verify URL` over a manifest listing a shard of -1 bytes said the shard was "more than -1
    bytes ... changed or damaged in storage"; the trainer's fetch would have said the same. Now every reader names
    the manifest's field, before anything is fetched."""
    import uuid

    import fsspec

    from vlmprep.cli import app

    ds = _copy(dataset, tmp_path, lambda m: m["shards"][0].update(bytes=-1))
    url = f"memory://minus-{uuid.uuid4().hex[:8]}/ds"
    for p in sorted(ds.rglob("*")):
        if p.is_file():
            fsspec.filesystem("memory").pipe_file(f"{url}/{p.relative_to(ds).as_posix()}", p.read_bytes())
    for target in (url, str(ds)):
        for command in ("verify", "stats", "inspect"):
            res = CliRunner().invoke(app, [command, target])
            assert res.exit_code == 1 and "storage" not in res.output, res.output
            assert (
                "shards[0].bytes is -1, below its minimum 0"
                in res.output.splitlines()[-1 if command != "verify" else 0]
            )


def test_a_task_manifest_listing_a_shard_of_minus_one_bytes_is_named(dataset, tmp_path):
    """The same in a task manifest (which merge reads): the field is named, not the shard called changed since."""
    from vlmprep.builder.pipeline import merge
    from vlmprep.shards.manifest import ShardFormatError

    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    task = ds / "tasks" / "task-00000.json"
    m = json.loads(task.read_text())
    m["shards"][0]["bytes"] = -1
    task.write_text(json.dumps(m))
    with pytest.raises(ShardFormatError) as e:
        merge(ds)
    _one_line(e.value, "task-00000.json: shards[0].bytes is -1, below its minimum 0")
    assert "changed" not in str(e.value)


@pytest.mark.parametrize("field", ["line", "unread_bytes"])
def test_a_reject_numbered_past_int64_is_one_line(dataset, tmp_path, field):
    """Before: `stats --rejects FILE` over a reject of line 10^30 ended in an OverflowError traceback."""
    from vlmprep.cli import app

    ds = _copy(dataset, tmp_path)
    line = {"id": "x", "reason": "invalid_json", "message": "m", "source": {"file": "t.jsonl", "line": 3}}
    if field == "line":
        line["source"]["line"] = 10**30
    else:
        line["unread_bytes"] = 10**30
    (ds / "rejects.jsonl").write_text(json.dumps(line) + "\n")
    for args in (
        ["stats", str(ds), "--rejects", str(tmp_path / "r.parquet")],
        ["inspect", str(ds), "--only", "rejected"],
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 1 and not isinstance(res.exception, OverflowError), res.output
        where = "source.line" if field == "line" else "unread_bytes"
        assert res.output.splitlines()[-1] == (
            f"error: rejects.jsonl line 1: {where} is past int64: not a reject vlmprep wrote"
        ), res.output


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_dir_or_fifo_in_a_shards_place_is_named_as_such_not_missing_or_truncated(dataset, tmp_path, capsys, kind):
    """Before: verify called a directory "missing" and the trainer called a FIFO "truncated"."""
    import os

    ds = _copy(dataset, tmp_path)
    shard = ds / "shard-000001.tar"
    shard.unlink()
    shard.mkdir() if kind == "directory" else os.mkfifo(shard)
    _verify_fails(ds, "shard-000001.tar: not a plain file (a directory, FIFO or device)")
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                str(ds),
                "--out",
                str(tmp_path / "run"),
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "1",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
            ]
        )
        == 1
    )
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trainer: error")]
    assert (
        len(err) == 1
        and f"shard-000001.tar: listed in its manifest as a shard, but it is not a plain file (a {kind})" in err[0]
    ), err
