"""The model families the trainer trains, one entry each (the place to add the next): which checkpoints (config
model_type) and datasets (processor class) it takes, how its pixel inputs are made from the stored images, what else
its forward takes, whether packing is exact for it, whether it routes tokens to experts, its vision tower's
parameters, and its tiny random config (`--tiny-random NAME`, sized to the dataset's processor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Tiny models: every family's real class, 2 layers, small widths; the vocabulary and special-token ids are the
# dataset's processor's (Vocab), so token ids, image tokens and the export's processor agree with the shards.


@dataclass(frozen=True)
class Vocab:
    """What a tiny model needs from the processor: its vocabulary size and the ids of named tokens."""

    size: int
    ids: dict[str, int]  # token string -> id (the family's `tokens`)
    pad_id: int

    @classmethod
    def of(cls, processor, tokens: tuple[str, ...]) -> "Vocab":
        """The processor's tokenizer: len() and the id of each of `tokens` (refused when one is not in it)."""
        tok = processor.tokenizer
        ids = {t: tok.convert_tokens_to_ids(t) for t in tokens}
        missing = [t for t, i in ids.items() if i is None or i == tok.unk_token_id and t != tok.unk_token]
        if missing:
            raise ValueError(
                f"the processor's tokenizer has no {', '.join(missing)}: not a {type(processor).__name__} "
                "of this family"
            )
        return cls(size=len(tok), ids=ids, pad_id=int(tok.pad_token_id if tok.pad_token_id is not None else 0))


def _text(v: Vocab, **kw) -> dict:
    d = dict(
        vocab_size=v.size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        pad_token_id=v.pad_id,
    )
    d.update(kw)
    return d


def _mrope(section: list[int], **kw) -> dict:
    return {"rope_type": "default", "mrope_section": section, "rope_theta": 1e6, **kw}


def _qwen_ids(v: Vocab) -> dict:
    return dict(
        image_token_id=v.ids["<|image_pad|>"],
        video_token_id=v.ids["<|video_pad|>"],
        vision_start_token_id=v.ids["<|vision_start|>"],
        vision_end_token_id=v.ids["<|vision_end|>"],
    )


def _qwen_text(v: Vocab, **kw) -> dict:
    return _text(v, bos_token_id=v.ids["<|endoftext|>"], eos_token_id=v.ids["<|im_end|>"], **kw)


_QWEN_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>", "<|im_end|>")


def _qwen2_vl(v: Vocab) -> dict:
    return dict(
        model_type="qwen2_vl",
        tie_word_embeddings=True,
        **_qwen_ids(v),
        text_config=_qwen_text(v, hidden_size=128, intermediate_size=256, rope_parameters=_mrope([4, 6, 6])),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=128,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
    )


def _qwen2_5_vl(v: Vocab) -> dict:
    return dict(
        model_type="qwen2_5_vl",
        tie_word_embeddings=True,
        **_qwen_ids(v),
        text_config=_qwen_text(v, rope_parameters=_mrope([2, 3, 3])),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            window_size=56,
            patch_size=14,
            tokens_per_second=2,
        ),
    )


def _qwen3_vl(v: Vocab) -> dict:
    return dict(
        model_type="qwen3_vl",
        tie_word_embeddings=True,
        **_qwen_ids(v),
        text_config=_qwen_text(v, head_dim=16, rope_parameters=_mrope([2, 3, 3], mrope_interleaved=True)),
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
    )


