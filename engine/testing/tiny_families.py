"""Tiny GGUF models of the families with layer code of their own: gpt-oss, qwen3next, deepseek2, glm4moe.

Each writer draws random weights in the original (HF transformers) layout and converts them the way llama.cpp's
`convert_hf_to_gguf.py` does for that family - names through gguf's own tensor map, gate/up splits, the +1 added to
Qwen3-Next's zero-centred norms, `ssm_a = -exp(A_log)`, the regrouped `in_proj_qkvz`, MLA's `kv_b` split into
`k_b` (transposed) and `v_b`, the extra nextn block of GLM-4.5 (`blk.N.nextn.*` after the main layers, with its own
token table and head unless `nextn_tables=False`) - then stores matrices in the requested block type
(types gguf cannot quantize get random blocks; rows that do not fit the type's block fall back to Q8_0 or F32, as
the converter falls back). A few MB each, deterministic by seed.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_ARCH
from gguf import GGMLQuantizationType as QT

from engine.gguf.random_blocks import random_blocks
from engine.testing.tokenizer_fixture import tiny_bpe_metadata, write_tokenizer

FAMILIES = ("gpt-oss", "qwen3next", "deepseek2", "glm4moe")
_QUANTIZABLE = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.BF16, QT.MXFP4}
_ARCH_ENUM = {
    "gpt-oss": MODEL_ARCH.GPT_OSS,
    "qwen3next": MODEL_ARCH.QWEN3NEXT,
    "deepseek2": MODEL_ARCH.DEEPSEEK2,
    "glm4moe": MODEL_ARCH.GLM4_MOE,
}


@dataclass(frozen=True)
class FamilySpec:
    """The HF config of a tiny model (keys as in the family's transformers config)."""

    arch: str
    hf: Mapping[str, Any] = field(default_factory=dict)


def default_spec(arch: str, **overrides: Any) -> FamilySpec:
    if arch not in FAMILIES:
        raise ValueError(f"unknown tiny family {arch!r}; known: {', '.join(FAMILIES)}")
    common: dict[str, Any] = dict(
        hidden_size=256, num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=4096
    )
    if arch == "gpt-oss":
        hf = dict(
            common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_theta=150000.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=4096,
            ),
            swiglu_limit=7.0,
        )
    elif arch == "qwen3next":
        hf = dict(
            common,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            partial_rotary_factor=0.25,
            rope_theta=10000000.0,
            intermediate_size=512,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
        )
    elif arch == "deepseek2":
        hf = dict(
            common,
            num_hidden_layers=3,
            num_attention_heads=4,
            q_lora_rank=256,
            kv_lora_rank=256,
            qk_nope_head_dim=32,
            qk_rope_head_dim=32,
            v_head_dim=64,
            intermediate_size=512,
            moe_intermediate_size=256,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rope_theta=10000.0,
        )
    else:  # glm4moe
        hf = dict(
            common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=True,
            intermediate_size=512,
            moe_intermediate_size=256,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
            rope_theta=1000000.0,
        )
    hf.update(overrides)
    return FamilySpec(arch, hf)


class _Store:
    """Tensors in GGUF layout (torch order), each stored in the type asked for, with the converter's fallbacks."""

    def __init__(self, qtype: QT, types: Mapping[str, QT], seed: int) -> None:
        self.qtype = qtype
        self.types = dict(types)
        self.seed = seed
        self.tensors: list[tuple[str, np.ndarray, QT | None]] = []

    def _type_for(self, name: str, row: int) -> QT:
        t = self.qtype
        for pattern, pt in self.types.items():
            if pattern in name:
                t = pt
        block = gguf.GGML_QUANT_SIZES[t][0]
        if row % block:
            t = QT.Q8_0 if row % 32 == 0 else QT.F32
        return t

    def matrix(self, name: str, w: np.ndarray) -> None:
        qtype = self._type_for(name, w.shape[-1])
        w = np.ascontiguousarray(w, dtype=np.float32)
        if qtype == QT.F32:
            self.tensors.append((name, w, None))
        elif qtype == QT.F16:
            self.tensors.append((name, w.astype(np.float16), None))
        elif qtype in _QUANTIZABLE:
            self.tensors.append((name, gguf.quants.quantize(w, qtype), qtype))
        else:  # K- and IQ-types: random blocks of the weight's scale
            rows = int(np.prod(w.shape[:-1]))
            seed = (self.seed * 7919 + len(self.tensors)) % (1 << 31)
            raw = random_blocks(qtype, rows, w.shape[-1], seed=seed, std=float(w.std()) or 0.05)
            self.tensors.append((name, raw.reshape(*w.shape[:-1], raw.shape[-1]), qtype))

    def f32(self, name: str, v: np.ndarray) -> None:
        self.tensors.append((name, np.ascontiguousarray(v, dtype=np.float32), None))


