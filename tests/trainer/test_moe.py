"""Mixture-of-experts checkpoints whose config trains the router's balance loss (`output_router_logits`,
`router_aux_loss_coef`), through the trainer's real FSDP2 wrap (one process on gloo, and two torchrun ranks; CPU,
fp32): the step-1 loss and grad norm are the model's own forward on each micro-batch as the Collator pads it
(cross-entropy + coefficient x balance loss over its real tokens), weighted by its trained tokens; the share of the
routed token positions that padding and placeholder images take is reported."""

import subprocess
import warnings

import pytest
import torch

from tests.trainer.conftest import ROOT, TORCHRUN, read_metrics, trainer_env
from tests.trainer.test_family_training import three_records

# The families the trainer trains whose model class computes a balance loss (trainer/families.py model types whose
# transformers module defines load_balancing_loss_func), as a test name -> (dataset processor, model type).
BALANCED = {"qwen3.5": ("qwen3.5", "qwen3_5_moe"), "qwen3-vl-moe": ("qwen3-vl", "qwen3_vl_moe")}
COEF = 1.0


@pytest.fixture(scope="module", params=list(BALANCED))
def moe(request, tmp_path_factory):
    """Per family: the three-record dataset (two images of different sizes, one text-only) built with its tiny
    processor, and a tiny random checkpoint of its MoE class that asks for the balance loss."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from trainer.families import BY_NAME
    from trainer.model import tiny_vocab
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    processor, model_type = BALANCED[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    build(
        BuildConfig(
            inputs=(str(three_records(tmp)),), out=str(tmp / "ds"), processor=f"tiny:{processor}", progress=False
        )
    )
    kw = BY_NAME[processor].tiny(tiny_vocab(processor, str(tmp / "ds" / "processor")))
    kw["model_type"] = model_type
    kw["text_config"].update(output_router_logits=True, router_aux_loss_coef=COEF)
    if model_type == "qwen3_vl_moe":  # Qwen3-VL's tiny config with 4 experts, 2 a token
        kw["text_config"].update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model(kw.pop("model_type"), **kw)).save_pretrained(
        tmp / "ckpt"
    )
    return request.param, tmp / "ds", tmp / "ckpt"


def _args(ds, ckpt, out, *extra) -> list[str]:
    """One step of the trainer on the checkpoint, in data order, with an lr that changes nothing."""
    fixed = "--lr 1e-30 --max-steps 1 --no-shuffle --no-shuffle-shards --num-workers 0 --device cpu --no-progress"
    return ["--data", str(ds), "--model", str(ckpt), "--out", str(out), *fixed.split(), *extra]


def own_step(ds, ckpt, groups: list[list[str]], *, coef: float = COEF) -> tuple[float, float, float]:
    """The model's own forward (transformers' loss: mean cross-entropy + coef x its balance loss over the attention
    mask) on each group of samples as the Collator pads it, weighted by the group's trained tokens and summed:
    (loss, grad norm, the same loss without the balance term)."""
    from transformers import AutoModelForImageTextToText

    import vlmprep.clients.hf
    from vlmprep.clients.collate import Collator

    samples = {s["id"]: s for s in vlmprep.clients.hf.iterable_dataset(ds)}
    model = AutoModelForImageTextToText.from_pretrained(ckpt, local_files_only=True, dtype=torch.float32).train()
    assert model.config.get_text_config().router_aux_loss_coef == coef
    collate = Collator(ds)
    batches = [collate([samples[i] for i in g]) for g in groups]
    trained = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    loss = ce = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b, n in zip(batches, trained):
            out = model(**b)
            assert out.aux_loss is not None and float(out.aux_loss) > 0
            (out.loss * n / sum(trained)).backward()
            loss += float(out.loss) * n / sum(trained)
            ce += (float(out.loss) - coef * float(out.aux_loss)) * n / sum(trained)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return loss, float(norm), ce


def test_one_fsdp_process_trains_the_models_own_balance_loss(moe, tmp_path, capsys):
    """`python -m trainer --model DIR` in one process (FSDP2 over gloo, as every run): two micro-batches of 2 (the
    two image samples; the text-only one alone, which gets a placeholder image) give the step-1 loss and grad norm of
    the model's own forward on each, weighted by trained tokens (rel. 1e-5 / 1e-4); without the balance term the loss
    is far off. The routers see exactly the step's padded positions, and step 1's line and `padding_frac` say how many
    of them hold no sample token."""
    from trainer.train import main

    name, ds, ckpt = moe
    routed: dict[int, int] = {}

    def count(module, args, _out):  # rows each router instance takes in the training forwards
        if type(module).__name__.endswith("Router"):
            routed[id(module)] = routed.get(id(module), 0) + args[0].reshape(-1, args[0].shape[-1]).shape[0]

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        assert main(_args(ds, ckpt, tmp_path / "run", "--micro-batch-size", "2", "--grad-accum", "2")) == 0
    finally:
        hook.remove()
    row = read_metrics(tmp_path / "run")[0]
    assert row["sample_ids"] == ["i0", "i1", "t"]
    loss, norm, ce = own_step(ds, ckpt, [["i0", "i1"], ["t"]])
    assert row["loss"] == pytest.approx(loss, rel=1e-5), (row["loss"], loss, ce)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert abs(row["loss"] - ce) > 0.1 * ce  # the balance term is material: a run without it fails above
    # What a padded micro-batch equals (docs/trainer.md): its cross-entropy is its samples' alone; its balance term is
    # the joint one over all its real tokens, not the samples' own (the fast family: Qwen3.5's linear attention is slow).
    if name == "qwen3-vl-moe":
        alone = own_step(ds, ckpt, [["i0"], ["i1"], ["t"]])
        assert ce == pytest.approx(alone[2], rel=1e-6) and abs(loss - alone[0]) > 1e-5 * loss
    [positions] = set(routed.values())  # every MoE layer routes the same positions
    line = next(ln for ln in capsys.readouterr().err.splitlines() if " token positions through each MoE" in ln)
    waste = positions - row["num_tokens"]
    assert f"step 1 routed {positions} token positions" in line and f" {waste} ({waste / positions:.1%}) " in line
    assert waste > 0 and row["padding_frac"] == pytest.approx(waste / positions, rel=1e-9)


@pytest.mark.slow
def test_two_ranks_train_the_models_own_balance_loss(moe, tmp_path):
    """Two torchrun ranks, one micro-batch of 2 each (an image sample with the text-only one; the other image
    sample alone): the step-1 loss and grad norm are each rank's micro-batch through the model's own forward,
    weighted by trained tokens (rel. 1e-5 / 1e-4)."""
    _, ds, ckpt = moe
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "trainer"]
    cmd += _args(ds, ckpt, tmp_path / "run", "--micro-batch-size", "2")
    proc = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = read_metrics(tmp_path / "run")[0]
    ids, per_rank = row["sample_ids"], row["samples_per_rank"]
    groups = [ids[: per_rank[0]], ids[per_rank[0] :]]
    assert sorted(map(len, groups)) == [1, 2]
    loss, norm, ce = own_step(ds, ckpt, groups)
    assert row["loss"] == pytest.approx(loss, rel=1e-5), (row["loss"], loss, ce)
    assert row["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert abs(row["loss"] - ce) > 0.1 * ce


def test_the_families_with_a_balance_loss_are_the_ones_tested_here():
    """Of the model types the trainer trains, exactly Qwen3.5-MoE's and Qwen3-VL-MoE's transformers modules compute
    a router balance loss (Llama 4 and Gemma 4 route tokens but define none; InternVL, LLaVA-OneVision and Mistral 3
    over an MoE text model add none in their own forward), so the tests above cover every family that has one."""
    import importlib

    from trainer.families import FAMILIES

    have = {
        t
        for f in FAMILIES
        for t in f.model_types
        if hasattr(importlib.import_module(f"transformers.models.{t}.modeling_{t}"), "load_balancing_loss_func")
    }
    assert have == {t for _, t in BALANCED.values()}


def test_routes_experts_names_the_models_with_routers():
    """The routed-positions line is printed for every model that holds a router: the tiny Qwen3.5-MoE and Llama 4,
    Qwen3-VL-MoE, a Gemma 4 with its MoE block, an InternVL over a Qwen3-MoE text model; not for the dense tiny
    configs of the other families."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from trainer.families import FAMILIES
    from trainer.model import tiny_config
    from trainer.tiny_configs import Vocab

    def routes(config) -> bool:
        from trainer.model import routes_experts

        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return routes_experts(AutoModelForImageTextToText.from_config(config))

    for f in FAMILIES:
        vocab = Vocab(size=512, ids={t: 300 + k for k, t in enumerate(f.tokens)}, pad_id=0)
        assert routes(tiny_config(f.name, vocab)) is (f.name in ("qwen3.5", "llama-4")), f.name
    experts = dict(num_hidden_layers=2, hidden_size=64, moe_intermediate_size=32, num_experts=4)
    assert routes(AutoConfig.for_model("qwen3_vl_moe", text_config=dict(experts, num_experts_per_tok=2)))
    assert routes(AutoConfig.for_model("gemma4", text_config=dict(experts, enable_moe_block=True, top_k_experts=2)))
    assert not routes(AutoConfig.for_model("gemma4", text_config=dict(num_hidden_layers=2)))
    assert routes(AutoConfig.for_model("internvl", text_config=dict(experts, model_type="qwen3_moe")))