def _qwen3_5(v: Vocab) -> dict:
    # Qwen3.5-MoE: linear-attention and full-attention layers, 4 experts (2 per token) and a shared expert.
    return dict(
        model_type="qwen3_5_moe",
        tie_word_embeddings=True,
        **_qwen_ids(v),
        text_config=_qwen_text(
            v,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            rope_parameters=_mrope([2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            patch_size=16,
        ),
    )


def _mllama(v: Vocab) -> dict:
    return dict(
        model_type="mllama",
        image_token_index=v.ids["<|image|>"],
        pad_token_id=v.pad_id,
        text_config=_text(
            v,
            num_hidden_layers=3,
            cross_attention_layers=[1],
            bos_token_id=v.ids["<|begin_of_text|>"],
            eos_token_id=v.ids["<|eot_id|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=2,
            image_size=560,
            patch_size=56,
            max_num_tiles=4,
            intermediate_layers_indices=[0],
            vision_output_dim=64,
        ),
    )


def _llama4(v: Vocab) -> dict:
    # The text model is a mixture of experts in every layer (4 experts, 1 per token, and a shared expert).
    return dict(
        model_type="llama4",
        image_token_index=v.ids["<|patch|>"],
        pad_token_id=v.pad_id,
        text_config=_text(
            v,
            intermediate_size_mlp=128,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 0],
            attention_chunk_size=8192,
            bos_token_id=v.ids["<|begin_of_text|>"],
            eos_token_id=v.ids["<|eot|>"],
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=336,
            patch_size=14,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
            pixel_shuffle_ratio=0.5,
        ),
    )


def _mistral3(v: Vocab) -> dict:
    return dict(
        model_type="mistral3",
        image_token_index=v.ids["[IMG]"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        text_config=dict(model_type="mistral", **_text(v, head_dim=16, sliding_window=None)),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=16,
            image_size=1540,
            patch_size=14,
        ),
    )


def _gemma3(v: Vocab) -> dict:
    # 896 px images in 56 px patches: 16 x 16 = the 256 soft tokens a Gemma 3 image takes, without pooling.
    return dict(
        model_type="gemma3",
        mm_tokens_per_image=256,
        pad_token_id=v.pad_id,
        image_token_index=v.ids["<image_soft_token>"],
        boi_token_index=v.ids["<start_of_image>"],
        eoi_token_index=v.ids["<end_of_image>"],
        text_config=_text(v, head_dim=16, sliding_window=64, query_pre_attn_scalar=16),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=896,
            patch_size=56,
        ),
    )


def _gemma4(v: Vocab) -> dict:
    return dict(
        model_type="gemma4",
        audio_config=None,
        image_token_id=v.ids["<|image|>"],
        boi_token_id=v.ids["<|image>"],
        eoi_token_id=v.ids["<image|>"],
        video_token_id=v.ids["<|video|>"],
        audio_token_id=v.ids["<|audio|>"],
        boa_token_id=v.ids["<|audio>"],
        eoa_token_index=v.ids["<audio|>"],
        text_config=_text(
            v,
            head_dim=16,
            global_head_dim=16,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            vocab_size_per_layer_input=v.size,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=16,
            pooling_kernel_size=3,
        ),
    )


def _glm4v(v: Vocab) -> dict:
    return dict(
        model_type="glm4v",
        image_token_id=v.ids["<|image|>"],
        video_token_id=v.ids["<|video|>"],
        image_start_token_id=v.ids["<|begin_of_image|>"],
        image_end_token_id=v.ids["<|end_of_image|>"],
        video_start_token_id=v.ids["<|begin_of_video|>"],
        video_end_token_id=v.ids["<|end_of_video|>"],
        text_config=_text(
            v, hidden_size=128, rope_parameters=_mrope([2, 3, 3], rope_theta=1e4, partial_rotary_factor=0.5)
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=128,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            image_size=336,
        ),
    )


def _internvl(v: Vocab) -> dict:
    return dict(
        model_type="internvl",
        image_token_id=v.ids["<IMG_CONTEXT>"],
        image_seq_length=256,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        text_config=dict(model_type="qwen2", **_text(v)),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=[448, 448],
            patch_size=[14, 14],
        ),
    )


def _llava_onevision(v: Vocab) -> dict:
    return dict(
        model_type="llava_onevision",
        image_token_index=v.ids["<image>"],
        video_token_index=v.ids["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        text_config=dict(model_type="qwen2", **_text(v)),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=384,
            patch_size=14,
        ),
    )


def _smolvlm(v: Vocab) -> dict:
    # SmolVLM-256M: 512 px tiles in 16 px patches, pixel shuffle 4: 64 tokens a tile.
    return dict(
        model_type="idefics3",
        image_token_id=v.ids["<image>"],
        scale_factor=4,
        pad_token_id=v.pad_id,
        text_config=dict(model_type="llama", **_text(v)),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=512,
            patch_size=16,
        ),
    )


@dataclass(frozen=True, kw_only=True)
class Family:
    """One family as the trainer trains it."""

    name: str  # --tiny-random NAME, as the builtin and tiny processors name it
    model_types: tuple[str, ...]  # checkpoints' config.json model_type
    processor_classes: tuple[str, ...]  # the datasets' processor class (manifest processor.class)
    tiny: Callable[[Vocab], dict]  # the tiny random config's keywords (model_type included)
    tokens: tuple[str, ...]  # the named tokens the tiny config takes ids of
    # "patchify": on the device, Qwen2-VL's patch layout (trainer/data/vision.py Patchifier); "processor": the dataset's
    # own image processor on the host (trainer/data/vision.py HostPixels, by vlmprep_schemas.pixels' rule for its class)
    pixels: str = "processor"
    mrope: bool = False  # the stored 3-row positions go to the model (else its own 1-D positions from row 0)
    resized: bool = False  # the stored pixels are the processor's resize: it runs with do_resize=False
    mm_token_type_ids: bool = False  # the forward takes mm_token_type_ids (Qwen, GLM)
    pack: str = ""  # "": --pack-to is exact (each packed sample's logits equal it alone); else why it is refused
    moe: bool = False  # routes tokens to experts: padding is kept out of the router's balance loss
    vision: tuple[str, ...] = ()  # parameter-name parts of the vision tower and projector (--freeze-vision, LoRA)
    text: str = "language_model"  # the language model's module name (LoRA's targets are its linear layers)

    @property
    def lora_targets(self) -> str:
        """peft's target_modules: the attention and MLP projections of the language model (not the vision tower, not
        the experts' fused weights)."""
        return rf".*{self.text}.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


_QWEN = dict(pixels="patchify", mrope=True, mm_token_type_ids=True, tokens=_QWEN_TOKENS, vision=("visual",))

