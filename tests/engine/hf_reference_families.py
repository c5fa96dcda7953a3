"""The independent reference for gpt-oss, qwen3next, deepseek2 and glm4moe: HF transformers' model of the family in
float32, on the weights of the GGUF file dequantized by `gguf.quants` (not by our code), with llama.cpp's converter
layout undone here (gate/up interleaving, +1 norms, -exp(A_log), the regrouped qkvz, MLA's k_b/v_b split)."""

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from tests.engine.hf_reference import read_gguf


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float32))  # a writable copy


class _Meta:
    def __init__(self, meta: dict[str, Any]) -> None:
        self.m = meta
        self.arch = meta["general.architecture"]

    def __call__(self, key: str, default: Any = None) -> Any:
        v = self.m.get(f"{self.arch}.{key}", default)
        if isinstance(v, list | tuple | np.ndarray) and not isinstance(v, str):
            return v[0] if len(v) else default
        return v


def _common(g: _Meta, t: dict[str, np.ndarray], n_layer: int) -> dict[str, Any]:
    return dict(
        vocab_size=t["token_embd.weight"].shape[0],
        hidden_size=int(g("embedding_length")),
        num_hidden_layers=n_layer,
        num_attention_heads=int(g("attention.head_count")),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(g("context_length")),
        tie_word_embeddings="output.weight" not in t,
    )


def _experts(sd: dict, t: dict, b: str, p: str) -> None:
    """Routed experts as HF's fused [E, 2F, D] gate_up and [E, D, F] down."""
    sd[p + "mlp.experts.gate_up_proj"] = torch.cat(
        (_t(t[b + "ffn_gate_exps.weight"]), _t(t[b + "ffn_up_exps.weight"])), 1
    )
    sd[p + "mlp.experts.down_proj"] = _t(t[b + "ffn_down_exps.weight"])


# ---------------------------------------------------------------------------------------------------------------


def _gpt_oss(g: _Meta, t: dict) -> tuple[transformers.PreTrainedModel, dict]:
    n_layer = int(g("block_count"))
    common = _common(g, t, n_layer)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(g("rope.freq_base"))}
    if g("rope.scaling.type") == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": float(g("rope.freq_base")),
            "factor": float(g("rope.scaling.factor")),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
        }
    cfg = transformers.GptOssConfig(
        num_key_value_heads=int(g("attention.head_count_kv")),
        head_dim=int(g("attention.key_length")),
        intermediate_size=int(g("expert_feed_forward_length")),
        num_local_experts=int(g("expert_count")),
        num_experts_per_tok=int(g("expert_used_count")),
        sliding_window=int(g("attention.sliding_window")),
        swiglu_limit=float(g("swiglu_clamp_exp", 7.0)),
        rope_parameters=rope,
        **common,
    )
    sd: dict[str, torch.Tensor] = {}
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for x in ("q", "k", "v"):
            sd[p + f"self_attn.{x}_proj.weight"] = _t(t[b + f"attn_{x}.weight"])
            sd[p + f"self_attn.{x}_proj.bias"] = _t(t[b + f"attn_{x}.bias"])
        sd[p + "self_attn.o_proj.weight"] = _t(t[b + "attn_output.weight"])
        sd[p + "self_attn.o_proj.bias"] = _t(t[b + "attn_output.bias"])
        sd[p + "self_attn.sinks"] = _t(t[b + "attn_sinks.weight"])
        sd[p + "input_layernorm.weight"] = _t(t[b + "attn_norm.weight"])
        sd[p + "post_attention_layernorm.weight"] = _t(t[b + "post_attention_norm.weight"])
        sd[p + "mlp.router.weight"] = _t(t[b + "ffn_gate_inp.weight"])
        sd[p + "mlp.router.bias"] = _t(t[b + "ffn_gate_inp.bias"])
        # back to HF's [E, D, 2F] with gate and up interleaved along the output
        gate, up = _t(t[b + "ffn_gate_exps.weight"]), _t(t[b + "ffn_up_exps.weight"])  # [E, F, D]
        sd[p + "mlp.experts.gate_up_proj"] = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
        gb, ub = _t(t[b + "ffn_gate_exps.bias"]), _t(t[b + "ffn_up_exps.bias"])
        sd[p + "mlp.experts.gate_up_proj_bias"] = torch.stack((gb, ub), dim=2).flatten(1, 2)
        sd[p + "mlp.experts.down_proj"] = _t(t[b + "ffn_down_exps.weight"]).transpose(1, 2)
        sd[p + "mlp.experts.down_proj_bias"] = _t(t[b + "ffn_down_exps.bias"])
    return transformers.GptOssForCausalLM(cfg), sd


