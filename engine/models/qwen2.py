"""`qwen2`: Qwen2 / Qwen2.5 dense models (biases on Q, K and V; RoPE on halves)."""

from collections.abc import Mapping
from typing import Any

from engine.gguf.model_config import Meta, ModelConfig, common_fields, rope_from_meta

ARCH = "qwen2"


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    return ModelConfig(
        arch=ARCH, rope=rope_from_meta(m, base["head_dim_k"], neox=True), qkv_bias=True, **base
    )
