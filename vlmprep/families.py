"""Model families, the one registry every component reads (render, images, truncate, verify, inspect): what vlmprep
must know about a processor beyond its own code (turn tokens, image wrapper tokens, position scheme, image
storage), keyed by processor class.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from vlmprep.config import ROLES


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """The family facts render needs; placeholders and their expansion always come from the processor itself."""

    name: str
    processor_class: str
    end_of_turn: tuple[str, ...]  # tokens that close a turn; the one right after a trained turn is its EOS
    wrapper_open: tuple[str, ...] = ()  # template tokens right before the expansion that belong to the image unit
    wrapper_close: tuple[str, ...] = ()
    positions: str = "1d"  # "mrope": 3-D rope ids as the model's get_rope_index; "1d": arange on all 3 rows
    # How images.prepare_image stores pixels (vlmprep_schemas.resize): a resize that the processor then runs with its
    # resize off, or "source": the processor resizes at train time (the stored image is the source, or for a
    # FIXED_POINT_MODES processor its resize where that resize leaves it as it is).
    image_mode: str = "source"
    string_content: bool = False  # template prints content as a string: text-only messages are passed as one
    role_markers: dict[str, tuple[str, str]] = field(default_factory=dict)  # --role-boundaries: role -> (start, end)
    # Tokens that open a turn, for views: "next" = the role is the first word after the token, else the role itself.
    turn_starts: dict[str, str] = field(default_factory=dict)
    # Tokens that end a turn where the next opens with no token of its own (SmolVLM: `<end_of_utterance>`, then
    # `\nAssistant:`): a view starts a message after each, its role the first word of the text that follows.
    turn_ends: tuple[str, ...] = ()
    tool_call_tokens: tuple[str, ...] = ()  # control tokens that open a turn's tool calls (trained with the calls)
    # Video parts (vlmprep/pixels/videos.py), None: rejected as unsupported_video. "qwen2": one run per video, temporal
    # rope ids step 1; "qwen2.5": step tokens_per_second * second_per_grid_t; "qwen3": timestamp text before each
    # temporal patch, each its own run.
    video: str | None = None
    tokens_per_second: int = 2  # Qwen2.5-VL vision_config.tokens_per_second of every published checkpoint
    # The chat templates bundled for the family (vlmprep/templates/NAME.jinja): where a reject can name another.
    templates: tuple[str, ...] = ()

    @property
    def grid_images(self) -> bool:
        """Image k is stored at grid_thw[k] * patch pixels and takes prod(grid_thw[k]) / merge^2 placeholders."""
        return self.image_mode.startswith("smart_resize")


def _turns(start: str, *ends: str) -> dict:
    """A family whose turns open with `start` then the role's name, and close with one of `ends`."""
    return dict(turn_starts={start: "next"}, end_of_turn=ends)


_CHATML = _turns("<|im_start|>", "<|im_end|>")
_QWEN = dict(
    _CHATML,
    wrapper_open=("<|vision_start|>",),
    wrapper_close=("<|vision_end|>",),
    positions="mrope",
    image_mode="smart_resize",
)
_QWEN2 = dict(_QWEN, templates=("qwen2_vl", "qwen2_vl_tools"))
_QWEN3 = dict(_QWEN, templates=("qwen3_vl", "qwen3_5"))

FAMILIES: dict[str, FamilySpec] = {
    s.processor_class: s
    for s in (
        FamilySpec(name="qwen2-vl", processor_class="Qwen2VLProcessor", video="qwen2", **_QWEN2),
        FamilySpec(name="qwen2.5-vl", processor_class="Qwen2_5_VLProcessor", video="qwen2.5", **_QWEN2),
        # Qwen3.5 / 3.6 load through the same processor class; only the tokenizer and template differ.
        FamilySpec(name="qwen3-vl", processor_class="Qwen3VLProcessor", video="qwen3", **_QWEN3),
        FamilySpec(
            name="glm-4.1v",
            processor_class="Glm4vProcessor",
            end_of_turn=("<|user|>", "<|observation|>", "<|endoftext|>"),
            wrapper_open=("<|begin_of_image|>",),
            wrapper_close=("<|end_of_image|>",),
            positions="mrope",
            image_mode="smart_resize_temporal",
            string_content=True,
            templates=("glm4v",),
            turn_starts={
                "<|system|>": "system",
                "<|user|>": "user",
                "<|assistant|>": "assistant",
                "<|observation|>": "tool",
            },
        ),
        FamilySpec(
            name="gemma3",
            processor_class="Gemma3Processor",
            image_mode="fixed_resize",
            templates=("gemma3",),
            **_turns("<start_of_turn>", "<end_of_turn>"),
        ),
        # Gemma 4: `<|turn>role ... <turn|>` turns; images resized by its processor at train time (aspect kept, a patch
        # budget): stored after that resize where it is a fixed point (vlmprep_schemas.resize), else as the source.
        FamilySpec(
            name="gemma4", processor_class="Gemma4Processor", templates=("gemma4",), **_turns("<|turn>", "<turn|>")
        ),
        FamilySpec(
            name="llama3.2-vision",
            processor_class="MllamaProcessor",
            templates=("llama3_2_vision", "llama3_2_vision_llama_models"),
            **_turns("<|start_header_id|>", "<|eot_id|>"),
        ),
        # llama-models' ChatFormat ends a turn that calls tools, and a tool result, with <|eom|>.
        FamilySpec(
            name="llama4",
            processor_class="Llama4Processor",
            templates=("llama4", "llama4_llama_models"),
            **_turns("<|header_start|>", "<|eot|>", "<|eom|>"),
        ),
        FamilySpec(
            name="mistral3-pixtral",
            processor_class="PixtralProcessor",
            end_of_turn=("</s>",),
            image_mode="longest_edge_patch",
            turn_starts={"[SYSTEM_PROMPT]": "system", "[INST]": "user", "[/INST]": "assistant"},
            tool_call_tokens=("[TOOL_CALLS]",),
            templates=("mistral3", "mistral3_mistral_common"),
        ),
        FamilySpec(
            name="idefics3-smolvlm",
            processor_class="Idefics3Processor",
            turn_ends=("<end_of_utterance>",),
            templates=("smolvlm",),
            **_turns("<|im_start|>", "<end_of_utterance>"),  # <|im_start|> once, before the first turn
        ),
        FamilySpec(
            name="llava-onevision", processor_class="LlavaOnevisionProcessor", templates=("llava_onevision",), **_CHATML
        ),
        FamilySpec(name="internvl", processor_class="InternVLProcessor", templates=("internvl",), **_CHATML),
    )
}
# The model family a processor renders for, as `tiny:NAME` (and the trainer's --tiny-random NAME) names it: the manifest
# records it, so that only a model of that family trains the data. The class says it, but for Qwen3VLProcessor, which
# Qwen3-VL and Qwen3.5 share: there the tokenizer does.
MODEL_FAMILIES = {
    "Qwen2VLProcessor": "qwen2-vl",
    "Qwen2_5_VLProcessor": "qwen2.5-vl",
    "Qwen3VLProcessor": "qwen3-vl",
    "MllamaProcessor": "llama-3.2-vision",
    "Llama4Processor": "llama-4",
    "PixtralProcessor": "mistral-3",
    "Gemma3Processor": "gemma-3",
    "Gemma4Processor": "gemma-4",
    "Glm4vProcessor": "glm-4.1v",
    "InternVLProcessor": "internvl",
    "LlavaOnevisionProcessor": "llava-onevision",
    "Idefics3Processor": "smolvlm",
    "SmolVLMProcessor": "smolvlm",
}
QWEN35_MARKS = ("<|audio_start|>", "<tts_pad>")  # tokens of Qwen3.5's vocabulary that Qwen3-VL's lacks


