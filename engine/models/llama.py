"""`llama`: Llama 1-3, Mistral, and Mixtral-style experts (`ffn_*_exps`). RoPE on adjacent pairs: llama.cpp's
converter permutes the Q/K rows so that its pair layout equals the original half-split layout."""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gguf import Keys

from engine.gguf.model_config import Meta, ModelConfig, common_fields, moe_fields, rope_from_meta

ARCH = "llama"


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    moe = moe_fields(m, norm_default=True)  # Mixtral renormalises the top-k weights
    if moe["n_expert"] and not moe["n_ff_exp"]:
        moe["n_ff_exp"] = base["n_ff"]  # Mixtral's experts have the dense FFN's width
    cfg = ModelConfig(arch=ARCH, rope=rope_from_meta(m, base["head_dim_k"], neox=False), **base, **moe)
    if m.has(Keys.Attention.SLIDING_WINDOW):  # Mistral v0.1: every layer slides
        window = m.int(Keys.Attention.SLIDING_WINDOW)
        cfg = replace(cfg, sliding_window=window, swa_layers=(True,) * cfg.n_layer)
    return cfg
