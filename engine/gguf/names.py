"""The one table of GGUF tensor names the engine reads, built from gguf's MODEL_TENSOR / TENSOR_NAMES.

Global tensors are constants (`TOKEN_EMBD`); per-block tensors go through `blk(i, "attn_q")` ->
"blk.{i}.attn_q.weight", which refuses names not in the table so a typo fails at once instead of as a missing tensor.
"""

from gguf import MODEL_TENSOR, TENSOR_NAMES


def _global(t: MODEL_TENSOR, suffix: str = "weight") -> str:
    return f"{TENSOR_NAMES[t]}.{suffix}"


TOKEN_EMBD = _global(MODEL_TENSOR.TOKEN_EMBD)
OUTPUT_NORM = _global(MODEL_TENSOR.OUTPUT_NORM)
OUTPUT = _global(MODEL_TENSOR.OUTPUT)
ROPE_FREQS = _global(MODEL_TENSOR.ROPE_FREQS)

# Short name (the part after "blk.{i}.") -> gguf's enum member. Aliases used by llama.cpp are listed once each.
_BLOCK: dict[str, MODEL_TENSOR] = {
    # attention
    "attn_norm": MODEL_TENSOR.ATTN_NORM,
    "attn_q": MODEL_TENSOR.ATTN_Q,
    "attn_k": MODEL_TENSOR.ATTN_K,
    "attn_v": MODEL_TENSOR.ATTN_V,
    "attn_qkv": MODEL_TENSOR.ATTN_QKV,
    "attn_output": MODEL_TENSOR.ATTN_OUT,
    "attn_q_norm": MODEL_TENSOR.ATTN_Q_NORM,
    "attn_k_norm": MODEL_TENSOR.ATTN_K_NORM,
    "attn_gate": MODEL_TENSOR.ATTN_GATE,
    "attn_sinks": MODEL_TENSOR.ATTN_SINKS,
    "post_attention_norm": MODEL_TENSOR.ATTN_POST_NORM,
    # multi-head latent attention (deepseek2)
    "attn_q_a": MODEL_TENSOR.ATTN_Q_A,
    "attn_q_b": MODEL_TENSOR.ATTN_Q_B,
    "attn_q_a_norm": MODEL_TENSOR.ATTN_Q_A_NORM,
    "attn_kv_a_mqa": MODEL_TENSOR.ATTN_KV_A_MQA,
    "attn_kv_a_norm": MODEL_TENSOR.ATTN_KV_A_NORM,
    "attn_kv_b": MODEL_TENSOR.ATTN_KV_B,
    "attn_k_b": MODEL_TENSOR.ATTN_K_B,
    "attn_v_b": MODEL_TENSOR.ATTN_V_B,
    # dense feed-forward
    "ffn_norm": MODEL_TENSOR.FFN_NORM,
    "post_ffw_norm": MODEL_TENSOR.FFN_POST_NORM,
    "ffn_gate": MODEL_TENSOR.FFN_GATE,
    "ffn_up": MODEL_TENSOR.FFN_UP,
    "ffn_down": MODEL_TENSOR.FFN_DOWN,
    # routed experts
    "ffn_gate_inp": MODEL_TENSOR.FFN_GATE_INP,
    "exp_probs_b": MODEL_TENSOR.FFN_EXP_PROBS_B,
    "ffn_gate_exps": MODEL_TENSOR.FFN_GATE_EXP,
    "ffn_up_exps": MODEL_TENSOR.FFN_UP_EXP,
    "ffn_down_exps": MODEL_TENSOR.FFN_DOWN_EXP,
    "ffn_gate_up_exps": MODEL_TENSOR.FFN_GATE_UP_EXP,
    # shared expert
    "ffn_gate_inp_shexp": MODEL_TENSOR.FFN_GATE_INP_SHEXP,
    "ffn_gate_shexp": MODEL_TENSOR.FFN_GATE_SHEXP,
    "ffn_up_shexp": MODEL_TENSOR.FFN_UP_SHEXP,
    "ffn_down_shexp": MODEL_TENSOR.FFN_DOWN_SHEXP,
    # gated delta-net / SSM (qwen3next)
    "ssm_in": MODEL_TENSOR.SSM_IN,
    "ssm_conv1d": MODEL_TENSOR.SSM_CONV1D,
    "ssm_dt": MODEL_TENSOR.SSM_DT,
    "ssm_a": MODEL_TENSOR.SSM_A,
    "ssm_ba": MODEL_TENSOR.SSM_BETA_ALPHA,
    "ssm_norm": MODEL_TENSOR.SSM_NORM,
    "ssm_out": MODEL_TENSOR.SSM_OUT,
    # multi-token-prediction draft layer (blk.{n_layer + i}.nextn.*)
    "nextn.eh_proj": MODEL_TENSOR.NEXTN_EH_PROJ,
    "nextn.embed_tokens": MODEL_TENSOR.NEXTN_EMBED_TOKENS,
    "nextn.enorm": MODEL_TENSOR.NEXTN_ENORM,
    "nextn.hnorm": MODEL_TENSOR.NEXTN_HNORM,
    "nextn.shared_head_head": MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
    "nextn.shared_head_norm": MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}

BLOCK_TENSORS: frozenset[str] = frozenset(_BLOCK)


def blk(i: int, part: str, suffix: str = "weight") -> str:
    """Name of a per-block tensor: blk(3, "attn_q") -> "blk.3.attn_q.weight"; suffix "bias" for biases."""
    t = _BLOCK.get(part)
    if t is None:
        raise KeyError(f"unknown block tensor {part!r}; known: {', '.join(sorted(_BLOCK))}")
    if i < 0:
        raise ValueError(f"block index must be >= 0, got {i}")
    return f"{TENSOR_NAMES[t].format(bid=i)}.{suffix}"


def block_index(name: str) -> int | None:
    """The N of a "blk.N.*" tensor name, None for global tensors."""
    if not name.startswith("blk."):
        return None
    num = name[4:].split(".", 1)[0]
    return int(num) if num.isdigit() else None
