import numpy as np
import pytest
import torch

from tests.trainer.conftest import read_all_samples
from trainer.data.collate import CollateSpec, collate
from trainer.data.decode import DecodedSample
from trainer.data.vision import Patchifier
from trainer.model import build_model, forward_loss
from trainer.options import ModelOptions
from trainer.train import main

SPEC = CollateSpec(pad_id=0, image_token_id=151655, patch_size=14, merge_size=2)


@pytest.fixture(scope="module")
def batch(dataset, image_spec):
    samples = read_all_samples(dataset, image_spec)[:3]
    b = collate(samples, SPEC).to("cpu")
    return b, Patchifier(image_spec, "cpu")(b.images, b.image_index)


def _grads(net, batch):
    b, pixels = batch
    net.train()
    loss = forward_loss(net, b, pixels)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def test_tiny_model_shape():
    net = build_model(ModelOptions(tiny_random="qwen2-vl"))
    text = net.config.text_config
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers) == (151936, 128, 2)
    assert net.config.use_cache is False and sorted(net._no_split_modules) == [
        "Qwen2VLDecoderLayer",
        "Qwen2VLVisionBlock",
    ]


def test_activation_checkpointing_gives_the_same_loss_and_gradients(batch):
    loss, grads = _grads(build_model(ModelOptions(tiny_random="qwen2-vl", seed=0)), batch)
    loss_ac, grads_ac = _grads(
        build_model(ModelOptions(tiny_random="qwen2-vl", seed=0, activation_checkpointing=True)), batch
    )
    assert loss == loss_ac and grads.keys() == grads_ac.keys()
    assert all(torch.equal(grads[n], grads_ac[n]) for n in grads)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_lora_trains_adapters_only_and_freezes_the_vision_tower(batch):
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0, lora_rank=4))
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    _, grads = _grads(net, batch)
    assert set(grads) == set(trainable)
    assert all(not p.requires_grad for n, p in net.named_parameters() if ".visual." in n)


def test_user_errors_are_one_line_and_exit_1(tmp_path, capsys):
    assert main(["--data", str(tmp_path / "missing"), "--tiny-random", "qwen2-vl", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error: --data") and "no such dataset dir" in err[0]


FAMILIES = {
    "qwen2_5_vl": (
        14,
        dict(
            text_config=dict(
                vocab_size=151936,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
            ),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                fullatt_block_indexes=[1],
                window_size=56,
                patch_size=14,
            ),
        ),
    ),
    "qwen3_vl": (
        16,
        dict(
            text_config=dict(
                vocab_size=151936,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": [2, 3, 3],
                    "rope_theta": 1e6,
                    "mrope_interleaved": True,
                },
            ),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                num_position_embeddings=64,
                deepstack_visual_indexes=[1],
                patch_size=16,
            ),
        ),
    ),
}


def _one_image_sample(patch: int):
    """Text, a 4x4-patch image (2x2 merged tokens), text; MRoPE positions laid out as get_rope_index does."""
    ids = [151644, 872, 198, 151652] + [151655] * 4 + [151653, 1, 2, 3, 151645]
    mm = [0] * 4 + [1] * 4 + [0] * 5
    pos = [list(range(4)) for _ in range(3)]
    pos[0] += [4] * 4
    pos[1] += [4, 4, 5, 5]
    pos[2] += [4, 5, 4, 5]
    for p in pos:
        p += list(range(6, 11))
    img = np.random.default_rng(0).integers(0, 256, (4 * patch, 4 * patch, 3), dtype=np.uint8)
    return DecodedSample(
        key="k",
        id="k",
        input_ids=np.array(ids, np.int32),
        loss_mask=np.array([0] * 9 + [1] * 4, np.uint8),
        mm_token_type_ids=np.array(mm, np.uint8),
        position_ids=np.array(pos, np.int32),
        image_grid_thw=np.array([[1, 4, 4]], np.int32),
        images=[img],
        image_index=[0],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_dirs_of_other_families_load_shard_and_train(family, image_spec, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForImageTextToText

    from trainer.data.vision import ImageSpec
    from trainer.model import apply_fsdp

    patch, kw = FAMILIES[family]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        **kw,
    )
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    net = build_model(ModelOptions(model=str(tmp_path / "ckpt")))
    # from_pretrained gives eval mode; training needs train mode (dropout, and activation checkpointing only runs then)
    assert all(m.training for m in net.modules())
    spec = ImageSpec.from_config({**image_spec.config, "patch_size": patch})
    batch = collate([_one_image_sample(patch)], CollateSpec(0, 151655, patch, 2)).to("cpu")
    pixels = Patchifier(spec, "cpu")(batch.images, batch.image_index)
    with torch.no_grad():
        ours = forward_loss(net, batch, pixels)
        own = net(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            mm_token_type_ids=batch.mm_token_type_ids,
            pixel_values=pixels,
            image_grid_thw=batch.image_grid_thw,
            use_cache=False,
        ).logits
        ref = torch.nn.functional.cross_entropy(own[0, 8:12].float(), batch.input_ids[0, 9:13], reduction="sum")
    assert float(ours) == pytest.approx(float(ref), rel=1e-5)  # so the stored-position layout is the model's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        apply_fsdp(net, init_device_mesh("cpu", (1,)), bf16=False)
        forward_loss(net, batch, pixels).backward()
        assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    finally:
        dist.destroy_process_group()
