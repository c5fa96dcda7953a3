"""`qwen3next`: Qwen3-Next-80B-A3B and the seeds' Flash-Next family.

Three gated delta-net layers (linear attention with a recurrent state, engine/models/gated_delta.py) to every
full-attention layer (`full_attention_interval`); every layer's FFN is routed experts (softmax top-k, renormalised)
plus a shared expert scaled by a sigmoid gate.

- Delta-net layer: in-projections to q|k|v (`attn_qkv`, all q heads then all k then all v) and the output gate z
  (`attn_gate`) - older files hold HF's per-key-head grouped `ssm_in` instead -, and to beta|alpha (`ssm_ba`,
  grouped per key head); a causal depthwise convolution with SiLU over q|k|v; L2-normalised q and k (q scaled by
  1/sqrt(Dk)); decay g = ssm_a * softplus(alpha + dt_bias) with ssm_a = -exp(A_log); value heads share key heads
  in groups; the output normalised per head and multiplied by silu(z) (gated RMSNorm), then `ssm_out`.
- Full-attention layer: `attn_q` yields query and output gate interleaved per head; per-head RMS norms on q and k;
  partial NEOX RoPE; the attention output is multiplied by sigmoid(gate).
- The converter stores the zero-centred norms with their +1 added (not the gated norm), so all norms multiply.

The recurrent state lives in a `RecurrentCache` (its docstring says how truncation, checkpoints, verify windows
and the prompt cache meet a state that cannot be indexed by position); a forward must start at `cache.length`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from gguf import Keys

from engine import kernels
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
from engine.layers.attention import cached_attention
from engine.layers.kv_cache import KVCache
from engine.layers.moe import ExpertWeights, count_experts, route
from engine.layers.qtensor import QTensor
from engine.layers.rope import Rope
from engine.models.family_base import DenseFFN, FamilyLM, Weights, load_experts
from engine.models.gated_delta import (
    RecurrentCache,
    _StepLog,
    causal_conv,
    delta_rule_chunked,
    delta_rule_steps,
)

ARCH = "qwen3next"
REPLAY_CHUNK = 512  # tokens per forward when positions lost to a truncation are read again


def fused_delta_net(dk: int, dv: int) -> bool:
    """Whether the two-launch delta-net decode step (engine/kernels/delta_net.py) serves these head sizes (powers
    of two); the torch ops run otherwise."""
    return dk & (dk - 1) == 0 and dv & (dv - 1) == 0


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    conv_kernel: int = 4
    ssm_k_heads: int = 16  # ssm.group_count
    ssm_v_heads: int = 32  # ssm.time_step_rank
    ssm_k_dim: int = 128  # ssm.state_size
    ssm_v_dim: int = 128  # ssm.inner_size / v heads
    full_attention_interval: int = 4

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim


def config_from_metadata(meta: Mapping[str, Any], n_vocab: int) -> ModelConfig:
    m = Meta(meta, ARCH)
    base = common_fields(m, n_vocab)
    moe = moe_fields(m, norm_default=True, required=True)
    k_heads, v_heads = m.int(Keys.SSM.GROUP_COUNT), m.int(Keys.SSM.TIME_STEP_RANK)
    inner = m.int(Keys.SSM.INNER_SIZE)
    if v_heads % k_heads or inner % v_heads:
        raise ModelConfigError(
            f"{ARCH}: {v_heads} value heads (ssm.time_step_rank) must be a multiple of {k_heads} key heads "
            f"(ssm.group_count) and divide ssm.inner_size {inner}"
        )
    return Qwen3NextConfig(
        arch=ARCH,
        rope=rope_from_meta(m, base["head_dim_k"], neox=True),
        qk_norm=True,
        n_ff_shexp=m.int(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0),
        shared_expert_gate=True,
        conv_kernel=m.int(Keys.SSM.CONV_KERNEL),
        ssm_k_heads=k_heads,
        ssm_v_heads=v_heads,
        ssm_k_dim=m.int(Keys.SSM.STATE_SIZE),
        ssm_v_dim=inner // v_heads,
        full_attention_interval=m.int(Keys.LLM.FULL_ATTENTION_INTERVAL, 4),
        **base,
        **moe,
    )


@dataclass
class DeltaNetWeights:
    qkv: QTensor | None  # [2*Kd + Vd, D] (all q | all k | all v)
    gate: QTensor | None  # [Vd, D] (z)
    qkvz: QTensor | None  # older files: [2*Kd + 2*Vd, D] grouped per key head
    ba: QTensor  # [2*Hv, D] grouped per key head
    conv: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv] = -exp(A_log)
    norm: torch.Tensor  # [Dv]
    out: QTensor  # [D, Vd]


@dataclass
class GatedAttentionWeights:
    q: QTensor  # [H * 2 * hd, D]: query and gate per head
    k: QTensor
    v: QTensor
    o: QTensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class Qwen3NextLayer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor  # `post_attention_norm` in the file
    delta: DeltaNetWeights | None
    attn: GatedAttentionWeights | None
    experts: ExpertWeights | None
    dense: DenseFFN | None
    shared: DenseFFN | None
    shared_gate: torch.Tensor | None  # [D]


class Qwen3NextLM(FamilyLM):
    cfg: Qwen3NextConfig
    layers: dict[int, Qwen3NextLayer]  # type: ignore[assignment]
    layer_major = False  # a forward checks and moves the recurrent state with the cache's length

    def _before_layers(self, gf: GGUFFile) -> None:
        assert isinstance(self.cfg, Qwen3NextConfig)
        self.rope = Rope(self.cfg.rope)

    def _load_layer(self, w: Weights, i: int) -> Qwen3NextLayer:
        c = self.cfg
        n = names.blk
        d = c.n_embd
        lw = Qwen3NextLayer(
            attn_norm=w.f(n(i, "attn_norm"), (d,)),
            ffn_norm=w.f(n(i, "post_attention_norm"), (d,)),
            delta=None,
            attn=None,
            experts=None,
            dense=None,
            shared=None,
            shared_gate=None,
        )
        if c.is_recurrent(i):
            kd, vd, hv = c.ssm_k_heads * c.ssm_k_dim, c.ssm_v_heads * c.ssm_v_dim, c.ssm_v_heads
            grouped = w.has(n(i, "ssm_in"))
            lw.delta = DeltaNetWeights(
                qkv=None if grouped else w.q(n(i, "attn_qkv"), (2 * kd + vd, d)),
                gate=None if grouped else w.q(n(i, "attn_gate"), (vd, d)),
                qkvz=w.q(n(i, "ssm_in"), (2 * kd + 2 * vd, d)) if grouped else None,
                ba=w.q(n(i, "ssm_ba"), (2 * hv, d)),
                conv=w.f(n(i, "ssm_conv1d"), (c.conv_dim, c.conv_kernel)),
                dt_bias=w.f(n(i, "ssm_dt", "bias"), (hv,)),
                a=w.f(n(i, "ssm_a", "weight").removesuffix(".weight"), (hv,)),
                norm=w.f(n(i, "ssm_norm"), (c.ssm_v_dim,)),
                out=w.q(n(i, "ssm_out"), (d, vd)),
            )
        else:
            hd, qd = c.head_dim_k, c.n_head * c.head_dim_k
            lw.attn = GatedAttentionWeights(
                q=w.q(n(i, "attn_q"), (2 * qd, d)),
                k=w.q(n(i, "attn_k"), (c.n_head_kv * hd, d)),
                v=w.q(n(i, "attn_v"), (c.n_head_kv * c.head_dim_v, d)),
                o=w.q(n(i, "attn_output"), (d, c.n_head * c.head_dim_v)),
                q_norm=w.f(n(i, "attn_q_norm"), (hd,)),
                k_norm=w.f(n(i, "attn_k_norm"), (hd,)),
            )
        if w.has(n(i, "ffn_gate_inp")):
            lw.experts = load_experts(w, i, c.n_expert, d, c.n_ff_exp, host=self._experts_on_host)
            if c.n_ff_shexp:
                lw.shared = DenseFFN.load(w, i, "_shexp", d, c.n_ff_shexp)
                lw.shared_gate = w.opt_f(n(i, "ffn_gate_inp_shexp"), (d,))
        else:
            lw.dense = DenseFFN.load(w, i, "", d, c.n_ff)
        return lw

    # ---- token mixers ----

    def _delta_net(
        self, i: int, dw: DeltaNetWeights, x: torch.Tensor, cache: KVCache, pos: torch.Tensor
    ) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        nk, nv, dk, dv = c.ssm_k_heads, c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim
        r, kd = nv // nk, nk * dk
        if dw.qkvz is not None:  # HF's grouping: per key head [q, k, v (r heads), z (r heads)]
            grp = dw.qkvz.linear(x).view(t, nk, 2 * dk + 2 * r * dv)
            q_part, k_part = grp[..., :dk].reshape(t, kd), grp[..., dk : 2 * dk].reshape(t, kd)
            v_part = grp[..., 2 * dk : 2 * dk + r * dv].reshape(t, nv * dv)
            qkv = torch.cat((q_part, k_part, v_part), dim=-1)
            z = grp[..., 2 * dk + r * dv :].reshape(t, nv, dv)
        else:
            assert dw.qkv is not None and dw.gate is not None
            qkv, z = dw.qkv.linear(x), dw.gate.linear(x).view(t, nv, dv)
        ba = dw.ba.linear(x).float().view(t, nk, 2 * r)
        b, a = ba[..., :r].reshape(t, nv), ba[..., r:].reshape(t, nv)  # [T, Hv]
        if not isinstance(cache, RecurrentCache):
            raise TypeError("qwen3next needs the RecurrentCache its new_cache makes")
        st = cache.state(i)
        if t == 1 and x.is_cuda and fused_delta_net(dk, dv):
            conv_step, delta_step = kernels.delta_net.conv_step, kernels.delta_net.delta_step
            # one token in two launches instead of ~45 (the states updated in place, as below)
            yc = conv_step(qkv[0], st.conv, dw.conv)  # float32 [C]
            o1 = delta_step(yc, z.reshape(-1), b[0], a[0], dw.a, dw.dt_bias, dw.norm, st.ssm, nk, c.rms_eps)
            return dw.out.linear(o1.view(1, nv * dv).to(self.dtype))
        y, window = causal_conv(qkv, st.conv, dw.conv)  # [T, C] float32
        q = y[:, :kd].view(t, nk, dk)
        k = y[:, kd : 2 * kd].view(t, nk, dk)
        v = y[:, 2 * kd :].view(t, nv, dv)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        if r > 1:  # value heads j share key head j // r
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        beta = torch.sigmoid(b)
        g = dw.a * F.softplus(a + dw.dt_bias)  # [T, Hv] log decay
        keep = 1 < t <= cache.step_states
        if t == 1 or keep:
            o, s, kept = delta_rule_steps(q, k, v, g, beta, st.ssm, keep=keep)
            if keep and kept is not None:
                start = int(pos[0])  # a verify window: not captured in a graph
                if cache.log is None or cache.log.start != start:
                    cache.log = _StepLog(start, t, {}, {})
                cache.log.conv[i] = window
                cache.log.ssm[i] = torch.cat((st.ssm[None], kept))
        else:
            o, s = delta_rule_chunked(q, k, v, g, beta, st.ssm)
        st.ssm.copy_(s)
        st.conv.copy_(window[window.shape[0] - st.conv.shape[0] :])
        o = self.norm(o, dw.norm) * F.silu(z.float())  # [T, Hv, Dv] gated RMSNorm
        return dw.out.linear(o.reshape(t, nv * dv).to(self.dtype))

    def _attention(
        self,
        i: int,
        aw: GatedAttentionWeights,
        x: torch.Tensor,
        cache: KVCache,
        pos: torch.Tensor,
        span: int,
        masks: dict[int, torch.Tensor] | None,
    ) -> torch.Tensor:
        c = self.cfg
        t, hd = x.shape[0], c.head_dim_k
        qg = aw.q.linear(x).view(t, c.n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, c.n_head * hd)
        q = self.rope.apply_at(q.contiguous(), pos, aw.q_norm, c.rms_eps)
        k = self.rope.apply_at(aw.k.linear(x).view(t, c.n_head_kv, hd), pos, aw.k_norm, c.rms_eps)
        v = aw.v.linear(x).view(t, c.n_head_kv, c.head_dim_v)
        a = cached_attention(cache, i, q, k, v, pos, span, 0, c.attn_scale, 0.0, masks, self.prefill_kernel)
        a = a.reshape(t, c.n_head * c.head_dim_v)
        return aw.o.linear(a * torch.sigmoid(gate.float()).to(a.dtype))

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
        h = h.float()
        x = self.norm(h, lw.attn_norm, self.dtype)
        if lw.delta is not None:
            a = self._delta_net(i, lw.delta, x, cache, pos)
        else:
            assert lw.attn is not None
            a = self._attention(i, lw.attn, x, cache, pos, span, masks)
        h = h + a  # promoted to float32 inside the add
        x = self.norm(h, lw.ffn_norm, self.dtype)
        if lw.experts is None:
            assert lw.dense is not None
            return h + lw.dense(x).float()
        w, ids = route(x, lw.experts.router, c.n_expert_used, c.expert_weights_norm)
        count_experts(self._counts(i), ids)
        y = self.moe[i].mix(x, w, ids)
        if lw.shared is not None:
            s = lw.shared(x).float()
            if lw.shared_gate is not None:
                s = s * torch.sigmoid(x.float() @ lw.shared_gate).unsqueeze(-1)  # [T, 1]
            y = y + s
        return h + y

    # ---- the sequence ----

    def forward(
        self, tokens: torch.Tensor, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [T] at positions start.. -> logits [T, V] ([1, V] with `last_only`). Positions the recurrent
        state lost to a truncation (see RecurrentCache) are read again first."""
        if not isinstance(cache, RecurrentCache):
            raise TypeError("qwen3next needs the RecurrentCache its new_cache makes")
        return cache.forward(
            tokens, start, lambda x, at, lo: self._step(x, cache, at, last_only=lo), last_only, REPLAY_CHUNK
        )

    def new_cache(self, max_ctx: int, kv_type: str) -> RecurrentCache:
        c = self.cfg
        attn = [i for i in self.layer_range if not c.is_recurrent(i)]
        state = (c.ssm_v_heads, c.ssm_k_dim, c.ssm_v_dim)
        states = {i: ((c.conv_kernel - 1, c.conv_dim), state) for i in self.layer_range if c.is_recurrent(i)}
        return RecurrentCache(
            attn, states, max_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type, self.device,
            host_layers=self.kv_host_layers,
        )  # fmt: skip


MODEL_CLASS = Qwen3NextLM