class _Random:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def normal(self, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + self.rng.standard_normal(shape) * std).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# HF-layout random weights, per family


def _hf_weights(spec: FamilySpec, vocab: int, seed: int) -> dict[str, np.ndarray]:
    h, r = spec.hf, _Random(seed)
    d = h["hidden_size"]
    sd: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": r.normal((vocab, d), 0.5),
        "lm_head.weight": r.normal((vocab, d), d**-0.5),
    }
    zero_centred = spec.arch == "qwen3next"  # Qwen3-Next norms compute x * (1 + w)
    norm_mean = 0.0 if zero_centred else 1.0
    sd["model.norm.weight"] = r.normal((d,), 0.1, norm_mean)
    n_layer = h["num_hidden_layers"] + h.get("num_nextn_predict_layers", 0)
    for i in range(n_layer):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = r.normal((d,), 0.1, norm_mean)
        sd[p + "post_attention_layernorm.weight"] = r.normal((d,), 0.1, norm_mean)
        _ATTN[spec.arch](sd, p, h, r, i)
        _FFN[spec.arch](sd, p, h, r, i)
        if spec.arch == "glm4moe" and i >= h["num_hidden_layers"]:  # the nextn (MTP) block's own tensors
            sd[p + "eh_proj.weight"] = r.normal((d, 2 * d), (2 * d) ** -0.5)
            sd[p + "enorm.weight"] = r.normal((d,), 0.1, 1.0)
            sd[p + "hnorm.weight"] = r.normal((d,), 0.1, 1.0)
            sd[p + "shared_head.norm.weight"] = r.normal((d,), 0.1, 1.0)
            # GLM-4.5 files carry the block's own token table and head; GLM-4.6 files do not
            if h.get("nextn_tables", True):
                sd[p + "embed_tokens.weight"] = r.normal((vocab, d), 0.5)
                sd[p + "shared_head.head.weight"] = r.normal((vocab, d), d**-0.5)
    return sd


