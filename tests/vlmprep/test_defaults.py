"""One default per option: every class field and function parameter of vlmprep/ named like a BuildConfig option
takes that option's one declared default (config.default), so a second, differing default fails here."""

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import vlmprep
from vlmprep.config import FIELDS, REQUIRED

PACKAGE = Path(vlmprep.__file__).parent
# Names that are not the option they are spelled like, and what each is instead.
NOT_OPTIONS = {
    "vlmprep.clients.energon.prepare.workers": "energon's own indexing processes, not build's --workers",
    "vlmprep.cli.verify.workers": "verify's shard processes (default: every CPU), not build's --workers",
    "vlmprep.cli.stats.workers": "stats' shard processes (default: every CPU), not build's --workers",
    "vlmprep.render.chat_template.message_slots.reasoning": "whether the template reads reasoning_content (a bool)",
    "vlmprep.render.chat_template.template_messages.reasoning": "whether the template reads reasoning_content (a bool)",
    "vlmprep.types.Message.tool_calls": "a message's tool calls (record data)",
    "vlmprep.types.Message.reasoning": "a message's reasoning text (record data)",
    "vlmprep.builder.plan.Plan.append": "what an append's plan builds on (an AppendRef), not the --append flag",
    "vlmprep.builder.plan.make_plan.append": "what an append's plan builds on (an AppendRef), not the --append flag",
}
# Sites known to take an option: the scan must keep finding them (a scan that finds nothing proves nothing).
KNOWN = {
    "vlmprep.render.mask.MaskPolicy.tool_calls",
    "vlmprep.render.traces.StepPolicy.long_traces",
    "vlmprep.ingest.normalize.NormalizeOptions.max_image_bytes",
    "vlmprep.ingest.records.ReadLimits.max_line_bytes",
    "vlmprep.ingest.records.ReadLimits.max_messages_per_record",
    "vlmprep.pixels.images.encode_image.zstd_level",
    "vlmprep.builder.pipeline.build_task.progress",
    "vlmprep.cli.merge.allow_empty",
}


def _sites(tree: ast.Module):
    """(qualname, parameter or field) of every default written in a module for a name that is a BuildConfig field."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                for st in child.body:
                    if isinstance(st, ast.AnnAssign) and st.value is not None and isinstance(st.target, ast.Name):
                        yield f"{prefix}{child.name}", st.target.id
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                positional = a.posonlyargs + a.args
                defaulted = positional[len(positional) - len(a.defaults) :] + [
                    k for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None
                ]
                for arg in defaulted:
                    yield f"{prefix}{child.name}", arg.arg
                yield from walk(child, f"{prefix}{child.name}.<locals>.")

    return [(q, n) for q, n in walk(tree, "") if n in FIELDS]


def library_defaults() -> dict[str, object]:
    """'module.qualname.name' -> the default it holds at run time, for every site outside config.py."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if module == "vlmprep.config":
            continue
        for qualname, name in _sites(ast.parse(path.read_text())):
            key = f"{module}.{qualname}.{name}"
            if key in NOT_OPTIONS:
                continue
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            if dataclasses.is_dataclass(obj):
                f = {f.name: f for f in dataclasses.fields(obj)}[name]
                found[key] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            else:
                found[key] = inspect.signature(obj).parameters[name].default
    return found


def _same(a, b) -> bool:
    if isinstance(a, (set, frozenset)) or isinstance(b, (set, frozenset)):
        return set(a) == set(b)  # train_on_roles: a tuple on the config, a frozenset on MaskPolicy
    return a == b and type(a) is type(b)


def test_every_library_default_of_an_option_is_the_config_fields():
    found = library_defaults()
    assert KNOWN <= found.keys(), f"the scan no longer finds {sorted(KNOWN - found.keys())}"
    bad = [
        f"{key} = {value!r}, but BuildConfig.{key.rpartition('.')[2]} = {FIELDS[key.rpartition('.')[2]].default!r}"
        for key, value in sorted(found.items())
        if FIELDS[key.rpartition(".")[2]].default is not REQUIRED
        and not _same(value, FIELDS[key.rpartition(".")[2]].default)
    ]
    assert not bad, (
        "a second default differs from the option's declared one; take it from "
        "vlmprep.config.default(NAME):\n" + "\n".join(bad)
    )


def test_names_that_are_not_options_still_exist():
    """NOT_OPTIONS stays current: each entry names a default the scan would otherwise flag."""
    sites = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        sites |= {f"{module}.{q}.{n}" for q, n in _sites(ast.parse(path.read_text()))}
    assert NOT_OPTIONS.keys() <= sites, sorted(NOT_OPTIONS.keys() - sites)


def test_a_render_without_a_policy_refuses_what_build_refuses():
    """RenderContext without a policy renders as `vlmprep build` does by default: a tool call the template does not
    print is refused (a library default of its own once trained that turn's text instead)."""
    from tests.support.tiny_processors import load_family_processor
    from tests.vlmprep.test_toolcalls import TRACE
    from vlmprep.ingest.normalize import NormalizeOptions, normalize_record
    from vlmprep.pixels.images import prepare_image
    from vlmprep.render.sample import MaskPolicy, RenderContext, render_conversation
    from vlmprep.types import RecordError, Source

    processor = load_family_processor("qwen2-vl")  # its template prints no tool_calls
    ctx = RenderContext(processor)
    assert ctx.policy == MaskPolicy()
    conv = normalize_record(TRACE, Source("/tmp/x.jsonl", 1), NormalizeOptions())
    images = [prepare_image(im, processor, ctx.family, max_pixels=10**8) for im in conv.images]
    with pytest.raises(RecordError) as e:
        render_conversation(conv, ctx, images)
    assert e.value.reason == "tool_calls_not_rendered"
