"""`qwen2moe`: Qwen1.5-MoE / Qwen2-57B-A14B. Qwen2 attention (QKV biases), routed experts whose top-k weights
are not renormalised, plus a shared expert scaled by a sigmoid gate (`ffn_gate_inp_shexp`)."""

from collections.abc import Mapping
from typing import Any

from gguf import Keys

from engine.gguf.model_config import (
    Meta,
    ModelConfig,
    common_fields,
    moe_fields,
    rope_from_meta,
)

ARCH = "qwen2moe"


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    moe = moe_fields(m, norm_default=False, required=True)
    return ModelConfig(
        arch=ARCH,
        rope=rope_from_meta(m, base["head_dim_k"], neox=True),
        qkv_bias=True,
        n_ff_shexp=m.int(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        shared_expert_gate=True,
        **base,
        **moe,
    )