def _attn_gpt_oss(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d, nh, nkv, hd = h["hidden_size"], h["num_attention_heads"], h["num_key_value_heads"], h["head_dim"]
    a = p + "self_attn."
    for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
        sd[a + f"{name}_proj.weight"] = r.normal((rows, d), d**-0.5)
        sd[a + f"{name}_proj.bias"] = r.normal((rows,), 0.1)
    sd[a + "o_proj.weight"] = r.normal((d, nh * hd), (nh * hd) ** -0.5)
    sd[a + "o_proj.bias"] = r.normal((d,), 0.1)
    sd[a + "sinks"] = r.normal((nh,), 1.0)


def _ffn_gpt_oss(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d, e, f = h["hidden_size"], h["num_local_experts"], h["intermediate_size"]
    m = p + "mlp."
    sd[m + "router.weight"] = r.normal((e, d), 8 * d**-0.5)
    sd[m + "router.bias"] = r.normal((e,), 0.5)
    # HF keeps experts as [E, in, out] with gate and up interleaved along the output; large enough that the clamp acts
    sd[m + "experts.gate_up_proj"] = r.normal((e, d, 2 * f), 3 * d**-0.5)
    sd[m + "experts.gate_up_proj_bias"] = r.normal((e, 2 * f), 2.0)
    sd[m + "experts.down_proj"] = r.normal((e, f, d), f**-0.5)
    sd[m + "experts.down_proj_bias"] = r.normal((e, d), 0.1)


def _attn_qwen3next(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d = h["hidden_size"]
    if (i + 1) % h["full_attention_interval"] == 0:
        nh, nkv, hd = h["num_attention_heads"], h["num_key_value_heads"], h["head_dim"]
        a = p + "self_attn."
        sd[a + "q_proj.weight"] = r.normal((nh * hd * 2, d), d**-0.5)  # query and output gate, per head
        sd[a + "k_proj.weight"] = r.normal((nkv * hd, d), d**-0.5)
        sd[a + "v_proj.weight"] = r.normal((nkv * hd, d), d**-0.5)
        sd[a + "o_proj.weight"] = r.normal((d, nh * hd), (nh * hd) ** -0.5)
        sd[a + "q_norm.weight"] = r.normal((hd,), 0.1)
        sd[a + "k_norm.weight"] = r.normal((hd,), 0.1)
        return
    nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    dk, dv, kc = h["linear_key_head_dim"], h["linear_value_head_dim"], h["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    la = p + "linear_attn."
    sd[la + "in_proj_qkvz.weight"] = r.normal((2 * key_dim + 2 * value_dim, d), d**-0.5)
    sd[la + "in_proj_ba.weight"] = r.normal((2 * nv, d), d**-0.5)
    sd[la + "conv1d.weight"] = r.normal((2 * key_dim + value_dim, 1, kc), 0.5)
    sd[la + "dt_bias"] = r.normal((nv,), 0.5, 1.0)
    sd[la + "A_log"] = np.log(r.rng.uniform(0.5, 8.0, nv)).astype(np.float32)
    sd[la + "norm.weight"] = r.normal((dv,), 0.1, 1.0)
    sd[la + "out_proj.weight"] = r.normal((d, value_dim), value_dim**-0.5)


def _moe_qwen3next(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d, e, f, fs = (
        h["hidden_size"],
        h["num_experts"],
        h["moe_intermediate_size"],
        h["shared_expert_intermediate_size"],
    )
    m = p + "mlp."
    sd[m + "gate.weight"] = r.normal((e, d), 8 * d**-0.5)
    sd[m + "experts.gate_up_proj"] = r.normal((e, 2 * f, d), d**-0.5)
    sd[m + "experts.down_proj"] = r.normal((e, d, f), f**-0.5)
    sd[m + "shared_expert.gate_proj.weight"] = r.normal((fs, d), d**-0.5)
    sd[m + "shared_expert.up_proj.weight"] = r.normal((fs, d), d**-0.5)
    sd[m + "shared_expert.down_proj.weight"] = r.normal((d, fs), fs**-0.5)
    sd[m + "shared_expert_gate.weight"] = r.normal((1, d), d**-0.5)


def _attn_mla(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d, nh = h["hidden_size"], h["num_attention_heads"]
    nope, rope, vd, kvl = h["qk_nope_head_dim"], h["qk_rope_head_dim"], h["v_head_dim"], h["kv_lora_rank"]
    a = p + "self_attn."
    ql = h.get("q_lora_rank")
    if ql:
        sd[a + "q_a_proj.weight"] = r.normal((ql, d), d**-0.5)
        sd[a + "q_a_layernorm.weight"] = r.normal((ql,), 0.1, 1.0)
        sd[a + "q_b_proj.weight"] = r.normal((nh * (nope + rope), ql), ql**-0.5)
    else:
        sd[a + "q_proj.weight"] = r.normal((nh * (nope + rope), d), d**-0.5)
    sd[a + "kv_a_proj_with_mqa.weight"] = r.normal((kvl + rope, d), d**-0.5)
    sd[a + "kv_a_layernorm.weight"] = r.normal((kvl,), 0.1, 1.0)
    sd[a + "kv_b_proj.weight"] = r.normal((nh * (nope + vd), kvl), kvl**-0.5)
    sd[a + "o_proj.weight"] = r.normal((d, nh * vd), (nh * vd) ** -0.5)


def _attn_glm4moe(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    d, nh, nkv, hd = h["hidden_size"], h["num_attention_heads"], h["num_key_value_heads"], h["head_dim"]
    a = p + "self_attn."
    for name, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
        sd[a + f"{name}_proj.weight"] = r.normal((rows, d), d**-0.5)
        if h.get("attention_bias"):
            sd[a + f"{name}_proj.bias"] = r.normal((rows,), 0.1)
    sd[a + "o_proj.weight"] = r.normal((d, nh * hd), (nh * hd) ** -0.5)
    if h.get("use_qk_norm"):
        sd[a + "q_norm.weight"] = r.normal((hd,), 0.1, 1.0)
        sd[a + "k_norm.weight"] = r.normal((hd,), 0.1, 1.0)


def _ffn_sigmoid_moe(sd: dict, p: str, h: Mapping, r: _Random, i: int) -> None:
    """deepseek2 / glm4moe: dense FFN in the leading layers, then routed experts + shared experts."""
    d = h["hidden_size"]
    m = p + "mlp."
    if i < h["first_k_dense_replace"]:
        f = h["intermediate_size"]
        sd[m + "gate_proj.weight"] = r.normal((f, d), d**-0.5)
        sd[m + "up_proj.weight"] = r.normal((f, d), d**-0.5)
        sd[m + "down_proj.weight"] = r.normal((d, f), f**-0.5)
        return
    e, f = h["n_routed_experts"], h["moe_intermediate_size"]
    fs = f * h["n_shared_experts"]
    sd[m + "gate.weight"] = r.normal((e, d), 8 * d**-0.5)
    sd[m + "gate.e_score_correction_bias"] = r.normal((e,), 0.3)
    sd[m + "experts.gate_up_proj"] = r.normal((e, 2 * f, d), d**-0.5)
    sd[m + "experts.down_proj"] = r.normal((e, d, f), f**-0.5)
    sd[m + "shared_experts.gate_proj.weight"] = r.normal((fs, d), d**-0.5)
    sd[m + "shared_experts.up_proj.weight"] = r.normal((fs, d), d**-0.5)
    sd[m + "shared_experts.down_proj.weight"] = r.normal((d, fs), fs**-0.5)


_ATTN: dict[str, Callable[..., None]] = {
    "gpt-oss": _attn_gpt_oss,
    "qwen3next": _attn_qwen3next,
    "deepseek2": _attn_mla,
    "glm4moe": _attn_glm4moe,
}
_FFN: dict[str, Callable[..., None]] = {
    "gpt-oss": _ffn_gpt_oss,
    "qwen3next": _moe_qwen3next,
    "deepseek2": _ffn_sigmoid_moe,
    "glm4moe": _ffn_sigmoid_moe,
}


# ---------------------------------------------------------------------------------------------------------------
# The converter: HF names and layouts -> GGUF


def _convert(spec: FamilySpec, sd: dict[str, np.ndarray], store: _Store) -> None:
    h = spec.hf
    n_blocks = h["num_hidden_layers"] + h.get("num_nextn_predict_layers", 0)
    tmap = gguf.get_tensor_name_map(_ARCH_ENUM[spec.arch], n_blocks)

    def gname(hf_name: str) -> str:
        base, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf_name, "weight"
        out = tmap.get_name(base)
        if out is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        return f"{out}.{suffix}"

    def put(name: str, w: np.ndarray) -> None:
        # Vectors, convolution kernels and routers stay F32 (llama.cpp's quantizer leaves routers alone).
        small = w.ndim == 1 or name.endswith(("norm.weight", ".bias", "ssm_conv1d.weight"))
        if small or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
            store.f32(name, w)
        else:
            store.matrix(name, w)

    def gate_up(hf_name: str, gate: np.ndarray, up: np.ndarray, suffix: str) -> None:
        """Separate gate and up experts, or with the converter's `fuse_gate_up_exps` one tensor of both."""
        base = hf_name.removesuffix("gate_up_proj")
        if h.get("fuse_gate_up"):
            b = gname(base + "gate_proj.weight").split(".")[1]
            put(f"blk.{b}.ffn_gate_up_exps.{suffix}", np.concatenate((gate, up), axis=1))
        else:
            put(gname(base + f"gate_proj.{suffix}"), gate)
            put(gname(base + f"up_proj.{suffix}"), up)

    for name, w in sd.items():
        if spec.arch == "gpt-oss":
            if name.endswith("self_attn.sinks"):
                put(gname(name.replace("sinks", "sinks.weight")), w)
                continue
            if name.endswith("experts.gate_up_proj"):
                wt = w.transpose(0, 2, 1)  # [E, 2F, D], gate and up rows interleaved
                gate_up(name, wt[:, 0::2], wt[:, 1::2], "weight")
                continue
            if name.endswith("experts.gate_up_proj_bias"):
                gate_up(name.removesuffix("_bias"), w[:, 0::2], w[:, 1::2], "bias")
                continue
            if name.endswith("experts.down_proj"):
                put(gname(name), w.transpose(0, 2, 1))  # [E, D, F]
                continue
            if name.endswith("experts.down_proj_bias"):
                put(gname(name.replace("down_proj_bias", "down_proj.bias")), w)
                continue
        if name.endswith("experts.gate_up_proj"):  # [E, 2F, D]: gate rows first
            f = w.shape[1] // 2
            gate_up(name, w[:, :f], w[:, f:], "weight")
            continue
        if name.endswith("experts.down_proj"):
            put(gname(name), w)
            continue
        if spec.arch == "qwen3next":
            if name.endswith(".dt_bias"):
                put(gname(name.replace(".dt_bias", ".dt_proj.bias")), w)
                continue
            if name.endswith("conv1d.weight"):
                put(gname(name), w.squeeze(1))  # [C, K]
                continue
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                w = w + 1.0
            if name.endswith("in_proj_qkvz.weight") and h.get("split_qkvz", True):
                qkv, z = _split_qkvz(w, h)
                b = name.split(".")[2]
                store.matrix(f"blk.{b}.attn_qkv.weight", qkv)
                store.matrix(f"blk.{b}.attn_gate.weight", z)
                continue
        if spec.arch == "deepseek2" and name.endswith("kv_b_proj.weight") and h.get("split_kv_b", True):
            nh, nope, vd = h["num_attention_heads"], h["qk_nope_head_dim"], h["v_head_dim"]
            kv_b = w.reshape(nh, nope + vd, w.shape[-1])
            put(
                gname(name.replace("kv_b_proj", "k_b_proj")), kv_b[:, :nope].transpose(0, 2, 1)
            )  # [H, kvl, nope]
            put(gname(name.replace("kv_b_proj", "v_b_proj")), kv_b[:, nope:])  # [H, vd, kvl]
            continue
        if name.endswith("e_score_correction_bias"):  # llama.cpp: blk.N.exp_probs_b.bias
            store.f32(gname(name.replace("e_score_correction_bias", "e_score_correction.bias")), w)
            continue
        if name.endswith(".A_log"):  # stored without a suffix, as Mamba's ssm_a is
            store.f32(gname(name).removesuffix(".weight"), -np.exp(w))
            continue
        put(gname(name), w)


def _split_qkvz(w: np.ndarray, h: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_qkvz rows are grouped per key head [q, k, v, z]; the GGUF holds all q | all k | all v, and z apart."""
    nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    dk, dv = h["linear_key_head_dim"], h["linear_value_head_dim"]
    r = nv // nk
    g = w.reshape(nk, 2 * dk + 2 * r * dv, w.shape[-1])
    q, k = g[:, :dk], g[:, dk : 2 * dk]
    v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return np.concatenate(flat[:3]), flat[3]


# ---------------------------------------------------------------------------------------------------------------
# Metadata


def write_family_metadata(writer: gguf.GGUFWriter, spec: FamilySpec, name: str | None = None) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes for the family's HF config (and `general.name`)."""
    h, a = spec.hf, spec.arch
    d = h["hidden_size"]
    n_layer = h["num_hidden_layers"] + h.get("num_nextn_predict_layers", 0)
    writer.add_name(name or f"tiny-{a}")
    writer.add_block_count(n_layer)
    writer.add_context_length(h["max_position_embeddings"])
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(h["intermediate_size"])
    writer.add_head_count(h["num_attention_heads"])
    writer.add_layer_norm_rms_eps(h["rms_norm_eps"])
    writer.add_rope_freq_base(h["rope_theta"])
    if a == "gpt-oss":
        writer.add_head_count_kv(h["num_key_value_heads"])
        writer.add_key_length(h["head_dim"])
        writer.add_value_length(h["head_dim"])
        writer.add_sliding_window(h["sliding_window"])
        writer.add_expert_count(h["num_local_experts"])
        writer.add_expert_used_count(h["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(h["intermediate_size"])
        rs = h.get("rope_scaling")
        if rs:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rs["factor"])
            writer.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        if h.get("swiglu_limit", 7.0) != 7.0:
            writer.add_float32(f"{a}.swiglu_clamp_exp", float(h["swiglu_limit"]))
    elif a == "qwen3next":
        writer.add_head_count_kv(h["num_key_value_heads"])
        writer.add_key_length(h["head_dim"])
        writer.add_value_length(h["head_dim"])
        writer.add_expert_count(h["num_experts"])
        writer.add_expert_used_count(h["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(h["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
        writer.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(h["linear_key_head_dim"])
        writer.add_ssm_group_count(h["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(h["linear_num_value_heads"])
        writer.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
        writer.add_full_attention_interval(h["full_attention_interval"])
        writer.add_rope_dimension_count(int(h["head_dim"] * h["partial_rotary_factor"]))
    elif a == "deepseek2":
        kvl, rope = h["kv_lora_rank"], h["qk_rope_head_dim"]
        writer.add_head_count_kv(1)
        writer.add_leading_dense_block_count(h["first_k_dense_replace"])
        writer.add_vocab_size(0)
        if h.get("q_lora_rank"):
            writer.add_q_lora_rank(h["q_lora_rank"])
        writer.add_kv_lora_rank(kvl)
        writer.add_key_length(kvl + rope)
        writer.add_value_length(kvl)
        writer.add_key_length_mla(h["qk_nope_head_dim"] + rope)
        writer.add_value_length_mla(h["v_head_dim"])
        writer.add_expert_feed_forward_length(h["moe_intermediate_size"])
        writer.add_expert_count(h["n_routed_experts"])
        writer.add_expert_shared_count(h["n_shared_experts"])
        writer.add_expert_used_count(h["num_experts_per_tok"])
        writer.add_expert_weights_scale(h["routed_scaling_factor"])
        writer.add_expert_weights_norm(h["norm_topk_prob"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(h["n_group"])
        writer.add_expert_group_used_count(h["topk_group"])
        writer.add_rope_dimension_count(rope)
        rs = h.get("rope_scaling")
        if rs:  # DeepSeek's YaRN: the attention scale grows by (1 + 0.1 * mscale_all_dim * ln factor)^2
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rs["factor"])
            writer.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])
    else:  # glm4moe
        writer.add_head_count_kv(h["num_key_value_heads"])
        writer.add_key_length(h["head_dim"])
        writer.add_value_length(h["head_dim"])
        writer.add_rope_dimension_count(int(h["head_dim"] * h["partial_rotary_factor"]))
        writer.add_expert_count(h["n_routed_experts"])
        writer.add_expert_used_count(h["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(h["moe_intermediate_size"])
        writer.add_expert_shared_count(h["n_shared_experts"])
        writer.add_leading_dense_block_count(h["first_k_dense_replace"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(h["routed_scaling_factor"])
        writer.add_expert_weights_norm(h["norm_topk_prob"])
        writer.add_nextn_predict_layers(h["num_nextn_predict_layers"])
        if h["n_group"] > 1:
            writer.add_expert_group_count(h["n_group"])
            writer.add_expert_group_used_count(h["topk_group"])


def write_tiny_family(
    path: str | Path,
    arch: str,
    qtype: QT | str = QT.F32,
    seed: int = 0,
    types: Mapping[str, QT | str] | None = None,
    spec: FamilySpec | None = None,
    **hf_overrides: Any,
) -> Path:
    """Write a tiny `arch` model to `path`. `qtype` is the type of every weight matrix (norms, biases and small
    per-head tensors stay F32); `types` maps a GGUF name fragment (e.g. "ffn_down_exps") to another type."""
    spec = spec or default_spec(arch, **hf_overrides)
    qtype = QT[qtype] if isinstance(qtype, str) else qtype
    tmap = {k: QT[v] if isinstance(v, str) else v for k, v in (types or {}).items()}
    tok = tiny_bpe_metadata(seed=seed, vocab_size=512)
    vocab = len(tok["tokenizer.ggml.tokens"])
    store = _Store(qtype, tmap, seed)
    _convert(spec, _hf_weights(spec, vocab, seed), store)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    write_family_metadata(writer, spec)
    write_tokenizer(writer, tok)
    for name, data, raw_dtype in store.tensors:
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def with_hf(spec: FamilySpec, **hf: Any) -> FamilySpec:
    return replace(spec, hf={**spec.hf, **hf})
