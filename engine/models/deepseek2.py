"""`deepseek2`: DeepSeek-V2/V2.5/V3/R1 and relatives (Kimi K2, ...).

Multi-head latent attention: each position keeps one compressed latent c [kv_lora_rank] (normalised) and one
shared RoPE key k_pe [qk_rope] - the KV cache holds exactly these (as a one-head cache: k = k_pe, v = c). Queries
come from `attn_q` or from the low-rank `attn_q_a` -> norm -> `attn_q_b`; their no-RoPE part is absorbed into the
latent space through `attn_k_b` ([H, kv_lora, nope]: k_nope = k_b^T c), attention runs over [c, k_pe] directly and
its latent output is expanded per head through `attn_v_b` ([H, v_dim, kv_lora]). Older files carry the unsplit
`attn_kv_b` instead; then keys and values are expanded from the cached latents. RoPE rotates adjacent pairs
(llama.cpp NORM mode; HF's interleaved layout gives the same scores). The attention scale is 1/sqrt(nope + rope),
times (1 + yarn_log_multiplier * ln factor)^2 under YaRN, whose cos/sin stay unscaled.

FFN: dense in the first `leading_dense_block_count` layers, then routed experts (softmax scores for V2, sigmoid
scores with the selection bias `exp_probs_b` for V3; top-k within the best expert groups when the file gives
groups; weights optionally renormalised, then scaled by `expert_weights_scale`) plus shared experts."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from gguf import Keys

from engine.gguf import names
from engine.gguf.model_config import (
    Meta,
    ModelConfig,
    ModelConfigError,
    common_fields,
    moe_fields,
    rope_from_meta,
)
from engine.gguf.reader import GGUFFile
from engine.layers.attention import attention, causal_mask
from engine.layers.kv_cache import KVCache
from engine.layers.moe import Experts, ExpertWeights, count_experts
from engine.layers.qtensor import QTensor
from engine.layers.rope import Rope
from engine.models.family_base import (
    DenseFFN,
    FamilyLM,
    Weights,
    grouped_route,
    load_experts,
)

ARCH = "deepseek2"
GATING_SOFTMAX, GATING_SIGMOID = 1, 2


@dataclass(frozen=True)
class RoutedConfig(ModelConfig):
    """The routing of DeepSeek-style MoE (deepseek2, glm4moe)."""

    n_dense_lead: int = 0  # leading layers with a dense FFN
    sigmoid_gating: bool = False
    n_group: int = 1
    topk_group: int = 1
    weights_scale: float = 1.0


@dataclass(frozen=True)
class DeepseekConfig(RoutedConfig):
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_dim: int = 128


def routed_fields(m: Meta, arch: str, default_gating: int) -> dict[str, Any]:
    moe = moe_fields(m, norm_default=False, required=True)
    gating = m.int(Keys.LLM.EXPERT_GATING_FUNC, default_gating) or default_gating
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise ModelConfigError(f"{arch}: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    n_group = m.int(Keys.LLM.EXPERT_GROUP_COUNT, 1) or 1
    if moe["n_expert"] % n_group:
        raise ModelConfigError(f"{arch}: {moe['n_expert']} experts do not split into {n_group} groups")
    return {
        **moe,
        "n_ff_shexp": m.int(Keys.LLM.EXPERT_SHARED_COUNT, 0) * moe["n_ff_exp"],
        "n_dense_lead": m.int(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "sigmoid_gating": gating == GATING_SIGMOID,
        "n_group": n_group,
        "topk_group": m.int(Keys.LLM.EXPERT_GROUP_USED_COUNT, n_group) or n_group,
        "weights_scale": m.float(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0) or 1.0,
    }


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    kv_lora = m.int(Keys.Attention.KV_LORA_RANK)
    rope_dim = m.int(Keys.Rope.DIMENSION_COUNT)
    # The file describes MLA as one-head attention over [latent, k_pe]; the per-head sizes are the _mla keys.
    k_mla = m.int(Keys.Attention.KEY_LENGTH_MLA, base["head_dim_k"])
    v_mla = m.int(Keys.Attention.VALUE_LENGTH_MLA, base["head_dim_v"])
    rope = rope_from_meta(m, rope_dim, neox=False)
    scale = k_mla**-0.5
    if rope.scaling == "yarn":
        log_mul = m.float(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0)
        mscale = 1.0 + log_mul * math.log(rope.factor) if log_mul else 1.0
        scale *= mscale * mscale
        # cos/sin carry no magnitude scaling here: cancel the (1 + 0.1 ln factor) the YaRN rotation would apply
        rope = replace(rope, yarn_attn_factor=1.0 / (1.0 + 0.1 * math.log(rope.factor)))
    base.update(attn_scale=scale)
    return DeepseekConfig(
        arch=ARCH,
        rope=rope,
        q_lora_rank=m.int(Keys.Attention.Q_LORA_RANK, 0),
        kv_lora_rank=kv_lora,
        qk_nope=k_mla - rope_dim,
        qk_rope=rope_dim,
        v_dim=v_mla,
        **base,
        **routed_fields(m, ARCH, GATING_SOFTMAX),
    )


@dataclass
class RoutedFFN:
    experts: ExpertWeights | None  # None: a dense layer
    dense: DenseFFN | None
    score_bias: torch.Tensor | None  # [E] `exp_probs_b`
    shared: DenseFFN | None


def load_routed_ffn(model: FamilyLM, w: Weights, i: int) -> RoutedFFN:
    c = model.cfg
    assert isinstance(c, RoutedConfig)
    n, d = names.blk, c.n_embd
    if i < c.n_dense_lead or not w.has(n(i, "ffn_gate_inp")):
        return RoutedFFN(None, DenseFFN.load(w, i, "", d, c.n_ff), None, None)
    return RoutedFFN(
        experts=load_experts(w, i, c.n_expert, d, c.n_ff_exp, host=model._experts_on_host),
        dense=None,
        score_bias=w.opt_f(n(i, "exp_probs_b", "bias"), (c.n_expert,)),
        shared=DenseFFN.load(w, i, "_shexp", d, c.n_ff_shexp) if c.n_ff_shexp else None,
    )


def routed_ffn(
    model: FamilyLM, i: int, ffn: RoutedFFN, x: torch.Tensor, experts: Experts | None
) -> torch.Tensor:
    """x [T, D] -> float32 [T, D]; the routed experts through `experts` (layer i's backend)."""
    c = model.cfg
    assert isinstance(c, RoutedConfig)
    if ffn.experts is None:
        assert ffn.dense is not None
        return ffn.dense(x).float()
    w, ids = grouped_route(
        x,
        ffn.experts.router,
        c.n_expert_used,
        c.sigmoid_gating,
        ffn.score_bias,
        c.n_group,
        c.topk_group,
        c.expert_weights_norm,
        c.weights_scale,
    )
    count_experts(model._counts(i), ids)
    assert experts is not None
    y = experts.mix(x, w, ids)
    if ffn.shared is not None:
        y = y + ffn.shared(x).float()
    return y


@dataclass
class MLAWeights:
    q: QTensor | None  # [H * (nope + rope), D]
    q_a: QTensor | None  # [q_lora, D]
    q_a_norm: torch.Tensor | None
    q_b: QTensor | None  # [H * (nope + rope), q_lora]
    kv_a: QTensor  # [kv_lora + rope, D]
    kv_a_norm: torch.Tensor
    k_b: QTensor | None  # [H, kv_lora, nope]
    v_b: QTensor | None  # [H, v_dim, kv_lora]
    kv_b: QTensor | None  # [H * (nope + v_dim), kv_lora] (older files)
    o: QTensor  # [D, H * v_dim]


@dataclass
class DeepseekLayer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    attn: MLAWeights
    ffn: RoutedFFN

    @property
    def experts(self) -> ExpertWeights | None:
        return self.ffn.experts


class DeepseekLM(FamilyLM):
    supports_flash_prefill = False  # MLA attends over its latents (its own attention, below)
    cfg: DeepseekConfig
    layers: dict[int, DeepseekLayer]  # type: ignore[assignment]

    def _before_layers(self, gf: GGUFFile) -> None:
        assert isinstance(self.cfg, DeepseekConfig)
        self.rope = Rope(self.cfg.rope)

    def _load_layer(self, w: Weights, i: int) -> DeepseekLayer:
        c = self.cfg
        n, d, h = names.blk, c.n_embd, c.n_head
        qk = c.qk_nope + c.qk_rope
        low_rank = c.q_lora_rank > 0
        split = w.has(n(i, "attn_k_b"))
        attn = MLAWeights(
            q=None if low_rank else w.q(n(i, "attn_q"), (h * qk, d)),
            q_a=w.q(n(i, "attn_q_a"), (c.q_lora_rank, d)) if low_rank else None,
            q_a_norm=w.f(n(i, "attn_q_a_norm"), (c.q_lora_rank,)) if low_rank else None,
            q_b=w.q(n(i, "attn_q_b"), (h * qk, c.q_lora_rank)) if low_rank else None,
            kv_a=w.q(n(i, "attn_kv_a_mqa"), (c.kv_lora_rank + c.qk_rope, d)),
            kv_a_norm=w.f(n(i, "attn_kv_a_norm"), (c.kv_lora_rank,)),
            k_b=w.q(n(i, "attn_k_b"), (h, c.kv_lora_rank, c.qk_nope)) if split else None,
            v_b=w.q(n(i, "attn_v_b"), (h, c.v_dim, c.kv_lora_rank)) if split else None,
            kv_b=None if split else w.q(n(i, "attn_kv_b"), (h * (c.qk_nope + c.v_dim), c.kv_lora_rank)),
            o=w.q(n(i, "attn_output"), (d, h * c.v_dim)),
        )
        return DeepseekLayer(
            attn_norm=w.f(n(i, "attn_norm"), (d,)),
            ffn_norm=w.f(n(i, "ffn_norm"), (d,)),
            attn=attn,
            ffn=load_routed_ffn(self, w, i),
        )

    def _mla(
        self,
        i: int,
        aw: MLAWeights,
        x: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        c = self.cfg
        t, h, kvl = x.shape[0], c.n_head, c.kv_lora_rank
        if aw.q_a is not None:
            assert aw.q_b is not None
            q = aw.q_b.linear(self.norm(aw.q_a.linear(x), aw.q_a_norm, self.dtype))
        else:
            assert aw.q is not None
            q = aw.q.linear(x)
        q = q.view(t, h, c.qk_nope + c.qk_rope)
        q_nope, q_pe = q[..., : c.qk_nope], q[..., c.qk_nope :].contiguous()
        kv = aw.kv_a.linear(x)  # [T, kv_lora + rope]
        latent = self.norm(kv[:, :kvl], aw.kv_a_norm, self.dtype).view(t, 1, kvl)
        q_pe = self.rope.apply_at(q_pe, pos)
        k_pe = self.rope.apply_at(kv[:, kvl:].contiguous().view(t, 1, c.qk_rope), pos)
        k_pes, latents = cache.store(i, pos, k_pe, latent, span)  # [S, 1, rope], [S, 1, kv_lora]
        mask = masks[0] if masks is not None and 0 in masks else causal_mask(pos, span, 0)
        if aw.k_b is not None:
            assert aw.v_b is not None
            k_b = aw.k_b.dequant(q.dtype)  # [H, kv_lora, nope]
            q_lat = torch.einsum("thn,hcn->thc", q_nope, k_b)  # [T, H, kv_lora]
            keys = torch.cat((latents, k_pes), dim=-1)  # [S, 1, kv_lora + rope]
            a = attention(
                torch.cat((q_lat, q_pe), dim=-1), keys, latents, mask, c.attn_scale
            )  # [T, H, kv_lora]
            out = torch.einsum("thc,hvc->thv", a, aw.v_b.dequant(a.dtype))  # [T, H, v_dim]
        else:
            assert aw.kv_b is not None
            s = latents.shape[0]
            kvb = aw.kv_b.linear(latents.view(s, kvl)).view(s, h, c.qk_nope + c.v_dim)
            keys = torch.cat((kvb[..., : c.qk_nope], k_pes.expand(s, h, c.qk_rope)), dim=-1)
            out = attention(
                torch.cat((q_nope, q_pe), dim=-1),
                keys,
                kvb[..., c.qk_nope :].contiguous(),
                mask,
                c.attn_scale,
            )
        return aw.o.linear(out.reshape(t, h * c.v_dim))

    def layer_at(
        self,
        i: int,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        lw = self.layers[i]
        h = h.float()
        x = self.norm(h, lw.attn_norm, self.dtype)
        h = h + self._mla(i, lw.attn, x, cache, pos, span, masks).float()
        x = self.norm(h, lw.ffn_norm, self.dtype)
        return h + routed_ffn(self, i, lw.ffn, x, self.moe.get(i))

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        """Per position: the RoPE key as K [1, rope] and the latent as V [1, kv_lora]."""
        c = self.cfg
        return KVCache(
            self.layer_range, max_ctx, 1, c.qk_rope, c.kv_lora_rank, kv_type, self.device, self.kv_host_layers
        )


MODEL_CLASS = DeepseekLM