def model_family(processor) -> str | None:
    """The model family `processor` renders for (MODEL_FAMILIES' names), None for a class no family has."""
    name = MODEL_FAMILIES.get(type(processor).__name__)
    tok = getattr(processor, "tokenizer", None)
    if name == "qwen3-vl" and tok is not None:
        vocab = tok.get_vocab()
        if type(tok).__name__ == "Qwen3_5Tokenizer" or all(t in vocab for t in QWEN35_MARKS):
            return "qwen3.5"
    return name


# A view of a dataset whose family is not registered (--role-boundaries) recognises any known turn token.
ANY_TURN_STARTS = {t: how for spec in FAMILIES.values() for t, how in spec.turn_starts.items()}


def family_of(processor_class: str | None) -> FamilySpec | None:
    """The registered family of a processor class name (as a manifest records it), or None."""
    return FAMILIES.get(processor_class or "")


def resolve_family(processor, role_boundaries: str | None = None) -> FamilySpec:
    """The processor's family; a --role-boundaries file overrides turn markers and makes unknown classes usable."""
    cls = type(processor).__name__
    known = FAMILIES.get(cls)
    if role_boundaries is not None:
        return load_role_boundaries(role_boundaries, processor_class=cls, base=known)
    if known is None:
        raise ValueError(
            f"processor class {cls} is not a known family ({', '.join(sorted(FAMILIES))}); vlmprep will not guess "
            "which tokens to train: pass --role-boundaries FILE declaring each role's start/end markers "
            "(docs/families-and-masking.md)"
        )
    return known


def load_role_boundaries(path: str, *, processor_class: str, base: FamilySpec | None) -> FamilySpec:
    """Parse a --role-boundaries TOML: optional `end_of_turn = [...]`, and `[roles.<role>] start = ..., end = ...`."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--role-boundaries {path}: cannot read it as TOML ({e}); fix the file") from None
    unknown = set(data) - {"end_of_turn", "roles"}
    if unknown:
        raise ValueError(f"--role-boundaries {path}: unknown keys {sorted(unknown)}; allowed: end_of_turn, roles")
    roles = data.get("roles", {})
    if not isinstance(roles, dict) or not roles:
        raise ValueError(f"--role-boundaries {path}: add at least one [roles.<role>] table with start and end")
    markers: dict[str, tuple[str, str]] = {}
    for role, spec in roles.items():
        if role not in ROLES:
            raise ValueError(f"--role-boundaries {path}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        if (
            not isinstance(spec, dict)
            or set(spec) != {"start", "end"}
            or not all(isinstance(spec[k], str) and spec[k] for k in ("start", "end"))
        ):
            raise ValueError(f"--role-boundaries {path}: [roles.{role}] needs exactly non-empty strings start and end")
        markers[role] = (spec["start"], spec["end"])
    eot = data.get("end_of_turn", sorted({end for _, end in markers.values()}))
    if not isinstance(eot, list) or not eot or not all(isinstance(t, str) and t for t in eot):
        raise ValueError(f"--role-boundaries {path}: end_of_turn must be a non-empty list of token strings")
    if base is None:
        return FamilySpec(
            name=f"custom:{processor_class}",
            processor_class=processor_class,
            end_of_turn=tuple(eot),
            role_markers=markers,
        )
    return replace(base, end_of_turn=tuple(eot), role_markers=markers)
