"""`gemma3`: Gemma 3 text models. Embeddings scaled by sqrt(n_embd), GELU (tanh), QK norms, norms after attention
and after the FFN too, and five sliding-window layers (RoPE base 10000) for every global one. The GGUF stores the
norms with Gemma's +1 already applied."""

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gguf import Keys

from engine.gguf.model_config import Meta, ModelConfig, common_fields, rope_from_meta

ARCH = "gemma3"
# llama.cpp's values where the file carries none: one global layer in six, local RoPE base 10000.
DEFAULT_SWA_PATTERN = 6
DEFAULT_SWA_ROPE_BASE = 10000.0


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    n_layer = base["n_layer"]
    window = m.int(Keys.Attention.SLIDING_WINDOW, 0)
    pattern = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN, DEFAULT_SWA_PATTERN)
    if hasattr(pattern, "__len__"):  # a per-layer bool array
        swa = tuple(bool(x) for x in pattern)
    else:
        p = int(pattern)
        swa = tuple(p > 0 and (i + 1) % p != 0 for i in range(n_layer))
    if not window:
        swa = ()
    rope = rope_from_meta(m, base["head_dim_k"], neox=True, default_base=1000000.0)
    rope = replace(rope, base_swa=m.float(Keys.Rope.FREQ_BASE_SWA, DEFAULT_SWA_ROPE_BASE))
    return ModelConfig(
        arch=ARCH,
        rope=rope,
        activation="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        embed_scale=math.sqrt(base["n_embd"]),
        sliding_window=window,
        swa_layers=swa,
        **base,
    )
