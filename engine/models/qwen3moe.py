"""`qwen3moe`: Qwen3-30B-A3B and relatives. Qwen3 attention (QK norms) with routed experts only; the top-k
routing weights are renormalised (norm_topk_prob), as llama.cpp does for this family."""

from collections.abc import Mapping
from typing import Any

from engine.gguf.model_config import (
    Meta,
    ModelConfig,
    common_fields,
    moe_fields,
    rope_from_meta,
)

ARCH = "qwen3moe"


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    moe = moe_fields(m, norm_default=True, required=True)
    rope = rope_from_meta(m, base["head_dim_k"], neox=True)
    return ModelConfig(arch=ARCH, rope=rope, qk_norm=True, **base, **moe)
