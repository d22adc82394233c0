"""The tiny random configs (`--tiny-random NAME`): every family's real classes with 2 layers and small widths, sized
to the dataset's processor (Vocab): a family's keywords for its config class, model_type included.
"""

from __future__ import annotations

from dataclasses import dataclass

# The vocabulary and special-token ids are the dataset's processor's (Vocab), so token ids, image tokens and the
# export's processor agree with the shards.


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


def _vit(**kw) -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **kw)


def _qwen_vit(**kw) -> dict:
    return {**dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64), **kw}


def _qwen_ids(v: Vocab) -> dict:
    return dict(
        image_token_id=v.ids["<|image_pad|>"],
        video_token_id=v.ids["<|video_pad|>"],
        vision_start_token_id=v.ids["<|vision_start|>"],
        vision_end_token_id=v.ids["<|vision_end|>"],
    )


def _qwen_text(v: Vocab, **kw) -> dict:
    return _text(v, bos_token_id=v.ids["<|endoftext|>"], eos_token_id=v.ids["<|im_end|>"], **kw)


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
        vision_config=_qwen_vit(fullatt_block_indexes=[1], window_size=56, patch_size=14, tokens_per_second=2),
    )


def _qwen3_vl(v: Vocab) -> dict:
    return dict(
        model_type="qwen3_vl",
        tie_word_embeddings=True,
        **_qwen_ids(v),
        text_config=_qwen_text(v, head_dim=16, rope_parameters=_mrope([2, 3, 3], mrope_interleaved=True)),
        vision_config=_qwen_vit(num_position_embeddings=64, deepstack_visual_indexes=[1], patch_size=16),
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
        vision_config=_qwen_vit(num_position_embeddings=64, patch_size=16),
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
        vision_config=_vit(model_type="pixtral", head_dim=16, image_size=1540, patch_size=14),
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
        vision_config=_vit(image_size=896, patch_size=56),
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
        vision_config=_vit(num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3),
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
        vision_config=_qwen_vit(
            out_hidden_size=128, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=336
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
        vision_config=_vit(image_size=[448, 448], patch_size=[14, 14]),
    )


def _llava_onevision(v: Vocab) -> dict:
    return dict(
        model_type="llava_onevision",
        image_token_index=v.ids["<image>"],
        video_token_index=v.ids["<video>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        text_config=dict(model_type="qwen2", **_text(v)),
        vision_config=_vit(model_type="siglip_vision_model", image_size=384, patch_size=14),
    )


def _smolvlm(v: Vocab) -> dict:
    # SmolVLM-256M: 512 px tiles in 16 px patches, pixel shuffle 4: 64 tokens a tile.
    return dict(
        model_type="idefics3",
        image_token_id=v.ids["<image>"],
        scale_factor=4,
        pad_token_id=v.pad_id,
        text_config=dict(model_type="llama", **_text(v)),
        vision_config=_vit(image_size=512, patch_size=16),
    )


# family name (trainer/families.py) -> its tiny config's keywords
CONFIGS = {
    "qwen2-vl": _qwen2_vl,
    "qwen2.5-vl": _qwen2_5_vl,
    "qwen3-vl": _qwen3_vl,
    "qwen3.5": _qwen3_5,
    "llama-3.2-vision": _mllama,
    "llama-4": _llama4,
    "mistral-3": _mistral3,
    "gemma-3": _gemma3,
    "gemma-4": _gemma4,
    "glm-4.1v": _glm4v,
    "internvl": _internvl,
    "llava-onevision": _llava_onevision,
    "smolvlm": _smolvlm,
}
