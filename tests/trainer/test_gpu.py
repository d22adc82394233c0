"""CUDA checks (`make test-gpu`): on-device pixel math, a bf16 FSDP2 run with activation checkpointing, and the
packed path in bf16 (flash_attention_2 where installed, else sdpa)."""

import pytest
import torch

from tests.trainer.conftest import read_all_samples, read_metrics, run_trainer
from trainer.data.vision import Patchifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pixel_values_on_gpu_equal_cpu(dataset, image_spec):
    images = [torch.from_numpy(im) for s in read_all_samples(dataset, image_spec) for im in s.images]
    index = list(range(len(images)))
    cpu = Patchifier(image_spec, "cpu")(images, index)
    gpu = Patchifier(image_spec, "cuda")(images, index).cpu()
    assert float((cpu - gpu).abs().max()) <= 1e-6


def test_device_pixel_math_of_the_padded_and_uint8_families_on_gpu_equal_cpu(device="cuda"):
    """Gemma 4's patches, Llama 3.2 Vision's tiles (trainer/data/tiles.py) and Llama 4's, InternVL's, SmolVLM's and
    LLaVA-OneVision's normalize of the workers' uint8 made on the GPU equal the CPU's (test_tiles.py holds the CPU's
    equal to the processors')."""
    from types import SimpleNamespace

    import numpy as np

    from tests.trainer.test_tiles import _gemma4, _mllama, _uint8_processor
    from trainer.data.vision import HostPixels
    from trainer.families import BY_NAME

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(170, 300), (900, 400)]]
    index, rows, ids = [0, 1, 0], [0, 0, 1], np.full((2, 8), 5, dtype=np.int64)
    ids[:, 1], ids[0, 3] = 9, 9
    _, spec = _gemma4()
    host = HostPixels(BY_NAME["gemma-4"], spec.config, images=False, budget=spec.budget)
    resized, _ = host.device_images(images, index, rows, ids)
    cpu, gpu = (Patchifier(spec, d)(resized, index).cpu() for d in ("cpu", device))
    assert float((cpu - gpu).abs().max()) <= 1e-6
    _, spec = _mllama()
    host = HostPixels(BY_NAME["llama-3.2-vision"], spec.config, image_token_id=9, images=False, canvas=spec.canvas)
    fitted, _ = host.device_images(images, index, rows, ids)
    batch = SimpleNamespace(vision={}, images=fitted, image_index=index, image_rows=rows, input_ids=ids)
    cpu, gpu = (Patchifier(spec, d).inputs(batch)[0].cpu() for d in ("cpu", device))
    assert cpu.shape == (2, 2, 4, 3, 560, 560) and float((cpu - gpu).abs().max()) <= 1e-6
    for name in ("llama-4", "internvl"):
        _, spec = _uint8_processor(name)
        pixels = HostPixels(BY_NAME[name], spec.config, math=False)([images], ids[:1], ids[:1])["pixel_values"]
        cpu, gpu = (Patchifier(spec, d).host_math(pixels.to(d)).cpu() for d in ("cpu", device))
        assert pixels.dtype == torch.uint8 and float((cpu - gpu).abs().max()) <= 1e-6, name
    _, spec = _uint8_processor("smolvlm")  # padded in uint8 by the workers, normalized under the mask
    out = HostPixels(BY_NAME["smolvlm"], spec.config, math=False)([images[:1], images[1:]], ids, ids)
    pixels, mask = out["pixel_values"], out["pixel_attention_mask"]
    cpu, gpu = (Patchifier(spec, d).host_math(pixels.to(d), mask.to(d)).cpu() for d in ("cpu", device))
    assert pixels.dtype == torch.uint8 and float((cpu - gpu).abs().max()) <= 1e-6
    _, spec = _uint8_processor("llava-onevision")  # padded in uint8 by the workers, padding zeroed by count
    out = HostPixels(BY_NAME["llava-onevision"], spec.config, math=False)([images[:1], images[1:]], ids, ids)
    pixels, counts = out["pixel_values"], out["_patches"]
    cpu, gpu = (Patchifier(spec, d).host_math(pixels.to(d), counts=counts.to(d)).cpu() for d in ("cpu", device))
    assert pixels.dtype == torch.uint8 and float((cpu - gpu).abs().max()) <= 1e-6


