"""The model families the trainer trains, one entry each (the place to add the next): which checkpoints (config
model_type) and datasets (processor class) it takes, how its pixel inputs are made from the stored images, what else
its forward takes, whether it routes tokens to experts, its vision tower's parameters; why packing is refused for it
(_NOT_PACKED, where it is); its tiny random config (`--tiny-random NAME`) and the named tokens that takes are in
tiny_configs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.tiny_configs import CONFIGS as TINY_CONFIGS
from trainer.tiny_configs import TOKENS, Vocab


@dataclass(frozen=True, kw_only=True)
class Family:
    """One family as the trainer trains it."""

    name: str  # --tiny-random NAME, as the builtin and tiny processors name it
    model_types: tuple[str, ...]  # checkpoints' config.json model_type
    processor_classes: tuple[str, ...]  # the datasets' processor class (manifest processor.class)
    # "patchify": on the device, Qwen2-VL's pixel math and patch layout (trainer/data/vision.py Patchifier; GLM-4.1V's
    # image processor repeats them); "normalize": on the device, the image processor's rescale + normalize of the
    # stored (resized) images, no patches (Patchifier.normalize; Gemma 3 without pan-and-scan, else as "processor"),
    # the token types on the host; "patches": on the device, the image processor's rescale + normalize, patchify and
    # zero padding of the images the DataLoader workers resized with it, their position ids from the workers
    # (trainer/data/tiles.py; Gemma 4's torchvision backend, else as "processor"); "tiles": likewise Mllama's resize
    # on its canvas of tiles in the workers, with its aspect ratios and cross-attention mask, rescale + normalize and
    # the split into tiles on the device (its torchvision backend, else as "processor");
    # "uint8": the dataset's own image processor on the host with its rescale and normalize off (uint8 pixel_values, a
    # quarter of the bytes), those two on the device (Patchifier.host_math; Llama 4's and InternVL's torchvision
    # backend; Idefics3's / SmolVLM's with its pad off too, padded in uint8 by the workers and normalized on the device
    # under its pixel mask; LLaVA-OneVision's likewise, its padding patches by each image's count; else as
    # "processor"); "processor": the dataset's own image processor on the host
    # (trainer/data/vision.py HostPixels, by vlmprep_schemas.pixels' rule for its class)
    pixels: str = "processor"
    mrope: bool = False  # the stored 3-row positions go to the model (else its own 1-D positions from row 0)
    resized: bool = False  # the stored pixels are the processor's resize: it runs with do_resize=False
    mm_token_type_ids: bool = False  # the forward takes mm_token_type_ids (Qwen, GLM)
    moe: bool = False  # routes tokens to experts: padding is kept out of the router's balance loss
    # parameter-name parts of the vision tower and projector (--freeze-vision, LoRA)
    vision: tuple[str, ...] = ("vision_tower", "multi_modal_projector")
    text: str = "language_model"  # the language model's module name (LoRA's targets are its linear layers)

    @property
    def pack(self) -> str:
        """Why --pack-to is refused for this family (_NOT_PACKED), or "" where it is exact (a packed sample alone)."""
        return _NOT_PACKED.get(self.name, "")

    @property
    def tokens(self) -> tuple[str, ...]:
        """The named tokens the tiny config takes ids of (trainer/tiny_configs.py TOKENS)."""
        return TOKENS[self.name]

    def tiny(self, vocab: Vocab) -> dict:
        """The tiny random config's keywords (model_type included), sized to the dataset's processor's `vocab`."""
        return TINY_CONFIGS[self.name](vocab)

    @property
    def lora_targets(self) -> str:
        """peft's target_modules: the attention and MLP projections of the language model (not the vision tower, not
        the experts' fused weights)."""
        return rf".*{self.text}.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


_VISION_MODEL = ("vision_model", "multi_modal_projector")
_QWEN = dict(pixels="patchify", mrope=True, mm_token_type_ids=True, vision=("visual",))

# Why --pack-to is refused for a family: its packed samples would see each other or share state.
_NOT_PACKED = {
    "qwen3.5": "its linear-attention layers carry state from one packed sample into the next",
    "llama-3.2-vision": "its cross-attention mask is per row, so a packed sample would see another sample's images",
    "llama-4": "its chunked attention is not reset at packed sample boundaries",
    "gemma-3": "its image tokens attend to each other both ways through a mask that packing cannot express",
    "gemma-4": "its vision tokens and per-layer inputs are not verified under packed positions",
}
# A family's fields that differ from Family's defaults.
FAMILIES: tuple[Family, ...] = (
    Family(name="qwen2-vl", model_types=("qwen2_vl",), processor_classes=("Qwen2VLProcessor",), **_QWEN),
    Family(name="qwen2.5-vl", model_types=("qwen2_5_vl",), processor_classes=("Qwen2_5_VLProcessor",), **_QWEN),
    Family(name="qwen3-vl", model_types=("qwen3_vl", "qwen3_vl_moe"), processor_classes=("Qwen3VLProcessor",), **_QWEN),
    Family(
        name="qwen3.5",
        model_types=("qwen3_5_moe", "qwen3_5"),
        processor_classes=("Qwen3VLProcessor",),
        moe=True,
        **_QWEN,
    ),
    Family(
        name="llama-3.2-vision",
        model_types=("mllama",),
        processor_classes=("MllamaProcessor",),
        pixels="tiles",
        vision=_VISION_MODEL,
    ),
    Family(
        name="llama-4",
        model_types=("llama4",),
        processor_classes=("Llama4Processor",),
        pixels="uint8",
        moe=True,
        vision=_VISION_MODEL,
    ),
    Family(name="mistral-3", model_types=("mistral3",), processor_classes=("PixtralProcessor",), resized=True),
    Family(
        name="gemma-3",
        model_types=("gemma3",),
        processor_classes=("Gemma3Processor",),
        resized=True,
        pixels="normalize",
    ),
    Family(
        name="gemma-4",
        model_types=("gemma4",),
        processor_classes=("Gemma4Processor",),
        pixels="patches",
        mm_token_type_ids=True,
        vision=("vision_tower", "embed_vision"),
    ),
    # GLM-4.1V's image processor makes pixel_values with Qwen2-VL's math and patch layout, its forward takes Qwen's
    # inputs (pixel_values, image_grid_thw, mm_token_type_ids, MRoPE positions): it patchifies on the device too.
    Family(name="glm-4.1v", model_types=("glm4v",), processor_classes=("Glm4vProcessor",), **_QWEN),
    Family(name="internvl", model_types=("internvl",), processor_classes=("InternVLProcessor",), pixels="uint8"),
    Family(
        name="llava-onevision",
        model_types=("llava_onevision",),
        processor_classes=("LlavaOnevisionProcessor",),
        pixels="uint8",
    ),
    Family(
        name="smolvlm",
        model_types=("idefics3", "smolvlm"),
        processor_classes=("Idefics3Processor", "SmolVLMProcessor"),
        pixels="uint8",
        vision=("vision_model", "connector"),
        text="text_model",
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}
assert set(BY_NAME) == set(TINY_CONFIGS), "every family has its tiny config in trainer/tiny_configs.py, and only they"
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
