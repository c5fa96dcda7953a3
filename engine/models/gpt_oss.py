"""`gpt-oss`: OpenAI gpt-oss-20b / -120b.

Attention with biases and a learned sink logit per head (a softmax column that takes probability mass and adds
nothing), sliding-window layers alternating with full ones (the even layers slide), YaRN RoPE without the truncated
correction range; routed experts (usually MXFP4) with biases, a router with a bias whose top-k logits are
softmaxed, and the clamped SwiGLU `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with g = min(gate, l).
llama.cpp's converter splits the interleaved gate/up of the original into `ffn_gate_exps` / `ffn_up_exps` (or the
fused `ffn_gate_up_exps`) and stores the FFN norm as `post_attention_norm`."""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gguf import Keys

from engine.gguf import names
from engine.gguf.model_config import (
    Meta,
    ModelConfig,
    RopeConfig,
    common_fields,
    moe_fields,
    rope_from_meta,
)
from engine.gguf.reader import GGUFFile
from engine.layers.attention import cached_attention, project_qkv
from engine.layers.kv_cache import KVCache
from engine.layers.moe import ExpertBiases, ExpertMath, ExpertWeights, count_experts
from engine.layers.qtensor import QTensor
from engine.layers.rope import Rope
from engine.models.family_base import (
    FamilyLM,
    Weights,
    load_expert_biases,
    load_experts,
)

ARCH = "gpt-oss"
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA
    swiglu_limit: float = DEFAULT_SWIGLU_LIMIT


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    moe = moe_fields(m, norm_default=False, required=True)
    n_layer = base["n_layer"]
    window = m.int(Keys.Attention.SLIDING_WINDOW, 0)
    pattern = m.get(Keys.Attention.SLIDING_WINDOW_PATTERN, 2)
    if hasattr(pattern, "__len__"):
        swa = tuple(bool(x) for x in pattern)
    else:  # llama.cpp's pattern n: layer i slides unless i % n == n - 1
        p = int(pattern)
        swa = tuple(p > 0 and i % p < p - 1 for i in range(n_layer))
    limit = m.get(Keys.LLM.SWIGLU_CLAMP_EXP, DEFAULT_SWIGLU_LIMIT)
    if hasattr(limit, "__len__"):
        limit = max(float(x) for x in limit)
    return GptOssConfig(
        arch=ARCH,
        rope=rope_from_meta(m, base["head_dim_k"], neox=True, default_base=150000.0),
        sliding_window=window,
        swa_layers=swa if window else (),
        swiglu_limit=float(limit),
        **base,
        **moe,
    )


class UntruncatedYarnRope(Rope):
    """YaRN as gpt-oss was trained with it: the correction range between the beta_fast and beta_slow dimensions
    is not rounded outward to whole dimensions (HF `truncate: false`); llama.cpp's range is floor/ceil."""

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__(cfg)
        if cfg.scaling != "yarn":
            return
        dim, orig = cfg.dim, cfg.orig_ctx or 4096

        def corr(n_rot: float) -> float:
            return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))

        low, high = max(0.0, corr(cfg.yarn_beta_fast)), min(dim - 1.0, corr(cfg.yarn_beta_slow))
        ext = cfg.yarn_ext_factor if cfg.yarn_ext_factor >= 0 else 1.0
        i = torch.arange(0, dim, 2, dtype=torch.float64) / 2
        self.ramp_mix = (1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)) * ext
        eff = self.inv_freq * (self.interp_scale * (1 - self.ramp_mix) + self.ramp_mix)
        self.inv_freq_effective = eff.float()
        self._eff_cache.clear()


@dataclass
class GptOssLayer:
    attn_norm: torch.Tensor
    q: QTensor
    k: QTensor
    v: QTensor
    o: QTensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    sinks: torch.Tensor  # [H]
    ffn_norm: torch.Tensor
    experts: ExpertWeights
    router_bias: torch.Tensor | None  # [E]
    biases: ExpertBiases | None