def _qwen3next(g: _Meta, t: dict) -> tuple[transformers.PreTrainedModel, dict]:
    n_layer = int(g("block_count"))
    common = _common(g, t, n_layer)
    head_dim = int(g("attention.key_length"))
    nk, nv = int(g("ssm.group_count")), int(g("ssm.time_step_rank"))
    dk, dv = int(g("ssm.state_size")), int(g("ssm.inner_size")) // nv
    interval = int(g("full_attention_interval"))
    cfg = transformers.Qwen3NextConfig(
        num_key_value_heads=int(g("attention.head_count_kv")),
        head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        moe_intermediate_size=int(g("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length")),
        num_experts=int(g("expert_count")),
        num_experts_per_tok=int(g("expert_used_count")),
        norm_topk_prob=True,
        linear_conv_kernel_dim=int(g("ssm.conv_kernel")),
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        layer_types=["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(g("rope.freq_base")),
            "partial_rotary_factor": int(g("rope.dimension_count")) / head_dim,
        },
        **common,
    )

    def norm(name: str) -> torch.Tensor:  # HF computes x * (1 + w); the file stores 1 + w
        return _t(t[name]) - 1.0

    r = nv // nk
    sd: dict[str, torch.Tensor] = {"model.norm.weight": norm("output_norm.weight")}
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(b + "attn_norm.weight")
        sd[p + "post_attention_layernorm.weight"] = norm(b + "post_attention_norm.weight")
        if (i + 1) % interval:
            la = p + "linear_attn."
            qkv, z = _t(t[b + "attn_qkv.weight"]), _t(t[b + "attn_gate.weight"])
            d = qkv.shape[1]
            q, k, v = qkv[: nk * dk], qkv[nk * dk : 2 * nk * dk], qkv[2 * nk * dk :]
            # regroup per key head: [q_h, k_h, v (r heads), z (r heads)]
            grouped = torch.cat(
                (q.view(nk, dk, d), k.view(nk, dk, d), v.view(nk, r * dv, d), z.view(nk, r * dv, d)), dim=1
            )
            sd[la + "in_proj_qkvz.weight"] = grouped.reshape(-1, d)
            sd[la + "in_proj_ba.weight"] = _t(t[b + "ssm_ba.weight"])
            sd[la + "conv1d.weight"] = _t(t[b + "ssm_conv1d.weight"]).unsqueeze(1)
            sd[la + "dt_bias"] = _t(t[b + "ssm_dt.bias"])
            sd[la + "A_log"] = torch.log(-_t(t[b + "ssm_a"]))
            sd[la + "norm.weight"] = _t(t[b + "ssm_norm.weight"])
            sd[la + "out_proj.weight"] = _t(t[b + "ssm_out.weight"])
        else:
            a = p + "self_attn."
            for x in ("q", "k", "v"):
                sd[a + f"{x}_proj.weight"] = _t(t[b + f"attn_{x}.weight"])
            sd[a + "o_proj.weight"] = _t(t[b + "attn_output.weight"])
            sd[a + "q_norm.weight"] = norm(b + "attn_q_norm.weight")
            sd[a + "k_norm.weight"] = norm(b + "attn_k_norm.weight")
        sd[p + "mlp.gate.weight"] = _t(t[b + "ffn_gate_inp.weight"])
        _experts(sd, t, b, p)
        for x in ("gate", "up", "down"):
            sd[p + f"mlp.shared_expert.{x}_proj.weight"] = _t(t[b + f"ffn_{x}_shexp.weight"])
        sd[p + "mlp.shared_expert_gate.weight"] = _t(t[b + "ffn_gate_inp_shexp.weight"]).reshape(1, -1)
    return transformers.Qwen3NextForCausalLM(cfg), sd


def _routed_ffn(sd: dict, t: dict, b: str, p: str) -> None:
    """DeepSeek-style FFN: dense, or routed experts with the selection bias plus shared experts."""
    if b + "ffn_gate_inp.weight" not in t:
        for x in ("gate", "up", "down"):
            sd[p + f"mlp.{x}_proj.weight"] = _t(t[b + f"ffn_{x}.weight"])
        return
    sd[p + "mlp.gate.weight"] = _t(t[b + "ffn_gate_inp.weight"])
    sd[p + "mlp.gate.e_score_correction_bias"] = _t(t[b + "exp_probs_b.bias"])
    _experts(sd, t, b, p)
    for x in ("gate", "up", "down"):
        sd[p + f"mlp.shared_experts.{x}_proj.weight"] = _t(t[b + f"ffn_{x}_shexp.weight"])


def _moe_kwargs(g: _Meta) -> dict[str, Any]:
    n_ff_exp = int(g("expert_feed_forward_length"))
    return dict(
        intermediate_size=int(g("feed_forward_length")),
        moe_intermediate_size=n_ff_exp,
        n_routed_experts=int(g("expert_count")),
        n_shared_experts=int(g("expert_shared_count")),
        num_experts_per_tok=int(g("expert_used_count")),
        routed_scaling_factor=float(g("expert_weights_scale")),
        norm_topk_prob=bool(g("expert_weights_norm")),
        n_group=int(g("expert_group_count", 1)),
        topk_group=int(g("expert_group_used_count", 1)),
        first_k_dense_replace=int(g("leading_dense_block_count")),
    )


