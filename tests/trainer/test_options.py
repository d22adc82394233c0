"""Options in the trainer's code: each default is declared once, on its TrainConfig field (every library default that
stands for an option equals that declaration), and options travel as groups, so no function takes more than 8
parameters."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import trainer
from trainer import options
from trainer.config import FIELDS, TrainConfig, cache_limit_bytes
from trainer.options import Batching, Checkpointing, DataOptions, ModelOptions, Optimization, OptionGroup, RunLength

# Parameters that carry an option under a library name: (qualified name, parameter) -> (option, the option's value
# as the parameter reads it).
ALIASES = {
    ("ShardCache.__init__", "limit"): ("shard_cache_limit", cache_limit_bytes),
    ("ShardCache.__init__", "prefetch"): ("shard_prefetch", None),
    ("ShardCheck.__init__", "enabled"): ("verify_shards", None),
    ("ExportConfig", "dtype"): ("export_dtype", None),
}
# Parameters named like an option that mean something else.
UNRELATED = {("plot_run", "out"): "the PNG's path (the run dir is plot_run's first argument)"}
MAX_PARAMETERS = 8  # self and cls not counted


def _defaults(where: str, fn) -> list[tuple[str, str, object]]:
    return [
        (where, p.name, p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    ]


def library_defaults(module) -> list[tuple[str, str, object]]:
    """(where, name, default) of every defaulted parameter and dataclass field defined in `module`, TrainConfig's
    own fields aside."""
    out = []
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__ or obj is TrainConfig:
            continue
        if inspect.isfunction(obj):
            out += _defaults(name, obj)
        elif inspect.isclass(obj):
            if dataclasses.is_dataclass(obj):
                out += [
                    (name, f.name, f.default) for f in dataclasses.fields(obj) if f.default is not dataclasses.MISSING
                ]
            for attr, value in vars(obj).items():
                fn = getattr(value, "__func__", value)
                if inspect.isfunction(fn) and not (dataclasses.is_dataclass(obj) and attr == "__init__"):
                    out += _defaults(f"{name}.{attr}", fn)
    return out


def second_defaults(defaults: list[tuple[str, str, object]]) -> list[str]:
    """The defaults that stand for an option (named like it, or in ALIASES) and differ from its declaration."""
    bad = []
    for where, name, value in defaults:
        option, read = ALIASES.get((where, name), (name if name in FIELDS else None, None))
        if option is None or (where, name) in UNRELATED:
            continue
        declared = FIELDS[option].default
        declared = read(declared) if read else declared
        if value != declared or type(value) is not type(declared):
            bad.append(f"{where}({name}={value!r}): the option {option} is declared with {declared!r}")
    return bad


def _trainer_modules():
    return [importlib.import_module(m.name) for m in pkgutil.walk_packages(trainer.__path__, "trainer.")]


def test_every_library_default_of_an_option_is_its_config_fields_default():
    defaults = [d for module in _trainer_modules() for d in library_defaults(module)]
    assert second_defaults(defaults) == []
    seen = {(where, name) for where, name, _ in defaults}
    assert set(ALIASES) <= seen, f"renamed or gone, update ALIASES: {sorted(set(ALIASES) - seen)}"
    assert {name for _, name, _ in defaults} >= {"micro_batch_size", "max_tokens_per_batch", "lora_alpha", "seed"}


def test_a_second_differing_default_is_found():
    def run_log(*, tensorboard=False, log_every=10, micro_batch_size=1):
        """RunLog's tensorboard=False before the option's default came from the config."""

    def cache(*, limit=0, prefetch=2):
        """A prefetch that differs under the library's own name."""

    found = second_defaults(_defaults("RunLog.__init__", run_log) + _defaults("ShardCache.__init__", cache))
    assert [f.split("(")[1].split("=")[0] for f in found] == ["tensorboard", "prefetch"]


def test_option_groups_are_config_fields_under_their_config_names():
    cfg = TrainConfig(data="d", tiny_random="qwen2-vl", max_tokens_per_batch=512, grad_accum=3, lora_rank=4, seed=7)
    assert Batching.of(cfg) == Batching(max_tokens_per_batch=512, grad_accum=3)
    assert ModelOptions.of(cfg) == ModelOptions(tiny_random="qwen2-vl", lora_rank=4, seed=7)
    groups = [
        g for g in vars(options).values() if isinstance(g, type) and issubclass(g, OptionGroup) and g is not OptionGroup
    ]
    assert {Batching, ModelOptions, DataOptions, RunLength, Optimization, Checkpointing} <= set(groups)
    for group in groups:
        for f in dataclasses.fields(group):
            assert f.default == FIELDS[f.name].default and f.type == FIELDS[f.name].type, (group.__name__, f.name)


def test_no_function_in_trainer_takes_more_than_8_parameters():
    over = []
    for path in sorted(Path(trainer.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if count > MAX_PARAMETERS:
                    over.append(f"{path.name}:{node.lineno} {node.name} takes {count}")
    assert over == [], "pass option groups (trainer/config.py Batching, ModelOptions) instead"
