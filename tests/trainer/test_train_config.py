import tomllib

import pytest

from trainer.config import ConfigError, TrainConfig, load_toml, parse_args


def test_toml_then_cli_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('data = "shards"\ntiny_random = "qwen2-vl"\nlr = 1\nmicro_batch_size = 4\nshuffle_shards = false\n')
    cfg = parse_args(["--config", str(p), "--micro-batch-size", "2", "--max-steps", "7", "--pack-to", "8192",
                      "--pack-window", "32"])
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


def test_unknown_cli_flag_exits():
    with pytest.raises(SystemExit):
        parse_args(["--data", "x", "--tiny-random", "qwen2-vl", "--no-such-flag", "1"])


@pytest.mark.parametrize("kw, msg", [
    (dict(), "exactly one of --model"),
    (dict(tiny_random="llama"), "tiny_random='llama'"),
    (dict(tiny_random="qwen2-vl", micro_batch_size=0), "micro_batch_size=0"),
    (dict(tiny_random="qwen2-vl", precision="fp16"), "precision='fp16'"),
    (dict(tiny_random="qwen2-vl", max_steps=-1), "max_steps=-1"),
    (dict(tiny_random="qwen2-vl", pack_to=-5), "pack_to=-5"),
    (dict(tiny_random="qwen2-vl", pack_to=4096, pack_window=0), "pack_window=0"),
    (dict(tiny_random="qwen2-vl", pack_to=4096, max_tokens_per_batch=8192), "pick one"),
])
def test_validation_names_the_bad_value(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        TrainConfig(data="x", **kw)


def test_resolved_config_round_trips_as_toml(tmp_path):
    cfg = TrainConfig(data="shards", tiny_random="qwen2-vl", lr=3e-4, activation_checkpointing=True)
    p = tmp_path / "config.toml"
    p.write_text(cfg.to_toml())
    assert tomllib.loads(p.read_text())["lr"] == 3e-4
    assert TrainConfig(**load_toml(str(p))) == cfg