class GptOssLM(FamilyLM):
    cfg: GptOssConfig
    layers: dict[int, GptOssLayer]  # type: ignore[assignment]

    def _before_layers(self, gf: GGUFFile) -> None:
        assert isinstance(self.cfg, GptOssConfig)
        self.rope = UntruncatedYarnRope(self.cfg.rope)

    def _windows(self) -> set[int]:
        return {0, self.cfg.sliding_window}

    def _load_layer(self, w: Weights, i: int) -> GptOssLayer:
        c = self.cfg
        n = names.blk
        d, hd, hv = c.n_embd, c.head_dim_k, c.head_dim_v
        qd, kd, vd = c.n_head * hd, c.n_head_kv * hd, c.n_head_kv * hv
        e, f = c.n_expert, c.n_ff_exp
        return GptOssLayer(
            attn_norm=w.f(n(i, "attn_norm"), (d,)),
            q=w.q(n(i, "attn_q"), (qd, d)),
            k=w.q(n(i, "attn_k"), (kd, d)),
            v=w.q(n(i, "attn_v"), (vd, d)),
            o=w.q(n(i, "attn_output"), (d, c.n_head * hv)),
            q_bias=w.opt_f(n(i, "attn_q", "bias"), (qd,)),
            k_bias=w.opt_f(n(i, "attn_k", "bias"), (kd,)),
            v_bias=w.opt_f(n(i, "attn_v", "bias"), (vd,)),
            o_bias=w.opt_f(n(i, "attn_output", "bias"), (d,)),
            sinks=w.f(n(i, "attn_sinks"), (c.n_head,)),
            ffn_norm=w.f(n(i, "post_attention_norm"), (d,)),
            experts=load_experts(w, i, e, d, f, host=self._experts_on_host),
            router_bias=w.opt_f(n(i, "ffn_gate_inp", "bias"), (e,)),
            biases=load_expert_biases(w, i, e, d, f),
        )

    def _expert_math(self, i: int) -> ExpertMath:
        return ExpertMath(glu=self._glu, biases=self.layers[i].biases, act=None)

    def _glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        lim, alpha = self.cfg.swiglu_limit, self.cfg.swiglu_alpha
        g = g.clamp(max=lim)
        u = u.clamp(min=-lim, max=lim)
        return (u + 1) * g * torch.sigmoid(alpha * g)

    def route(self, x: torch.Tensor, lw: GptOssLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> weights [T, k] float32, ids [T, k]: softmax over the top-k router logits."""
        logits = lw.experts.router.linear(x.float())  # [T, E]
        if lw.router_bias is not None:
            logits = logits + lw.router_bias
        top, ids = torch.topk(logits, self.cfg.n_expert_used, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def layer_at(
        self,
        i: int,
        h: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        c, lw = self.cfg, self.layers[i]
        t = h.shape[0]
        h = h.float()
        x = self.norm(h, lw.attn_norm, self.dtype)
        q, k, v = project_qkv(x, lw.q, lw.k, lw.v, lw.q_bias, lw.k_bias, lw.v_bias)
        q = self.rope.apply_at(q.view(t, c.n_head, c.head_dim_k), pos)
        k = self.rope.apply_at(k.view(t, c.n_head_kv, c.head_dim_k), pos)
        v = v.view(t, c.n_head_kv, c.head_dim_v)
        window = c.sliding_window if c.is_swa(i) else 0
        a = cached_attention(
            cache, i, q, k, v, pos, span, window, c.attn_scale, 0.0, masks, self.prefill_kernel, lw.sinks
        )
        a = lw.o.linear(a.reshape(t, c.n_head * c.head_dim_v))
        if lw.o_bias is not None:
            a = a + lw.o_bias.to(a.dtype)
        h = h + a  # promoted to float32 inside the add
        x = self.norm(h, lw.ffn_norm, self.dtype)
        wts, ids = self.route(x, lw)
        count_experts(self._counts(i), ids)
        y = self.moe[i].mix(x, wts, ids)
        return h + y


MODEL_CLASS = GptOssLM
