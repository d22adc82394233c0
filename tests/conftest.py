"""Shared fixtures: the builtin processors (built once per session into a temp cache) and a tiny model config."""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# A few hundred generated cases per property in `make test`; `make test-all` sets HYPOTHESIS_PROFILE=thorough.
settings.register_profile(
    "default", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "thorough",
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

FIXTURES = Path(__file__).parent / "fixtures"
LLAMAFACTORY = FIXTURES / "llamafactory_mllm_demo"


@pytest.fixture(scope="session", autouse=True)
def _offline_env(tmp_path_factory):
    # Tests never reach a hub; a private builtin cache keeps runs hermetic. One cache for the run's test processes
    # (pytest-xdist workers share the base temp's parent): each builtin is built cold once, and the builder's atomic
    # rename settles two workers building the same one at once.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    cache = root / "vlmprep-cache"
    cache.mkdir(exist_ok=True)
    os.environ.setdefault("VLMPREP_CACHE", str(cache))


@pytest.fixture(scope="session")
def qwen2vl_processor():
    from vlmprep.processors.load import load_processor

    return load_processor("builtin:qwen2-vl")


@pytest.fixture(scope="session")
def qwen25vl_processor():
    from vlmprep.processors.load import load_processor

    return load_processor("builtin:qwen2.5-vl")


def tiny_qwen2vl_config(**overrides):
    from transformers import Qwen2VLConfig

    cfg = dict(
        text_config=dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
    )
    cfg.update(overrides)
    return Qwen2VLConfig(**cfg)
