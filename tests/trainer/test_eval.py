"""Held-out eval through the CLI: the eval row equals a separate single-process computation (the run's final
checkpoint loaded into a plain model, one sample per forward, full logits; padded and packed), training is
bit-identical with and without --eval-every (2 ranks, LoRA dropout, so an eval that moved the RNG or left a
module's mode changed would show), an eval set of one sample on 2 ranks does not hang; the options parse."""

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.conftest import TRACES, build_dataset, read_metrics, run_trainer
from trainer.cli import load_toml, parse_args
from trainer.config import ConfigError, TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def one_sample(tmp_path_factory):
    """A dataset of one sample: on 2 ranks one rank has nothing to evaluate."""
    from scripts.demo_traces import write_traces

    path = tmp_path_factory.mktemp("one") / "traces.jsonl.zst"
    write_traces(path, **{**TRACES, "n": 1})
    return build_dataset(path, path.parent / "shards")


def final_model(run_dir, **model_kw):
    """The run's last checkpoint in a plain (unsharded, single-process) model."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import latest_checkpoint
    from trainer.model import build_model
    from trainer.options import ModelOptions

    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0, **model_kw))
    state = {"model": net.state_dict()}
    dcp.load(state, checkpoint_id=str(latest_checkpoint(run_dir)))
    net.load_state_dict(state["model"])
    return net.eval()


def reference_eval(net, pattern: str, image_spec) -> tuple[float, int, int]:
    """(mean token loss, trained tokens, samples) over every sample of `pattern`, one sample per forward with full
    logits: no batching, packing, FSDP, logits_to_keep or all-reduce involved."""
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream
    from trainer.data.vision import Patchifier

    spec = CollateSpec(pad_id=0, image_token_id=int(net.config.image_token_id), patch_size=14, merge_size=2)
    patchify = Patchifier(image_spec, "cpu")
    total, tokens, n = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for s in RankStream(list(resolve_data(pattern).shards), start=0, spec=image_spec):
            b = collate([s], spec)
            out = net(
                input_ids=b.input_ids.long(),
                attention_mask=b.attention_mask,
                position_ids=b.position_ids.long(),
                mm_token_type_ids=b.mm_token_type_ids.long(),
                pixel_values=patchify(b.images, b.image_index),
                image_grid_thw=b.image_grid_thw,
                use_cache=False,
            )
            labels = b.labels[0, 1:]
            trained = labels != -100
            total += F.cross_entropy(out.logits[0, :-1].float()[trained], labels[trained], reduction="sum").double()
            tokens, n = tokens + int(trained.sum()), n + 1
    return float(total) / tokens, tokens, n


@pytest.mark.parametrize(
    "batching",
    [
        pytest.param(["--micro-batch-size", 2], id="padded", marks=pytest.mark.slow),  # make-test budget (~23 s)
        pytest.param(["--pack-to", 4096, "--pack-window", 4], id="packed", marks=pytest.mark.slow),
    ],
)
def test_eval_loss_equals_a_single_process_computation(dataset, image_spec, tmp_path, batching):
    """Eval only at the end (no --eval-every): one row after the last step, over the whole eval set (2 shards,
    6 samples: padded micro-batches of 2, or packed rows), equal to the reference on the trained weights."""
    out, eval_set = tmp_path / "run", str(dataset / "shard-{000003..000004}.tar")
    proc = run_trainer(
        [
            "--data",
            dataset,
            "--out",
            out,
            "--eval-data",
            eval_set,
            "--max-steps",
            1,
            "--num-workers",
            0,
            "--lr",
            1e-3,
            "--no-tensorboard",
            *batching,
        ]
    )
    rows = read_metrics(out)
    assert [("eval_loss" in r, r["step"]) for r in rows] == [(False, 1), (True, 1)]
    row = rows[-1]
    loss, tokens, samples = reference_eval(final_model(out), eval_set, image_spec)
    assert (row["eval_tokens"], row["eval_samples"]) == (tokens, samples) == (tokens, 6)
    assert row["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0)
    assert "eval_loss_by_source" not in row  # one eval set
    assert f"eval at step 1: loss {loss:.4f}" in proc.stderr


def test_evaluate_restores_the_rng_and_each_module_mode_and_runs_in_eval_mode(dataset, image_spec):
    """In-process, one rank: LoRA dropout 0.3 with non-zero adapters (so dropout would change the loss), a module
    already in eval mode (peft over a from_pretrained model leaves modes mixed). The eval DataLoader draws a seed
    from torch's generator: without the fork, training's next dropout mask would differ."""
    import torch.distributed as dist

    from trainer.data.batches import StepLoader
    from trainer.data.collate import CollateSpec
    from trainer.data.pipeline import EvalSet
    from trainer.data.sources import resolve_data
    from trainer.data.streams import ShardSequence
    from trainer.data.vision import Patchifier
    from trainer.evaluate import evaluate
    from trainer.model import build_model
    from trainer.options import Batching, ModelOptions

    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0, lora_rank=4, lora_dropout=0.3))
    torch.manual_seed(1)
    for name, p in net.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    net.get_base_model().model.visual.eval()
    modes = [m.training for m in net.modules()]
    assert any(modes) and not all(modes)
    pattern = str(dataset / "shard-000004.tar")
    spec = CollateSpec(pad_id=0, image_token_id=int(net.config.image_token_id), patch_size=14, merge_size=2)
    streams = ShardSequence(list(resolve_data(pattern).shards), spec=image_spec, seed=0, shuffle_shards=False)
    loader = StepLoader(
        streams, collate_spec=spec, batching=Batching(micro_batch_size=2), num_workers=0, prefetch_factor=2
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(5)
        before = torch.get_rng_state()
        row = evaluate(
            net, [EvalSet("", loader)], step=7, device=torch.device("cpu"), patchifier=Patchifier(image_spec, "cpu")
        )
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        dist.destroy_process_group()
    assert [m.training for m in net.modules()] == modes
    net.eval()
    loss, tokens, samples = reference_eval(net, pattern, image_spec)
    net.train()  # dropout on: the loss moves, so the reference above is the eval-mode one
    assert reference_eval(net, pattern, image_spec)[0] != pytest.approx(loss, rel=1e-4)
    assert (row["step"], row["eval_tokens"], row["eval_samples"]) == (7, tokens, samples)
    assert row["eval_loss"] == pytest.approx(loss, rel=1e-6, abs=0)


COMMON = [
    "--micro-batch-size",
    2,
    "--max-steps",
    3,
    "--lora-rank",
    4,
    "--lora-dropout",
    0.3,
    "--lr",
    1e-3,
    "--num-workers",
    2,
    "--save-every",
    2,
    "--no-tensorboard",
]


@pytest.mark.slow  # two torchrun runs of 3 steps: ~1-2 min on 2 shared cores
def test_two_ranks_eval_every_step_leaves_training_bit_identical_and_one_sample_does_not_hang(
    dataset, one_sample, image_spec, tmp_path
):
    """2 ranks, eval after every step over two named sets: `one` (1 sample: rank 1 reads none and runs empty
    micro-batches) and `tail` (2 samples, one per rank). Training rows equal the run without eval bit for bit;
    the final eval equals the reference per set and overall."""
    tail = str(dataset / "shard-000004.tar")
    base = run_trainer(["--data", dataset, "--out", tmp_path / "plain", *COMMON], nproc=2, timeout=400)
    run_trainer(
        [
            "--data",
            dataset,
            "--out",
            tmp_path / "eval",
            *COMMON,
            "--eval-every",
            1,
            "--eval-data",
            f"name=one,path={one_sample}",
            "--eval-data",
            f"name=tail,path={tail}",
        ],
        nproc=2,
        timeout=400,
    )
    assert "trainer: eval" not in base.stderr
    plain, rows = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "eval")
    train = [r for r in rows if "loss" in r]
    keys = ("step", "epoch", "sample_ids", "samples_per_rank", "num_trained_tokens", "loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in train] == [[r[k] for k in keys] for r in plain]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2, 3] and all(r["eval_samples"] == 3 for r in evals)
    assert len({r["eval_loss"] for r in evals}) == 3  # the weights moved between evals (lr 1e-3)
    net = final_model(tmp_path / "eval", lora_rank=4, lora_dropout=0.3)
    ref = {name: reference_eval(net, path, image_spec) for name, path in (("one", str(one_sample)), ("tail", tail))}
    last = evals[-1]
    assert last["eval_tokens_by_source"] == {n: r[1] for n, r in ref.items()}
    for n, (loss, _, _) in ref.items():
        assert last["eval_loss_by_source"][n] == pytest.approx(loss, rel=1e-6, abs=0), n
    overall = sum(r[0] * r[1] for r in ref.values()) / sum(r[1] for r in ref.values())
    assert last["eval_loss"] == pytest.approx(overall, rel=1e-6, abs=0)


def test_eval_options_parse_round_trip_and_may_change_on_resume(tmp_path):
    cfg = parse_args(
        [
            "--data",
            "d",
            "--tiny-random",
            "qwen2-vl",
            "--eval-data",
            "name=a,path=x",
            "--eval-data",
            "name=b,path=y/shard-{0..1}.tar",
            "--eval-every",
            "5",
        ]
    )
    assert [(d.name, d.path) for d in cfg.eval_sources] == [("a", "x"), ("b", "y/shard-{0..1}.tar")]
    p = tmp_path / "config.toml"
    p.write_text(cfg.to_toml())
    assert TrainConfig(**load_toml(str(p))) == cfg and "[[eval_data]]" in p.read_text()
    assert parse_args(["--data", "d", "--tiny-random", "qwen2-vl", "--eval-data", "e"]).eval_sources[0].path == "e"
    assert TrainConfig(data="d", tiny_random="qwen2-vl").eval_sources == ()

    from trainer.checkpoint import run_identity
    from trainer.data.sources import DataSource

    def identity(c):
        return run_identity(
            c.resume_identity(),
            datasets=[(c.sources[0], DataSource((), None, None))],
            model={},
            image_config={},
            world=1,
        )

    assert identity(cfg) == identity(TrainConfig(data="d", tiny_random="qwen2-vl"))  # eval never blocks a resume


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(eval_every=3), "eval_every=3 without eval_data"),
        (dict(eval_data="e", eval_every=-1), "eval_every=-1"),
        (dict(eval_data=("name=a,path=x,weight=2",)), "name and path only"),
        (dict(eval_data=("name=a,path=x", "name=a,path=y")), "distinct names"),
    ],
)
def test_eval_option_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        TrainConfig(data="d", tiny_random="qwen2-vl", **kw)


def test_bad_eval_data_is_one_line(dataset, tmp_path, capsys):
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                str(dataset),
                "--out",
                str(tmp_path / "r"),
                "--tiny-random",
                "qwen2-vl",
                "--no-progress",
                "--max-steps",
                "1",
                "--eval-data",
                str(tmp_path / "missing"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("trainer: error: ") and "no such dataset dir" in err[-1], err


def test_the_training_data_as_eval_data_is_warned_not_refused(dataset, tmp_path, capsys):
    """An eval set that shares shards with the training data (the same dir, or a copy: same sha256) gets one
    warning line at start-up: its loss is no held-out loss. Not refused: it is a fair check of fit."""
    import shutil

    from tests.trainer.conftest import open_data_of
    from trainer.data.datasets import eval_overlap, log_plans
    from trainer.data.sources import DataSource, ShardRef, resolve_data

    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    for held in (str(dataset), str(copy)):
        data = open_data_of(TrainConfig(data=str(dataset), eval_data=held, tiny_random="qwen2-vl"))
        assert data.warnings == (
            f"--eval-data {held} shares 5 of its 5 shards with the training data ({dataset}): "
            "its eval loss is measured on trained samples, not held out; build the eval set "
            "from records kept out of the training data",
        )
        log_plans(data)
        assert capsys.readouterr().err.count("trainer: warning: --eval-data") == 1
    # One shard of the copy as a pattern, against a mixture: named by the datasets that hold it.
    one = f"{copy}/shard-000001.tar"
    cfg = TrainConfig(data=(f"name=a,path={dataset}", "name=b,path=elsewhere"), eval_data=one, tiny_random="qwen2-vl")
    warned = eval_overlap(
        cfg.eval_sources[0], resolve_data(one), cfg.sources, [resolve_data(str(dataset)), DataSource((), None, None)]
    )
    assert warned == [
        f"--eval-data {one} shares 1 of its 1 shards with the training data ({dataset}): its eval loss "
        "is measured on trained samples, not held out; build the eval set from records kept out of the "
        "training data"
    ]
    other = DataSource((ShardRef(str(tmp_path / "held.tar"), "held.tar", 1, 1, 1),), None, None)
    assert eval_overlap(cfg.eval_sources[0], other, cfg.sources, [resolve_data(str(dataset))]) == []
