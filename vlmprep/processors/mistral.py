"""Offline build (cached by vlmprep.processors.builtin) of the Mistral Small 3.1 (Mistral 3 / Pixtral architecture)
processor: the Tekken vocabulary that
`mistral-common` ships (special tokens at their official ids), mistral-common's own chat format, PixtralProcessor.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import ProcessorMixin

TEMPLATES = Path(__file__).parent.parent / "templates"
# Default: the format mistral-common encodes (the reference Mistral's serving uses). The Hugging Face repo's own
# template (default system prompt with today's date, v3-style tool results) is mistral3.jinja: --chat-template.
VENDOR_TEMPLATE = "mistral3_mistral_common.jinja"
HF_TEMPLATE = "mistral3.jinja"
TEKKEN = "tekken_240911.json"  # Pixtral's Tekken file; Mistral Small 3.x ships the same 131072-token vocabulary
# Mistral-Small-3.1-24B-Instruct-2503 params.json / preprocessor_config.json: 14 px patches merged 2x2, 1540 px.
PATCH_SIZE, SPATIAL_MERGE, LONGEST_EDGE = 14, 2, 1540
MODEL_MAX_LENGTH = 131072
# Official ids (tokenizer_config.json of the model); the rest of ids 0..999 are <SPECIAL_n> fillers.
SPECIAL_IDS = {
    "<unk>": 0,
    "<s>": 1,
    "</s>": 2,
    "[INST]": 3,
    "[/INST]": 4,
    "[AVAILABLE_TOOLS]": 5,
    "[/AVAILABLE_TOOLS]": 6,
    "[TOOL_RESULTS]": 7,
    "[/TOOL_RESULTS]": 8,
    "[TOOL_CALLS]": 9,
    "[IMG]": 10,
    "<pad>": 11,
    "[IMG_BREAK]": 12,
    "[IMG_END]": 13,
    "[PREFIX]": 14,
    "[MIDDLE]": 15,
    "[SUFFIX]": 16,
    "[SYSTEM_PROMPT]": 17,
    "[/SYSTEM_PROMPT]": 18,
    "[TOOL_CONTENT]": 19,
}


def tekken_resource():
    """mistral-common's Tekken vocabulary file (tekken.json) that builtin:mistral-3 is built from."""
    return importlib.resources.files("mistral_common").joinpath("data", TEKKEN)


def read_template(name: str = VENDOR_TEMPLATE) -> str:
    """A bundled chat template (vlmprep/templates/NAME, the mistral-common one by default) as text."""
    return (TEMPLATES / name).read_text(encoding="utf-8")


def source_files(name: str) -> tuple[bytes, str]:
    """What the build reads (vocabulary bytes, default template): vlmprep.processors.builtin hashes them into the
    cache key."""
    assert name == "mistral-3", name
    return tekken_resource().read_bytes(), read_template()


def make_processor(name: str, template: str) -> ProcessorMixin:
    """The builtin processor `name` (mistral-3 only) with `template`."""
    assert name == "mistral-3", name
    return make_mistral_processor(template)


def make_mistral_processor(template: str) -> ProcessorMixin:
    """builtin:mistral-3 built offline: a Pixtral processor over mistral-common's Tekken vocabulary, with `template`."""
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast
    from transformers.integrations.mistral.tokenizer import MistralConverter

    with importlib.resources.as_file(tekken_resource()) as path:
        # transformers' own Tekken conversion: mistral-common's vocabulary, pattern and special layout.
        backend = MistralConverter(vocab_file=str(path)).converted()
    for token, token_id in SPECIAL_IDS.items():
        if backend.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} got id {backend.token_to_id(token)}, expected {token_id}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )
    tokenizer.chat_template = template
    image_processor = PixtralImageProcessor(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH_SIZE, "width": PATCH_SIZE}
    )
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        spatial_merge_size=SPATIAL_MERGE,
        chat_template=template,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )
