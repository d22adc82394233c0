"""CUDA checks (`make test-gpu`): on-device pixel math and a bf16 FSDP2 run with activation checkpointing."""
import pytest
import torch

from tests.trainer.conftest import read_all_samples, read_metrics, run_trainer
from trainer.vision import Patchifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pixel_values_on_gpu_equal_cpu(dataset, image_spec):
    images = [torch.from_numpy(im) for s in read_all_samples(dataset, image_spec) for im in s.images]
    index = list(range(len(images)))
    cpu = Patchifier(image_spec, "cpu")(images, index)
    gpu = Patchifier(image_spec, "cuda")(images, index).cpu()
    assert float((cpu - gpu).abs().max()) <= 1e-6


def test_bf16_fsdp_run_with_activation_checkpointing(dataset, tmp_path):
    out = tmp_path / "run"
    run_trainer(["--data", dataset, "--out", out, "--max-steps", 6, "--micro-batch-size", 2, "--num-workers", 2,
                 "--activation-checkpointing", "--lr", 1e-3], nproc=1, timeout=600)
    m = read_metrics(out)
    assert len(m) == 6 and all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
    assert m[-1]["loss"] < m[0]["loss"]
    steady = m[2:]
    step_s = sum(r["step_time_s"] for r in steady) / len(steady)
    wait = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    print(f"gpu: {torch.cuda.get_device_name()}: {step_s * 1000:.0f} ms/step, data wait {100 * wait:.1f}% of step time")
