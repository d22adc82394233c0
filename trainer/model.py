"""The model: an HF AutoModelForImageTextToText (checkpoint dir or a tiny random config) -> optional LoRA and
activation checkpointing -> FSDP2 (each vision block and decoder layer, then the root) -> summed token loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.config import ConfigError
from trainer.data import IGNORE_INDEX, Batch, CollateSpec, RunData, host_pixels, load_processor, trains_videos
from trainer.families import BY_NAME, Family, Vocab, family_of_model, supported_models
from trainer.options import ModelOptions

# --tiny-random qwen2-vl without a processor to size it (tests, the docs' quick checks): Qwen2-VL's own vocabulary
# (the checkpoint's 151936 rows) and token ids.
QWEN2_VL_VOCAB = Vocab(
    size=151936,
    ids={
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
        "<|vision_start|>": 151652,
        "<|vision_end|>": 151653,
        "<|endoftext|>": 151643,
        "<|im_end|>": 151645,
    },
    pad_id=0,
)


def tiny_config(name: str, vocab: Vocab | None = None):
    """The transformers config of a named tiny random-init model (--tiny-random NAME, trainer/families.py): the
    family's real class, sized to `vocab` (the dataset's processor's)."""
    from transformers import AutoConfig

    if vocab is None:
        if name != "qwen2-vl":
            raise ValueError(f"--tiny-random {name}: its vocabulary comes from the dataset's processor")
        vocab = QWEN2_VL_VOCAB
    kw = BY_NAME[name].tiny(vocab)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def tiny_vocab(name: str, processor_dir: str | None) -> Vocab | None:
    """The vocabulary `--tiny-random NAME` takes from the dataset's processor (a local dir); None without one."""
    if not name or not processor_dir:
        return None
    processor = load_processor(processor_dir)
    try:
        vocab = Vocab.of(processor, BY_NAME[name].tokens)
    except ValueError as e:
        raise ConfigError(
            f"--tiny-random {name}: {e} (the dataset was built for another family: pass the "
            f"--tiny-random of its family)"
        ) from None
    if (
        name == "qwen2-vl"
        and vocab.size <= QWEN2_VL_VOCAB.size
        and all(vocab.ids.get(t) == i for t, i in QWEN2_VL_VOCAB.ids.items())
    ):
        # The real Qwen vocabulary: the published config's padded embedding (151936 rows), as Qwen2-VL checkpoints
        # have it and as every Qwen2-VL run and test before the other families has been sized.
        return QWEN2_VL_VOCAB
    return vocab


def model_identity(*, model: str, tiny_random: str, vocab: Vocab | None = None) -> dict:
    """What a checkpoint's weights started from: the tiny config's name and vocabulary, or the checkpoint dir and its
    config.json hash (checked here, so a missing --model fails in one line before the run dir is touched)."""
    if tiny_random:  # the vocabulary it was sized to, which `trainer export` rebuilds it with
        sized = (
            {}
            if vocab is None
            else {"tiny_vocab": {"size": vocab.size, "ids": dict(sorted(vocab.ids.items())), "pad_id": vocab.pad_id}}
        )
        return {"model": f"tiny-random {tiny_random}", "model_config": "", **sized}
    config = Path(model) / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"--model {model}: no checkpoint dir with a config.json there (the trainer loads local "
            "checkpoints only, never from a hub)"
        )
    return {"model": str(Path(model).resolve()), "model_config": hashlib.sha256(config.read_bytes()).hexdigest()}


def build_model(options: ModelOptions, vocab: Vocab | None = None) -> torch.nn.Module:
    """The model `options` name -> fp32 weights on CPU, identical on every rank (same seed; FSDP moves each shard to
    the device), with activation checkpointing, LoRA adapters and a frozen vision tower as asked, in train mode.
    `vocab`: what a tiny random model is sized to (tiny_vocab)."""
    from transformers import AutoModelForImageTextToText

    o = options
    torch.manual_seed(o.seed)
    if o.tiny_random:
        net = AutoModelForImageTextToText.from_config(
            tiny_config(o.tiny_random, vocab), dtype=torch.float32, attn_implementation=o.attn_implementation
        )
    else:
        try:
            # trust_remote_code=False: a model dir's custom code is refused by transformers, never prompted for
            net = AutoModelForImageTextToText.from_pretrained(
                o.model,
                local_files_only=True,
                dtype=torch.float32,
                attn_implementation=o.attn_implementation,
                trust_remote_code=False,
            )
        except (OSError, ValueError) as e:  # no weights, an unknown model_type, unreadable files
            raise ConfigError(f"--model {o.model}: cannot load the checkpoint: {str(e).splitlines()[0]}") from None
    net.config.use_cache = False
    if o.activation_checkpointing:
        net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    family = model_family(net)
    freeze_vision = o.freeze_vision
    if o.lora_rank:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(
            net,
            LoraConfig(
                r=o.lora_rank, lora_alpha=o.lora_alpha, lora_dropout=o.lora_dropout, target_modules=family.lora_targets
            ),
        )
        freeze_vision = True
    if freeze_vision:
        for name, p in net.named_parameters():
            if any(f".{part}." in f".{name}" for part in family.vision):
                p.requires_grad_(False)
    # from_pretrained returns eval mode: dropout off and, since transformers checkpoints only `if self.training`,
    # --activation-checkpointing silently inactive. Training starts in train mode whatever built the model.
    return net.train()