FAMILIES: tuple[Family, ...] = (
    Family(
        name="qwen2-vl", model_types=("qwen2_vl",), processor_classes=("Qwen2VLProcessor",), tiny=_qwen2_vl, **_QWEN
    ),
    Family(
        name="qwen2.5-vl",
        model_types=("qwen2_5_vl",),
        processor_classes=("Qwen2_5_VLProcessor",),
        tiny=_qwen2_5_vl,
        **_QWEN,
    ),
    Family(
        name="qwen3-vl",
        model_types=("qwen3_vl", "qwen3_vl_moe"),
        processor_classes=("Qwen3VLProcessor",),
        tiny=_qwen3_vl,
        **_QWEN,
    ),
    Family(
        name="qwen3.5",
        model_types=("qwen3_5_moe", "qwen3_5"),
        processor_classes=("Qwen3VLProcessor",),
        tiny=_qwen3_5,
        moe=True,
        pack="its linear-attention layers carry state from one packed sample into the next",
        **_QWEN,
    ),
    Family(
        name="llama-3.2-vision",
        model_types=("mllama",),
        processor_classes=("MllamaProcessor",),
        tiny=_mllama,
        tokens=("<|image|>", "<|begin_of_text|>", "<|eot_id|>"),
        vision=("vision_model", "multi_modal_projector"),
        pack="its cross-attention mask is per row, so a packed sample would see another sample's images",
    ),
    Family(
        name="llama-4",
        model_types=("llama4",),
        processor_classes=("Llama4Processor",),
        tiny=_llama4,
        tokens=("<|patch|>", "<|begin_of_text|>", "<|eot|>"),
        moe=True,
        vision=("vision_model", "multi_modal_projector"),
        pack="its chunked attention is not reset at packed sample boundaries",
    ),
    Family(
        name="mistral-3",
        model_types=("mistral3",),
        processor_classes=("PixtralProcessor",),
        tiny=_mistral3,
        tokens=("[IMG]",),
        resized=True,
        vision=("vision_tower", "multi_modal_projector"),
    ),
    Family(
        name="gemma-3",
        model_types=("gemma3",),
        processor_classes=("Gemma3Processor",),
        tiny=_gemma3,
        tokens=("<image_soft_token>", "<start_of_image>", "<end_of_image>"),
        resized=True,
        vision=("vision_tower", "multi_modal_projector"),
        pack="its image tokens attend to each other both ways through a mask that packing cannot express",
    ),
    Family(
        name="gemma-4",
        model_types=("gemma4",),
        processor_classes=("Gemma4Processor",),
        tiny=_gemma4,
        tokens=("<|image|>", "<|image>", "<image|>", "<|video|>", "<|audio|>", "<|audio>", "<audio|>"),
        mm_token_type_ids=True,
        vision=("vision_tower", "embed_vision"),
        pack="its vision tokens and per-layer inputs are not verified under packed positions",
    ),
    Family(
        name="glm-4.1v",
        model_types=("glm4v",),
        processor_classes=("Glm4vProcessor",),
        tiny=_glm4v,
        tokens=(
            "<|image|>",
            "<|video|>",
            "<|begin_of_image|>",
            "<|end_of_image|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
        ),
        mrope=True,
        resized=True,
        mm_token_type_ids=True,
        vision=("visual",),
    ),
    Family(
        name="internvl",
        model_types=("internvl",),
        processor_classes=("InternVLProcessor",),
        tiny=_internvl,
        tokens=("<IMG_CONTEXT>",),
        vision=("vision_tower", "multi_modal_projector"),
    ),
    Family(
        name="llava-onevision",
        model_types=("llava_onevision",),
        processor_classes=("LlavaOnevisionProcessor",),
        tiny=_llava_onevision,
        tokens=("<image>", "<video>"),
        vision=("vision_tower", "multi_modal_projector"),
    ),
    Family(
        name="smolvlm",
        model_types=("idefics3", "smolvlm"),
        processor_classes=("Idefics3Processor", "SmolVLMProcessor"),
        tiny=_smolvlm,
        tokens=("<image>",),
        vision=("vision_model", "connector"),
        text="text_model",
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}
TINY_NAMES = tuple(BY_NAME)


def family_of_model(model_type: str) -> Family | None:
    """The family that trains checkpoints of this config model_type, or None."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family_of_processor(processor_class: str) -> Family | None:
    """The first family whose datasets this processor class renders (Qwen3-VL and Qwen3.5 share one), or None."""
    return next((f for f in FAMILIES if processor_class in f.processor_classes), None)


def supported_models() -> str:
    """The model types the trainer trains, for messages."""
    return ", ".join(t for f in FAMILIES for t in f.model_types)


def packing_refusal(model_type: str) -> str | None:
    """The one line refusing --pack-to for this model type's family (where packed samples would see each other or
    share state), or None where packing is exact."""
    family = family_of_model(model_type)
    if family is None or not family.pack:
        return None
    packs = ", ".join(f.name for f in FAMILIES if not f.pack)
    return (
        f"--pack-to: {family.name} ({model_type}) cannot be packed exactly ({family.pack}); train it without "
        f"--pack-to (families that pack: {packs})"
    )
