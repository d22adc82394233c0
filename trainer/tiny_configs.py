"""The tiny random configs (`--tiny-random NAME`): every family's real classes with 2 layers and small widths, sized
to the dataset's processor (Vocab): a family's keywords for its config class, model_type included.
"""

from __future__ import annotations

import functools
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


class Tok(str):
    """A token in a tiny config's data: its id in the processor's vocabulary (Vocab.ids) takes its place."""


VOCAB, PAD = object(), object()  # the vocabulary's size, the pad token's id


def _tokens(ids: dict[str, str]) -> dict[str, Tok]:
    return {k: Tok(t) for k, t in ids.items()}


def _resolve(spec, v: Vocab):
    """A config's data with its Tok / VOCAB / PAD placeholders replaced by this vocabulary's values (fresh lists and
    dicts each call: a config object may keep and change them)."""
    if isinstance(spec, dict):
        return {k: _resolve(x, v) for k, x in spec.items()}
    if isinstance(spec, list):
        return [_resolve(x, v) for x in spec]
    if isinstance(spec, Tok):
        return v.ids[spec]
    return v.size if spec is VOCAB else v.pad_id if spec is PAD else spec


_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
_TEXT.update(num_key_value_heads=2, max_position_embeddings=32768, pad_token_id=PAD)
_VIT_WIDTHS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
_VIT = dict(_VIT_WIDTHS, num_attention_heads=2)
_QWEN_VIT = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
_PATCHES_14 = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)  # Qwen2-VL's and GLM-4.1V's
_QWEN_IDS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}
_QWEN_IDS.update(vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
_QWEN = dict(tie_word_embeddings=True, **_tokens(_QWEN_IDS))
_QWEN_TEXT = dict(_TEXT, bos_token_id=Tok("<|endoftext|>"), eos_token_id=Tok("<|im_end|>"))
_LLAMA_TEXT = dict(_TEXT, bos_token_id=Tok("<|begin_of_text|>"))
# Qwen3.5's linear-attention layers, and its 4 experts (2 per token) with a shared expert.
_QWEN3_5_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
_QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# Llama 4: a mixture of experts in every layer (4 experts, 1 per token, and a shared expert).
_LLAMA4_MOE = dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, intermediate_size_mlp=128)
_LLAMA4_ATTENTION = dict(head_dim=16, attention_chunk_size=8192, no_rope_layers=[1, 0])
_LLAMA4_PROJECTOR = dict(vision_output_dim=64, projector_input_dim=64, projector_output_dim=64, pixel_shuffle_ratio=0.5)
# Mllama's vision tower: tiles, global layers, and the intermediate layers' features it hands the text model.
_MLLAMA_TILES = dict(max_num_tiles=4, num_global_layers=1, intermediate_layers_indices=[0], vision_output_dim=64)
_GEMMA3_IDS = {"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>"}
_GEMMA3_IDS.update(eoi_token_index="<end_of_image>")
_GEMMA4_IDS = {"image_token_id": "<|image|>", "boi_token_id": "<|image>", "eoi_token_id": "<image|>"}
_GEMMA4_IDS.update(video_token_id="<|video|>", audio_token_id="<|audio|>", boa_token_id="<|audio>")
_GEMMA4_IDS.update(eoa_token_index="<audio|>")
_GEMMA4_LAYERS = dict(layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=VOCAB)
_GEMMA4_LAYERS.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
_GLM4V_IDS = {"image_token_id": "<|image|>", "video_token_id": "<|video|>"}
_GLM4V_IDS.update(image_start_token_id="<|begin_of_image|>", image_end_token_id="<|end_of_image|>")
_GLM4V_IDS.update(video_start_token_id="<|begin_of_video|>", video_end_token_id="<|end_of_video|>")


def _mrope(section: list[int], **kw) -> dict:
    return {"rope_type": "default", "mrope_section": section, "rope_theta": 1e6, **kw}


