import re
import tomllib

import pytest

from trainer.cli import load_toml, parse_args
from trainer.config import ConfigError, TrainConfig


def test_toml_then_cli_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('data = "shards"\ntiny_random = "qwen2-vl"\nlr = 1\nmicro_batch_size = 4\nshuffle_shards = false\n')
    cfg = parse_args(
        ["--config", str(p), "--micro-batch-size", "2", "--max-steps", "7", "--pack-to", "8192", "--pack-window", "32"]
    )
    assert (cfg.data, cfg.lr, cfg.micro_batch_size, cfg.max_steps, cfg.shuffle_shards) == ("shards", 1.0, 2, 7, False)
    assert (cfg.pack_to, cfg.pack_window) == (8192, 32)
    assert isinstance(cfg.lr, float)


def test_unknown_toml_key_is_an_error(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('data = "x"\nlearning_rate = 1e-4\n')
    with pytest.raises(ConfigError, match="unknown keys learning_rate"):
        load_toml(str(p))


def test_wrong_toml_type_is_an_error(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('data = "x"\nmax_steps = "ten"\n')
    with pytest.raises(ConfigError, match="max_steps = 'ten': expected int"):
        load_toml(str(p))


def test_unknown_cli_flag_is_one_line_naming_the_close_match(capsys):
    with pytest.raises(ConfigError, match="^unknown option --frobnicate: python -m trainer --help lists"):
        parse_args(["--data", "x", "--tiny-random", "qwen2-vl", "--frobnicate", "1"])
    with pytest.raises(ConfigError, match=r"^unknown option --max-step: did you mean --max-steps\?$"):
        parse_args(["--data", "x", "--tiny-random", "qwen2-vl", "--max-step", "2"])
    with pytest.raises(ConfigError, match=r"^unknown option --no-shufle: did you mean --no-shuffle\?$"):
        parse_args(["--data", "x", "--tiny-random", "qwen2-vl", "--no-shufle"])
    with pytest.raises(ConfigError, match="^unexpected argument 'junk'"):
        parse_args(["--data", "x", "--tiny-random", "qwen2-vl", "junk"])
    from trainer.train import main

    assert main(["--data", "x", "--tiny-random", "qwen2-vl", "--max-step", "2"]) == 1
    assert capsys.readouterr().err == "trainer: error: unknown option --max-step: did you mean --max-steps?\n"


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(), "exactly one of --model"),
        (dict(tiny_random="llama"), "tiny_random='llama'"),
        (dict(tiny_random="qwen2-vl", micro_batch_size=0), "micro_batch_size=0"),
        (dict(tiny_random="qwen2-vl", precision="fp16"), "precision='fp16'"),
        (dict(tiny_random="qwen2-vl", max_steps=-1), "max_steps=-1"),
        (dict(tiny_random="qwen2-vl", pack_to=-5), "pack_to=-5"),
        (dict(tiny_random="qwen2-vl", pack_to=4096, pack_window=0), "pack_window=0"),
        (dict(tiny_random="qwen2-vl", pack_to=4096, max_tokens_per_batch=8192), "pick one"),
        (
            dict(tiny_random="qwen2-vl", max_tokens_per_batch=10**20),
            "max_tokens_per_batch=10{20}: more tokens than any",
        ),
        (dict(tiny_random="qwen2-vl", pack_to=1 << 41), "pack_to=2199023255552: more tokens than any batch"),
    ],
)
def test_validation_names_the_bad_value(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        TrainConfig(data="x", **kw)


def test_resolved_config_round_trips_as_toml(tmp_path):
    cfg = TrainConfig(data="shards", tiny_random="qwen2-vl", lr=3e-4, activation_checkpointing=True)
    p = tmp_path / "config.toml"
    p.write_text(cfg.to_toml())
    assert tomllib.loads(p.read_text())["lr"] == 3e-4
    assert TrainConfig(**load_toml(str(p))) == cfg


def test_help_walk_every_option_has_help_a_group_and_a_default():
    """`python -m trainer --help` explains itself: every option (every TrainConfig field, also ones added later)
    has a one-line help text, sits in one of the groups, and shows its default (or says it is required)."""
    from trainer.cli import _parser
    from trainer.config import FIELDS, GROUPS

    ap = _parser()
    actions = {a.dest: a for a in ap._actions if a.dest != "help"}
    assert set(actions) == set(FIELDS) | {"config"}
    for dest, a in actions.items():
        text, flag = a.help or "", "--" + dest.replace("_", "-")
        assert text.strip() and not text.startswith(" ("), f"{flag} has no help text"
        assert "\n" not in text, f"{flag}: help is one line"
        assert "(default: " in text or "(required" in text, f"{flag}: help shows no default: {text!r}"
    groups = {g.title: [a.dest for a in g._group_actions] for g in ap._action_groups}
    for name, f in FIELDS.items():
        assert f.metadata.get("group") in GROUPS, f"{name}: declare it with opt(default, GROUP, HELP)"
        assert name in groups[f.metadata["group"]]
    formatted = ap.format_help()  # argparse expands %(default)s-style text without error
    assert "(default: 2e-05)" in formatted and "(required)" in formatted and "logging:" in formatted
    from trainer.plot import _parser as plot_parser

    for a in (a for a in plot_parser()._actions if a.dest != "help"):
        assert a.help and (a.required or "(default: " in a.help), f"plot {a.dest}: {a.help!r}"


def test_readme_options_table_is_the_declarations():
    """docs/trainer.md's options table is generated from the same declarations as --help (regenerate it with
    trainer.cli.options_table())."""
    from tests.trainer.conftest import ROOT
    from trainer.cli import options_table
    from trainer.config import FIELDS

    text = (ROOT / "docs" / "trainer.md").read_text(encoding="utf-8")
    begin, end = "<!-- trainer-options: begin -->\n", "<!-- trainer-options: end -->"
    assert begin in text and end in text, "docs/trainer.md lost its trainer options table markers"
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == options_table(), "docs/trainer.md options table is stale: paste trainer.cli.options_table()"
    assert len(table.splitlines()) == 2 + len(FIELDS)


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_tensorboard_default_follows_the_installed_package():
    """Without the tensorboard package the default turns off; asking for it explicitly is one line and exit 1."""
    import subprocess
    import sys

    from tests.trainer.conftest import ROOT, trainer_env

    hide = "import sys; sys.modules['tensorboard'] = None; "
    probe = hide + (
        "from trainer.config import TrainConfig; print(TrainConfig(data='x', tiny_random='qwen2-vl').tensorboard)"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=trainer_env(), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    ask = hide + (
        "from trainer.train import main; sys.exit(main(['--data', 'x', '--tiny-random', 'qwen2-vl', '--tensorboard']))"
    )
    r = subprocess.run([sys.executable, "-c", ask], cwd=ROOT, env=trainer_env(), capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        "trainer: error: tensorboard=true but the tensorboard package is not "
        "installed: pip install 'vlmprep[tb]', or pass --no-tensorboard"
    ]
    assert TrainConfig(data="x", tiny_random="qwen2-vl").tensorboard  # installed here (the dev extra)


@pytest.mark.parametrize(
    "weight, msg",
    [
        (0.0, "weight=0.0 must be a finite number > 0"),
        (-1.0, "weight=-1.0"),
        (float("nan"), "weight=nan"),
        (float("inf"), "weight=inf"),
        (1e-310, "weight=1e-310 must be a finite number > 0 (not below 2.23e-308)"),
        (5e-324, "weight=5e-324"),
        ("0.5", "weight='0.5'"),
        (True, "weight=True"),
    ],
)
def test_a_mixture_weight_must_be_a_finite_normal_positive_number(weight, msg):
    """A subnormal weight (1e-310) is refused like 0 and nan: the order's token / weight clocks would overflow."""
    with pytest.raises(ConfigError, match=re.escape(msg)):
        TrainConfig(data=({"name": "a", "path": "x", "weight": weight}, "name=b,path=y"), tiny_random="qwen2-vl")
    if not isinstance(weight, str):  # the CLI's form: the text is parsed as a float first
        with pytest.raises(ConfigError, match="weight"):
            TrainConfig(data=(f"name=a,path=x,weight={weight}", "name=b,path=y"), tiny_random="qwen2-vl")


def test_mixture_weights_on_scales_apart_are_refused():
    with pytest.raises(ConfigError, match=r"data weights span too wide a range \(a 1e-300 of a sum of 1e\+300\)"):
        TrainConfig(data=("name=a,path=x,weight=1e-300", "name=b,path=y,weight=1e300"), tiny_random="qwen2-vl")
    with pytest.raises(ConfigError, match="span too wide"):
        TrainConfig(data=("name=a,path=x,weight=1e308", "name=b,path=y,weight=1e308"), tiny_random="qwen2-vl")
    cfg = TrainConfig(data=("name=a,path=x,weight=1e-9", "name=b,path=y"), tiny_random="qwen2-vl")
    assert cfg.sources[0].weight == 1e-9  # valid here; trainer/data/steps.check_epoch_size judges the epoch it makes


@pytest.mark.parametrize(
    "data, msg",
    [
        (("name=,path=a", "name=b,path=b"), "data entry path=a: its name is empty"),
        (("name= ,path=a", "name=b,path=b"), "data entry path=a: its name is empty"),
        (("name=,path=a",), "data entry path=a: its name is empty"),
        (({"name": "", "path": "a"}, {"name": "b", "path": "b"}), "data entry path=a: its name is empty"),
        (("name=a,path=a", "path=b"), "data entry path=b has no name: several datasets need a name each"),
        (({"path": "a"}, {"name": "b", "path": "b"}), "data entry path=a has no name"),
        (("name=a,path=a", "name=a,path=b"), "dataset name 'a' is given 2 times: several datasets need distinct names"),
        (("name=a b,path=a", "name=b,path=b"), "dataset name 'a b': letters, digits"),
    ],
)
def test_dataset_names_that_are_empty_missing_or_repeated_get_their_own_reason(data, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        TrainConfig(data=data, tiny_random="qwen2-vl")
    if len(data) > 1:
        # The same for eval sets (a missing name is found by the config, which names the option).
        with pytest.raises(
            ConfigError, match=re.escape(re.sub(r"^data entry (\S+) has", r"eval_data entry \1 has", msg))
        ):
            TrainConfig(data="d", eval_data=data, tiny_random="qwen2-vl")
