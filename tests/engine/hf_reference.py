"""The independent reference: HF transformers' model of the same architecture, in float32, on the weights of a
GGUF file dequantized by `gguf.quants` (not by our code), with llama.cpp's converter layout undone."""

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

_GEMMA_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm")


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    tensors = {}
    for t in r.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne -> torch order
        tensors[t.name] = np.asarray(arr, dtype=np.float32).reshape(shape)
    return meta, tensors


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of the converter's Q/K row permutation for llama (pairs -> halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(path: Path) -> transformers.PreTrainedModel:
    meta, t = read_gguf(path)
    arch = meta["general.architecture"]
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    n_layer, d = int(g("block_count")), int(g("embedding_length"))
    n_head, n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
    head_dim = int(g("attention.key_length", d // n_head))
    vocab = t["token_embd.weight"].shape[0]
    mixtral = arch == "llama" and "blk.0.ffn_gate_exps.weight" in t
    rope = {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))}
    if g("rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    if (
        g("rope.scaling.type") == "yarn"
    ):  # llama.cpp's defaults: beta_fast 32, beta_slow 1, mscale 0.1 ln(factor) + 1
        rope = {**rope, "rope_type": "yarn", "factor": float(g("rope.scaling.factor")),
                "original_max_position_embeddings": int(g("rope.scaling.original_context_length"))}  # fmt: skip
    common = dict(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(g("context_length")),
        tie_word_embeddings="output.weight" not in t,
        rope_parameters=rope,
    )
    if arch == "qwen3moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=int(g("feed_forward_length")),
            moe_intermediate_size=int(g("expert_feed_forward_length")),
            num_experts=int(g("expert_count")),
            num_experts_per_tok=int(g("expert_used_count")),
            norm_topk_prob=True,
            **common,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "qwen2moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=int(g("feed_forward_length")),
            moe_intermediate_size=int(g("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length")),
            num_experts=int(g("expert_count")),
            num_experts_per_tok=int(g("expert_used_count")),
            norm_topk_prob=False,
            **common,
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif mixtral:
        cfg = transformers.MixtralConfig(
            intermediate_size=int(g("expert_feed_forward_length", g("feed_forward_length"))),
            num_local_experts=int(g("expert_count")),
            num_experts_per_tok=int(g("expert_used_count")),
            **common,
        )
        cls = transformers.MixtralForCausalLM
    elif arch == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=int(g("feed_forward_length")), **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(intermediate_size=int(g("feed_forward_length")), **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(intermediate_size=int(g("feed_forward_length")), **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":
        window = int(g("attention.sliding_window"))
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layer)]
        common["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": float(g("rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        cfg = transformers.Gemma3TextConfig(
            intermediate_size=int(g("feed_forward_length")),
            query_pre_attn_scalar=head_dim,
            sliding_window=window,
            layer_types=layer_types,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            **common,
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(f"no HF reference for {arch}")
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    sd = _state_dict(arch, t, n_head, n_kv, n_layer)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq") and m != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def _state_dict(arch: str, t: dict[str, np.ndarray], n_head: int, n_kv: int, n_layer: int) -> dict:
    gemma = arch == "gemma3"

    def T(name: str) -> torch.Tensor:
        w = t[name]
        if gemma and any(name.endswith(f"{n}.weight") for n in (*_GEMMA_NORMS, "output_norm")):
            w = w - 1.0  # HF Gemma norms compute (1 + w); the GGUF stores 1 + w
        return torch.from_numpy(np.ascontiguousarray(w))

    sd = {"model.embed_tokens.weight": T("token_embd.weight"), "model.norm.weight": T("output_norm.weight")}
    if "output.weight" in t:
        sd["lm_head.weight"] = T("output.weight")
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        q, k = T(b + "attn_q.weight"), T(b + "attn_k.weight")
        if arch == "llama":
            q = torch.from_numpy(_unpermute(q.numpy(), n_head))
            k = torch.from_numpy(_unpermute(k.numpy(), n_kv))
        sd[p + "self_attn.q_proj.weight"] = q
        sd[p + "self_attn.k_proj.weight"] = k
        sd[p + "self_attn.v_proj.weight"] = T(b + "attn_v.weight")
        sd[p + "self_attn.o_proj.weight"] = T(b + "attn_output.weight")
        for x in ("q", "k", "v"):
            if f"{b}attn_{x}.bias" in t:
                sd[p + f"self_attn.{x}_proj.bias"] = T(f"{b}attn_{x}.bias")
        if f"{b}attn_q_norm.weight" in t:
            sd[p + "self_attn.q_norm.weight"] = T(b + "attn_q_norm.weight")
            sd[p + "self_attn.k_norm.weight"] = T(b + "attn_k_norm.weight")
        sd[p + "input_layernorm.weight"] = T(b + "attn_norm.weight")
        if gemma:
            sd[p + "post_attention_layernorm.weight"] = T(b + "post_attention_norm.weight")
            sd[p + "pre_feedforward_layernorm.weight"] = T(b + "ffn_norm.weight")
            sd[p + "post_feedforward_layernorm.weight"] = T(b + "post_ffw_norm.weight")
        else:
            sd[p + "post_attention_layernorm.weight"] = T(b + "ffn_norm.weight")
        if b + "ffn_gate_exps.weight" in t:
            sd[p + "mlp.gate.weight"] = T(b + "ffn_gate_inp.weight")
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat(
                (T(b + "ffn_gate_exps.weight"), T(b + "ffn_up_exps.weight")), dim=1
            )
            sd[p + "mlp.experts.down_proj"] = T(b + "ffn_down_exps.weight")
            if b + "ffn_gate_shexp.weight" in t:
                sd[p + "mlp.shared_expert.gate_proj.weight"] = T(b + "ffn_gate_shexp.weight")
                sd[p + "mlp.shared_expert.up_proj.weight"] = T(b + "ffn_up_shexp.weight")
                sd[p + "mlp.shared_expert.down_proj.weight"] = T(b + "ffn_down_shexp.weight")
                sd[p + "mlp.shared_expert_gate.weight"] = T(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        else:
            sd[p + "mlp.gate_proj.weight"] = T(b + "ffn_gate.weight")
            sd[p + "mlp.up_proj.weight"] = T(b + "ffn_up.weight")
            sd[p + "mlp.down_proj.weight"] = T(b + "ffn_down.weight")
    return sd


@torch.inference_mode()
def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()  # [T, V]


@torch.inference_mode()
def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids) :]