# family name (trainer/families.py) -> its tiny config: the config's own keywords, then the text and vision configs
# as their shared base's keywords (_TEXT, _VIT, ...) and the family's differences from it.
_SPECS = {
    "qwen2-vl": (
        dict(_QWEN, model_type="qwen2_vl"),
        dict(_QWEN_TEXT, hidden_size=128, intermediate_size=256, rope_parameters=_mrope([4, 6, 6])),
        dict(_PATCHES_14, depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, in_channels=3),
    ),
    "qwen2.5-vl": (
        dict(_QWEN, model_type="qwen2_5_vl"),
        dict(_QWEN_TEXT, rope_parameters=_mrope([2, 3, 3])),
        dict(_QWEN_VIT, fullatt_block_indexes=[1], window_size=56, patch_size=14, tokens_per_second=2),
    ),
    "qwen3-vl": (
        dict(_QWEN, model_type="qwen3_vl"),
        dict(_QWEN_TEXT, head_dim=16, rope_parameters=_mrope([2, 3, 3], mrope_interleaved=True)),
        dict(_QWEN_VIT, num_position_embeddings=64, deepstack_visual_indexes=[1], patch_size=16),
    ),
    "qwen3.5": (
        dict(_QWEN, model_type="qwen3_5_moe"),
        dict(
            _QWEN_TEXT,
            **_QWEN3_5_LINEAR,
            **_QWEN3_5_MOE,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters=_mrope([2, 1, 1], mrope_interleaved=True, partial_rotary_factor=0.5),
        ),
        dict(_QWEN_VIT, num_position_embeddings=64, patch_size=16),
    ),
    "llama-3.2-vision": (
        dict(model_type="mllama", image_token_index=Tok("<|image|>"), pad_token_id=PAD),
        dict(
            _LLAMA_TEXT,
            num_hidden_layers=3,
            cross_attention_layers=[1],
            eos_token_id=Tok("<|eot_id|>"),
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        ),
        dict(_VIT_WIDTHS, attention_heads=2, image_size=560, patch_size=56, **_MLLAMA_TILES),
    ),
    "llama-4": (
        dict(model_type="llama4", image_token_index=Tok("<|patch|>"), pad_token_id=PAD),
        dict(_LLAMA_TEXT, **_LLAMA4_MOE, **_LLAMA4_ATTENTION, eos_token_id=Tok("<|eot|>")),
        dict(_VIT, intermediate_size=128, image_size=336, patch_size=14, **_LLAMA4_PROJECTOR),
    ),
    "mistral-3": (
        dict(model_type="mistral3", image_token_index=Tok("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1),
        dict(_TEXT, model_type="mistral", head_dim=16, sliding_window=None),
        dict(_VIT, model_type="pixtral", head_dim=16, image_size=1540, patch_size=14),
    ),
    # 896 px images in 56 px patches: 16 x 16 = the 256 soft tokens a Gemma 3 image takes, without pooling.
    "gemma-3": (
        dict(model_type="gemma3", mm_tokens_per_image=256, pad_token_id=PAD, **_tokens(_GEMMA3_IDS)),
        dict(_TEXT, head_dim=16, sliding_window=64, query_pre_attn_scalar=16),
        dict(_VIT, image_size=896, patch_size=56),
    ),
    "gemma-4": (
        dict(model_type="gemma4", audio_config=None, **_tokens(_GEMMA4_IDS)),
        dict(_TEXT, head_dim=16, global_head_dim=16, sliding_window=64, **_GEMMA4_LAYERS),
        dict(_VIT, num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3),
    ),
    "glm-4.1v": (
        dict(model_type="glm4v", **_tokens(_GLM4V_IDS)),
        dict(_TEXT, hidden_size=128, rope_parameters=_mrope([2, 3, 3], rope_theta=1e4, partial_rotary_factor=0.5)),
        dict(_QWEN_VIT, **_PATCHES_14, out_hidden_size=128, image_size=336),
    ),
    "internvl": (
        dict(
            model_type="internvl",
            image_token_id=Tok("<IMG_CONTEXT>"),
            image_seq_length=256,
            downsample_ratio=0.5,
            vision_feature_layer=-1,
        ),
        dict(_TEXT, model_type="qwen2"),
        dict(_VIT, image_size=[448, 448], patch_size=[14, 14]),
    ),
    "llava-onevision": (
        dict(
            model_type="llava_onevision",
            image_token_index=Tok("<image>"),
            video_token_index=Tok("<video>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
        ),
        dict(_TEXT, model_type="qwen2"),
        dict(_VIT, model_type="siglip_vision_model", image_size=384, patch_size=14),
    ),
    # SmolVLM-256M: 512 px tiles in 16 px patches, pixel shuffle 4: 64 tokens a tile.
    "smolvlm": (
        dict(model_type="idefics3", image_token_id=Tok("<image>"), scale_factor=4, pad_token_id=PAD),
        dict(_TEXT, model_type="llama"),
        dict(_VIT, image_size=512, patch_size=16),
    ),
}


def _config(spec: tuple[dict, dict, dict], v: Vocab) -> dict:
    top, text, vision = spec
    return _resolve({**top, "text_config": text, "vision_config": vision}, v)


CONFIGS = {name: functools.partial(_config, spec) for name, spec in _SPECS.items()}


def _toks(spec) -> list[Tok]:
    if isinstance(spec, (dict, tuple, list)):
        return [t for x in (spec.values() if isinstance(spec, dict) else spec) for t in _toks(x)]
    return [spec] if isinstance(spec, Tok) else []


# family name -> the named tokens its tiny config takes ids of, in the config's order (Vocab.of's `tokens`)
TOKENS = {name: tuple(dict.fromkeys(str(t) for t in _toks(spec))) for name, spec in _SPECS.items()}