def model_family(net: torch.nn.Module) -> Family:
    """The family that trains this model (by its config's model_type); a model of none is refused in one line."""
    model_type = str(net.config.model_type)
    family = family_of_model(model_type)
    if family is None:
        raise ConfigError(f"model type {model_type!r} is not one this trainer trains ({supported_models()})")
    return family


def image_token_id(net: torch.nn.Module) -> int:
    """The model's image placeholder token id (the token its image features replace)."""
    cfg = net.config
    return int(
        getattr(cfg, "image_token_id", None)
        if getattr(cfg, "image_token_id", None) is not None
        else cfg.image_token_index
    )


def pad_token_id(net: torch.nn.Module) -> int:
    """The id padding gets: the text model's pad token where its config names one inside the vocabulary (a
    composite config's own may be a default outside it: Idefics3's 128002), else 0. Padding is never attended to or
    trained, so any id in the vocabulary gives the same loss."""
    text = getattr(net.config, "text_config", None) or net.config
    for cfg in (text, net.config):
        pad = getattr(cfg, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < int(text.vocab_size):
            return pad
    return 0


def video_token_id(net: torch.nn.Module) -> int:
    """The model's video placeholder token id; -1 when it has none."""
    return int(getattr(net.config, "video_token_id", None) or -1)


def model_type_of(*, model: str, tiny_random: str) -> str:
    """The model type before the weights load (start-up checks): the tiny config's, or the checkpoint's config.json."""
    import json

    if tiny_random:
        return BY_NAME[tiny_random].model_types[0]
    try:
        return str(json.loads((Path(model) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def apply_fsdp(net: torch.nn.Module, mesh, *, bf16: bool) -> torch.nn.Module:
    """Block classes come from the model's own `_no_split_modules` (vision blocks and decoder layers).
    Gradients are summed, not averaged: the loss is already divided by the global trained-token count."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
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


def model_inputs(
    net: torch.nn.Module,
    batch: Batch,
    pixel_values: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None = None,
) -> dict:
    """The forward's keyword arguments for `batch` as its family takes them: positions (the stored 3-D MRoPE rows, or
    the 1-D text positions of row 0, which restart per packed sample), the image inputs (Qwen's and GLM's patchified,
    Gemma 3's normalized, Gemma 4's patchified and padded and Mllama's tiled on the device, `pixel_values`; every
    other family's made on the host, `batch.vision`) and the family's extras (`batch.vision` too: Gemma's
    token_type_ids and Gemma 4's image_position_ids, Mllama's aspect ratios and cross-attention mask)."""
    family = model_family(net)
    kw = dict(
        input_ids=batch.input_ids,
        attention_mask=None if batch.packed else batch.attention_mask,
        position_ids=batch.position_ids if family.mrope else batch.position_ids[0],
        use_cache=False,
    )
    if family.mm_token_type_ids:
        kw["mm_token_type_ids"] = batch.mm_token_type_ids
    if family.pixels != "patchify":  # the host's inputs, and pixel_values where the device normalized them
        host = {k: v for k, v in batch.vision.items() if not k.startswith("_")}  # "_": the device's alone
        return {**kw, **host, **({} if pixel_values is None else {"pixel_values": pixel_values})}
    assert (pixel_values_videos is None) == (len(batch.videos) == 0), (
        f"the batch holds {len(batch.videos)} videos: pass their pixel_values_videos (Patchifier.videos)"
    )
    kw.update(pixel_values=pixel_values, image_grid_thw=batch.image_grid_thw)
    if pixel_values_videos is not None:
        kw.update(pixel_values_videos=pixel_values_videos, video_grid_thw=batch.video_grid_thw)
        if net.config.model_type == "qwen2_5_vl":  # positions are given, so only get_rope_index would read it
            kw["second_per_grid_ts"] = batch.second_per_grid_ts
    return kw


def _balance_loss_of(net: torch.nn.Module):
    """The router's balance loss the model trains, as its config asks (output_router_logits) and its own module
    computes it (load_balancing_loss_func; families without one, Llama 4's, train none): (text config, function), or
    None."""
    import importlib

    cfg = net.config
    text = getattr(cfg, "text_config", None) or cfg
    if not getattr(text, "output_router_logits", False):
        return None
    from torch.distributed.fsdp import FSDPModule

    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    # fully_shard swaps the root's class for a subclass defined in torch's FSDP module: the model's own class is
    # the first one in the MRO that FSDP did not make (looked up on the wrapper, the loss was silently never added).
    cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    fn = getattr(importlib.import_module(cls.__module__), "load_balancing_loss_func", None)
    return (text, fn) if fn is not None else None


def routes_experts(net: torch.nn.Module) -> bool:
    """Whether the model routes tokens to experts: it holds a module of a class that transformers records as a
    router (a `router_logits` output), in whatever family or text backbone (a Gemma 4 without its MoE block has
    none)."""
    routers = set()
    for m in net.modules():
        rec = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        if rec is not None:
            routers.add(getattr(rec, "target_class", rec))
    return any(isinstance(m, tuple(routers)) for m in net.modules()) if routers else False


def routed_line(positions: int, real: float, net: torch.nn.Module) -> str | None:
    """Step 1's line for a model that routes tokens to experts (None for one that does not): how many of the token
    positions its routers saw (all ranks, each MoE layer) hold no sample token (padding, a placeholder image) and
    what lowers that."""
    if not routes_experts(net):
        return None
    waste = positions - int(real)
    fix = "a smaller --micro-batch-size lowers it" + (
        "" if model_family(net).pack else ", --pack-to removes most of it"
    )
    return (
        f"trainer: step 1 routed {positions} token positions through each MoE layer's experts, {waste} "
        f"({waste / max(positions, 1):.1%}) of them padding or a placeholder image: expert compute that trains "
        f"nothing (the balance loss leaves them out); {fix}"
    )


def balance_loss(net: torch.nn.Module, router_logits, real: torch.Tensor) -> torch.Tensor:
    """The model's own load-balancing loss over the tokens `real` marks (B x L: not padding, not a placeholder
    image), as its forward computes it with the attention mask, the filler left out too."""
    text, fn = _balance_loss_of(net)
    experts = getattr(text, "num_experts", None) or text.num_local_experts
    return fn(router_logits, experts, text.num_experts_per_tok, real.long())


def forward_loss(
    net: torch.nn.Module,
    batch: Batch,
    pixel_values: torch.Tensor | None,
    sources: tuple[torch.Tensor, int] | None = None,
    pixel_values_videos: torch.Tensor | None = None,
):
    """Sum (not mean) of the cross-entropy over trained tokens; the caller divides by the global count. Where the
    model's config trains its router's balance loss (output_router_logits), router_aux_loss_coef x that loss x this
    micro-batch's trained tokens is added, so a single micro-batch's mean is the model's own loss; padding and
    placeholder tokens are kept out of it. Logits are computed only at positions whose next token is trained (a 2-D
    bool logits_to_keep). A packed batch goes without attention mask: the model then derives per-sample causal
    blocks from the resets of position row 0 (sdpa/eager: a packed-sequence mask; flash_attention_2: varlen
    cu_seqlens, which needs the single flat row)."""
    labels = batch.labels
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    targets = labels[:, 1:][keep[:, :-1]]
    kw = model_inputs(net, batch, pixel_values, pixel_values_videos)
    router = _balance_loss_of(net)
    out = net(**kw, logits_to_keep=keep, **({"output_router_logits": True} if router is not None else {}))
    losses = F.cross_entropy(out.logits.float(), targets, reduction="none")
    total = losses.sum()
    if router is not None:
        aux = balance_loss(net, out.router_logits, batch.real)
        total = total + router[0].router_aux_loss_coef * aux * len(targets)
    if sources is None:
        return total
    # A mixture also reports loss and trained tokens per dataset: (sum, [S] loss sums, [S] token counts).
    token_source, n = sources
    src = token_source.to(losses.device)[:, 1:][keep[:, :-1]]
    return (
        total,
        torch.zeros(n, dtype=torch.float64, device=losses.device).index_add_(0, src, losses.double()),
        torch.bincount(src, minlength=n).double(),
    )


def collate_spec_of(net: torch.nn.Module, data: RunData, processor: str | None) -> CollateSpec:
    """What collate needs from the model and the processor: pad and placeholder ids, patch and merge size, whether
    the run trains video, and for a family whose pixel inputs the host makes (Gemma 3's normalized on the device:
    its token types; Gemma 4's patchified there: its resize and position ids; Mllama's tiled there: its resize,
    aspect ratios and cross-attention mask), its pixel maker and placeholder tokens."""
    spec, family = data.image, model_family(net)
    base = CollateSpec(
        pad_id=pad_token_id(net),
        image_token_id=image_token_id(net),
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        video_token_id=video_token_id(net),
        videos=trains_videos(data.datasets, str(net.config.model_type)),
        vocab_size=int(getattr(net.get_input_embeddings(), "num_embeddings", 0)),
    )
    if family.pixels == "patchify":
        return base
    if processor is None:
        raise ConfigError(f"{family.name} needs its processor to make pixel inputs: pass --processor DIR")
    host, placeholder, size = host_pixels(family, processor, spec, image_token_id(net))
    return dataclasses.replace(base, host=host, placeholder=placeholder, placeholder_size=size)