def test_bf16_fsdp_run_with_activation_checkpointing(dataset, tmp_path):
    out = tmp_path / "run"
    run_trainer(
        [
            "--data",
            dataset,
            "--out",
            out,
            "--max-steps",
            6,
            "--micro-batch-size",
            2,
            "--num-workers",
            2,
            "--activation-checkpointing",
            "--lr",
            1e-3,
        ],
        nproc=1,
        timeout=600,
    )
    m = read_metrics(out)
    assert len(m) == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
    assert m[-1]["loss"] < m[0]["loss"]
    steady = m[2:]
    step_s = sum(r["step_time_s"] for r in steady) / len(steady)
    wait = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    print(f"gpu: {torch.cuda.get_device_name()}: {step_s * 1000:.0f} ms/step, data wait {100 * wait:.1f}% of step time")


def test_packed_row_per_segment_parity_in_bf16_with_flash_attention_or_sdpa(image_spec):
    """The packed path on the GPU: flash_attention_2 (varlen cu_seqlens from the resets of position row 0) where
    flash-attn is installed, else sdpa; bf16 weights. Each sample's logits in the packed row equal its logits alone
    within bf16 noise, and a packing that does not reset positions is far outside it."""
    import importlib.util

    from tests.trainer.test_pack import _net, _segments, _variant, _worst_segment_diff
    from trainer.data.collate import CollateSpec
    from trainer.data.pack import collate_packed
    from trainer.data.vision import ImageSpec

    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    net = _net("qwen2_vl", attn).to("cuda", torch.bfloat16)
    spec = CollateSpec(0, 151655, 14, 2)
    samples = _segments(14)
    packed = collate_packed([samples[:3], samples[3:]], spec)
    patchify = Patchifier(ImageSpec.from_config({**image_spec.config, "patch_size": 14}), "cuda")
    ok = _worst_segment_diff(net, samples, packed, patchify, spec, device="cuda")
    broken = _worst_segment_diff(net, samples, _variant(packed, "attend"), patchify, spec, device="cuda")
    print(f"gpu packed parity ({attn}, bf16): worst per-segment logit diff {ok:.3g}, broken packing {broken:.3g}")
    assert ok <= 3e-2 and broken > 10 * max(ok, 1e-3)


def test_bf16_packed_run(dataset, tmp_path):
    out = tmp_path / "run"
    run_trainer(
        [
            "--data",
            dataset,
            "--out",
            out,
            "--pack-to",
            2048,
            "--max-steps",
            2,
            "--schedule-steps",
            2,
            "--num-workers",
            2,
        ],
        nproc=1,
        timeout=600,
    )
    m = read_metrics(out)
    assert len(m) == 2 and all(0 < r["pack_fill"] <= 1 for r in m)
    print(
        f"gpu packed: {m[-1]['step_time_s'] * 1000:.0f} ms/step, {m[-1]['tokens_per_s']:.0f} tokens/s, "
        f"mfu {m[-1].get('mfu', 'n/a (device not in metrics.PEAK_BF16)')}, data wait {m[-1]['data_wait_frac']:.1%}"
    )


def _attn_implementations() -> list[str]:
    import importlib.util

    return ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


@pytest.mark.parametrize("attn", _attn_implementations())
@pytest.mark.parametrize(
    "name",
    [
        "qwen2-vl",
        "qwen2.5-vl",
        "qwen3-vl",
        "qwen3.5",
        "llama-3.2-vision",
        "llama-4",
        "mistral-3",
        "gemma-3",
        "gemma-4",
        "glm-4.1v",
        "internvl",
        "llava-onevision",
        "smolvlm",
    ],
)
def test_every_family_trains_in_bf16_on_the_gpu(name, attn, tmp_path):
    """Each family's tiny model, bf16 on the device (sdpa, and flash_attention_2 where installed): 3 steps on its
    one-record dataset train finitely, and the step-1 loss is the fp32 CPU run's within bf16 noise."""
    import json

    from tests.trainer.test_family_training import build_one
    from trainer.train import main

    ds, _, _ = build_one(tmp_path, f"tiny:{name}")
    losses = {}
    for run, extra in (
        ("gpu", ["--device", "cuda", "--precision", "bf16", "--attn-implementation", attn]),
        ("cpu", ["--device", "cpu", "--precision", "fp32"]),
    ):
        assert (
            main(
                [
                    "--data",
                    str(ds),
                    "--out",
                    str(tmp_path / run),
                    "--tiny-random",
                    name,
                    "--max-steps",
                    "3",
                    "--no-shuffle",
                    "--no-shuffle-shards",
                    "--num-workers",
                    "0",
                    "--no-progress",
                    *extra,
                ]
            )
            == 0
        )
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
        losses[run] = rows[0]["loss"]
    print(f"gpu {name} ({attn}, bf16): step-1 loss {losses['gpu']:.4f} vs fp32 CPU {losses['cpu']:.4f}")
    assert losses["gpu"] == pytest.approx(losses["cpu"], rel=5e-2)
