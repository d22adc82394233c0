"""BuildConfig's field declarations are the one source of `vlmprep build` / `vlmprep inspect` options."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from vlmprep.cli import PER_VERSION_HELP, app
from vlmprep.config import FIELDS, PER_VERSION, RAW_OPTIONS, REQUIRED, BuildConfig
from vlmprep.options import GROUPS
from vlmprep.render.sample import MaskPolicy

LIBRARY_ONLY = {"zstd_level"}  # fields with no flag: adding one is a conscious choice


def _options(command: str) -> dict:
    cmd = typer.main.get_command(app).commands[command]
    return {p.name: p for p in cmd.params if p.param_type_name == "option"}


def test_every_build_option_has_help_and_a_flag_with_the_config_default():
    build = _options("build")
    for name, f in FIELDS.items():
        m = f.metadata
        assert m.get("help"), f"BuildConfig.{name} has no help text: declare it with opt(default, group, help)"
        if name in LIBRARY_ONLY:
            assert m["group"] is None and name not in build
            continue
        assert m["group"] in GROUPS and name in build, f"BuildConfig.{name} is not a `vlmprep build` flag"
        p = build[name]
        assert p.opts == [m["flag"] or "--" + name.replace("_", "-")]
        # the options an append may set its own way say so (docs/datasets-that-grow.md)
        assert (
            p.help == m["help"] + (PER_VERSION_HELP if name in PER_VERSION else "") and p.rich_help_panel == m["group"]
        )
        if f.default is not REQUIRED:
            assert p.default == (m["spelled"] or f.default), name
    assert set(build) == set(FIELDS) - LIBRARY_ONLY


def test_cli_defaults_build_the_library_defaults(tmp_path):
    """Parsing `--out D --in F` alone yields BuildConfig's own defaults (spelled options parsed back)."""
    from vlmprep.cli import _config_values

    cmd = typer.main.get_command(app).commands["build"]
    ctx = cmd.make_context("build", ["--out", str(tmp_path / "d"), "--in", "x.jsonl"])
    values = _config_values(ctx.params, FIELDS.keys() & ctx.params.keys())
    got = BuildConfig(**{**values, "inputs": tuple(values["inputs"]), "out": str(values["out"])})
    want = BuildConfig(inputs=("x.jsonl",), out=str(tmp_path / "d"))
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_inspect_takes_the_raw_options_as_not_given_by_default():
    inspect = _options("inspect")
    build = _options("build")
    for name in RAW_OPTIONS:
        assert inspect[name].default is None, f"inspect --{name} must default to not given (None)"
        assert inspect[name].help == build[name].help.removesuffix(PER_VERSION_HELP)
        assert inspect[name].opts == build[name].opts
    assert set(build) & set(inspect) == set(RAW_OPTIONS)


@pytest.mark.parametrize("field,value", [("train_on_eos", "every"), ("tool_calls", "train"), ("reasoning", "keep")])
def test_mask_policy_choices_are_checked_once_with_one_message(field, value):
    with pytest.raises(ValueError) as lib:
        MaskPolicy(**{field: value})
    with pytest.raises(ValueError) as cfg:
        BuildConfig(inputs=("x",), out="o", **{field: value})
    assert str(lib.value) == str(cfg.value) and str(cfg.value).startswith(f"{field}={value!r}: choose one of")