def _deepseek2(g: _Meta, t: dict) -> tuple[transformers.PreTrainedModel, dict]:
    n_layer = int(g("block_count"))
    rope = int(g("rope.dimension_count"))
    kvl = int(g("attention.kv_lora_rank"))
    nope = int(g("attention.key_length_mla")) - rope
    vd = int(g("attention.value_length_mla"))
    n_head = int(g("attention.head_count"))
    q_lora = int(g("attention.q_lora_rank", 0)) or None
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(g("rope.freq_base"))}
    if g("rope.scaling.type") == "yarn":
        mscale_all_dim = float(g("rope.scaling.yarn_log_multiplier")) / 0.1
        rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": float(g("rope.freq_base")),
            "factor": float(g("rope.scaling.factor")),
            "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": mscale_all_dim,
            "mscale_all_dim": mscale_all_dim,
        }
    cfg = transformers.DeepseekV3Config(
        num_key_value_heads=n_head,
        kv_lora_rank=kvl,
        q_lora_rank=q_lora,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=vd,
        rope_parameters=rope_parameters,
        **_moe_kwargs(g),
        **_common(g, t, n_layer),
    )
    sd: dict[str, torch.Tensor] = {}
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        a = p + "self_attn."
        if q_lora:
            sd[a + "q_a_proj.weight"] = _t(t[b + "attn_q_a.weight"])
            sd[a + "q_a_layernorm.weight"] = _t(t[b + "attn_q_a_norm.weight"])
            sd[a + "q_b_proj.weight"] = _t(t[b + "attn_q_b.weight"])
        else:
            sd[a + "q_proj.weight"] = _t(t[b + "attn_q.weight"])
        sd[a + "kv_a_proj_with_mqa.weight"] = _t(t[b + "attn_kv_a_mqa.weight"])
        sd[a + "kv_a_layernorm.weight"] = _t(t[b + "attn_kv_a_norm.weight"])
        k_b = _t(t[b + "attn_k_b.weight"])  # [H, kv_lora, nope]
        v_b = _t(t[b + "attn_v_b.weight"])  # [H, v_dim, kv_lora]
        sd[a + "kv_b_proj.weight"] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, kvl)
        sd[a + "o_proj.weight"] = _t(t[b + "attn_output.weight"])
        sd[p + "input_layernorm.weight"] = _t(t[b + "attn_norm.weight"])
        sd[p + "post_attention_layernorm.weight"] = _t(t[b + "ffn_norm.weight"])
        _routed_ffn(sd, t, b, p)
    return transformers.DeepseekV3ForCausalLM(cfg), sd


def _glm4moe(g: _Meta, t: dict, with_draft: bool = False) -> tuple[transformers.PreTrainedModel, dict]:
    """`with_draft`: the nextn block as one more decoder layer (its own tensors are read by the test)."""
    n_layer = int(g("block_count")) - (0 if with_draft else int(g("nextn_predict_layers", 0)))
    head_dim = int(g("attention.key_length"))
    cfg = transformers.Glm4MoeConfig(
        num_key_value_heads=int(g("attention.head_count_kv")),
        head_dim=head_dim,
        attention_bias="blk.0.attn_q.bias" in t,
        use_qk_norm="blk.0.attn_q_norm.weight" in t,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(g("rope.freq_base")),
            "partial_rotary_factor": int(g("rope.dimension_count")) / head_dim,
        },
        **_moe_kwargs(g),
        **_common(g, t, n_layer),
    )
    sd: dict[str, torch.Tensor] = {}
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        a = p + "self_attn."
        for x in ("q", "k", "v"):
            sd[a + f"{x}_proj.weight"] = _t(t[b + f"attn_{x}.weight"])
            if b + f"attn_{x}.bias" in t:
                sd[a + f"{x}_proj.bias"] = _t(t[b + f"attn_{x}.bias"])
        sd[a + "o_proj.weight"] = _t(t[b + "attn_output.weight"])
        if b + "attn_q_norm.weight" in t:
            sd[a + "q_norm.weight"] = _t(t[b + "attn_q_norm.weight"])
            sd[a + "k_norm.weight"] = _t(t[b + "attn_k_norm.weight"])
        sd[p + "input_layernorm.weight"] = _t(t[b + "attn_norm.weight"])
        sd[p + "post_attention_layernorm.weight"] = _t(t[b + "post_attention_norm.weight"])
        _routed_ffn(sd, t, b, p)
    return transformers.Glm4MoeForCausalLM(cfg), sd


_BUILDERS = {"gpt-oss": _gpt_oss, "qwen3next": _qwen3next, "deepseek2": _deepseek2, "glm4moe": _glm4moe}


def hf_family_model(path: Path, with_draft: bool = False) -> transformers.PreTrainedModel:
    """HF's model of the file; `with_draft` (glm4moe): the nextn block included as a last decoder layer."""
    meta, t = read_gguf(path)
    g = _Meta(meta)
    model, sd = _glm4moe(g, t, with_draft) if g.arch == "glm4moe" else _BUILDERS[g.arch](g, t)
    sd["model.embed_tokens.weight"] = _t(t["token_embd.weight"])
    sd.setdefault("model.norm.weight", _t(t["output_norm.weight"]))
    if "output.weight" in t:
        sd["lm_head.weight"] = _t(t["output.weight"])
    model.config._attn_implementation = "eager"
    model = model.float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq") and m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    if "output.weight" not in t:
        model.tie_weights()
    return model
