"""`qwen3`: Qwen3 dense models (RMS norm on each head's queries and keys, no biases)."""

from collections.abc import Mapping
from typing import Any

from engine.gguf.model_config import Meta, ModelConfig, common_fields, rope_from_meta

ARCH = "qwen3"


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    return ModelConfig(arch=ARCH, rope=rope_from_meta(m, base["head_dim_k"], neox=True), qk_norm=True, **base)
