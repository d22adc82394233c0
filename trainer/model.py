"""The model: an HF AutoModelForImageTextToText (checkpoint dir or a tiny random config) -> optional LoRA and
activation checkpointing -> FSDP2 (each vision block and decoder layer, then the root) -> summed token loss.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.collate import IGNORE_INDEX, Batch
from trainer.config import ConfigError, ModelOptions

TINY_CONFIGS = {
    "qwen2-vl": dict(
        model_type="qwen2_vl",
        text_config=dict(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e6}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True,
    ),
}
LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def tiny_config(name: str):
    """The transformers config of a named tiny random-init model (--tiny-random NAME), for tests and demos."""
    from transformers import AutoConfig

    cfg = dict(TINY_CONFIGS[name])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def model_identity(*, model: str, tiny_random: str) -> dict:
    """What a checkpoint's weights started from: the tiny config's name, or the checkpoint dir and its config.json
    hash (checked here, so a missing --model fails in one line before the run dir is touched)."""
    if tiny_random:
        return {"model": f"tiny-random {tiny_random}", "model_config": ""}
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ConfigError(f"--model {model}: no checkpoint dir with a config.json there (the trainer loads local "
                          "checkpoints only, never from a hub)")
    return {"model": str(Path(model).resolve()), "model_config": hashlib.sha256(config.read_bytes()).hexdigest()}


def build_model(options: ModelOptions) -> torch.nn.Module:
    """The model `options` name -> fp32 weights on CPU, identical on every rank (same seed; FSDP moves each shard to
    the device), with activation checkpointing, LoRA adapters and a frozen vision tower as asked, in train mode."""
    from transformers import AutoModelForImageTextToText

    o = options
    torch.manual_seed(o.seed)
    if o.tiny_random:
        net = AutoModelForImageTextToText.from_config(tiny_config(o.tiny_random), dtype=torch.float32,
                                                      attn_implementation=o.attn_implementation)
    else:
        try:
            # trust_remote_code=False: a model dir's custom code is refused by transformers, never prompted for
            net = AutoModelForImageTextToText.from_pretrained(o.model, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation=o.attn_implementation,
                                                              trust_remote_code=False)
        except (OSError, ValueError) as e:  # no weights, an unknown model_type, unreadable files
            raise ConfigError(f"--model {o.model}: cannot load the checkpoint: {str(e).splitlines()[0]}") from None
    net.config.use_cache = False
    if o.activation_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    freeze_vision = o.freeze_vision
    if o.lora_rank:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=o.lora_rank, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout,
                                             target_modules=LORA_TARGETS))
        freeze_vision = True
    if freeze_vision:
        for name, p in net.named_parameters():
            if ".visual." in f".{name}":
                p.requires_grad_(False)
    # from_pretrained returns eval mode: dropout off and, since transformers checkpoints only `if self.training`,
    # --activation-checkpointing silently inactive. Training starts in train mode whatever built the model.
    return net.train()


def image_token_id(net: torch.nn.Module) -> int:
    """The model's image placeholder token id."""
    return int(net.config.image_token_id)


def video_token_id(net: torch.nn.Module) -> int:
    """The model's video placeholder token id; -1 when it has none."""
    return int(getattr(net.config, "video_token_id", None) or -1)


def model_type_of(*, model: str, tiny_random: str) -> str:
    """The model type before the weights load (start-up checks): the tiny config's, or the checkpoint's config.json."""
    import json

    if tiny_random:
        return TINY_CONFIGS[tiny_random]["model_type"]
    try:
        return str(json.loads((Path(model) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def apply_fsdp(net: torch.nn.Module, mesh, *, bf16: bool) -> torch.nn.Module:
    """Block classes come from the model's own `_no_split_modules` (vision blocks and decoder layers).
    Gradients are summed, not averaged: the loss is already divided by the global trained-token count."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in net.modules() if type(m).__name__ in block_names]
    assert blocks, f"{type(base).__name__} declares no _no_split_modules: cannot find its blocks to shard"
    for m in blocks:
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    for m in net.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; a factor of 1 needs no scaling
    return net


def forward_loss(net: torch.nn.Module, batch: Batch, pixel_values: torch.Tensor,
                 sources: tuple[torch.Tensor, int] | None = None, pixel_values_videos: torch.Tensor | None = None):
    """Sum (not mean) of the cross-entropy over trained tokens; the caller divides by the global count.
    Logits are computed only at positions whose next token is trained (a 2-D bool logits_to_keep). A packed batch
    goes without attention mask: the model then derives per-sample causal blocks from the resets of position row 0
    (sdpa/eager: a packed-sequence mask; flash_attention_2: varlen cu_seqlens, which needs the single flat row)."""
    labels = batch.labels
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    targets = labels[:, 1:][keep[:, :-1]]
    mask = None if batch.packed else batch.attention_mask
    assert (pixel_values_videos is None) == (len(batch.videos) == 0), \
        f"the batch holds {len(batch.videos)} videos: pass their pixel_values_videos (Patchifier.videos)"
    video = {}
    if pixel_values_videos is not None:
        video = dict(pixel_values_videos=pixel_values_videos, video_grid_thw=batch.video_grid_thw)
        if net.config.model_type == "qwen2_5_vl":  # positions are given, so only get_rope_index would read it
            video["second_per_grid_ts"] = batch.second_per_grid_ts
    out = net(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
              mm_token_type_ids=batch.mm_token_type_ids, pixel_values=pixel_values,
              image_grid_thw=batch.image_grid_thw, logits_to_keep=keep, use_cache=False, **video)
    if sources is None:
        return F.cross_entropy(out.logits.float(), targets, reduction="sum")
    # A mixture also reports loss and trained tokens per dataset: (sum, [S] loss sums, [S] token counts).
    token_source, n = sources
    losses = F.cross_entropy(out.logits.float(), targets, reduction="none")
    src = token_source.to(losses.device)[:, 1:][keep[:, :-1]]
    return (losses.sum(), torch.zeros(n, dtype=torch.float64, device=losses.device).index_add_(0, src, losses.double()),
            torch.bincount(src, minlength=n).double())
