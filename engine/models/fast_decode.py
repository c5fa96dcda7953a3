"""The decode-sized layer (a few tokens) of the shared decoder on CUDA in ~10 kernels instead of ~40.

At batch 1 a step is bound by how many kernels it launches, not by the bytes it reads, so this path fuses what the
general `DecoderLM.layer_at` runs as separate torch ops: one GEMV for q, k and v (their blocks concatenated at load),
norm + RoPE of queries and keys together with the cache write, attention straight from the cache, the output
projection with the residual add, the FFN norm with the router and its top-k (one launch), and the experts' down
projection with the weighted combine and the residual add. Same math as the general path; the tests compare them."""

from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType as QT

from engine import kernels
from engine.experts.backends import CachedExperts, expert_tables, fused_moe_available
from engine.experts.cache import MAX_STEP_ROWS
from engine.layers.kv_cache import KVCache, KVCacheError
from engine.layers.moe import ACTIVATIONS, route_and_count
from engine.layers.qtensor import QTensor
from installer.engine_options import runtime_switches

if TYPE_CHECKING:
    from engine.models.decoder import DecoderLM

# Token rows up to which a step takes this path (decode, and speculative verify windows).
FAST_MAX_ROWS = MAX_STEP_ROWS


def available(model: "DecoderLM") -> bool:
    """Whether `model`'s layers can run the fused decode path (CUDA, Triton, a family without post norms)."""
    if model.device.type != "cuda":
        return False
    if any(kernels.loaded(name) is None for name in ("attention", "fused", "gemv")):
        return False
    c = model.cfg
    if c.post_norms or c.n_head % c.n_head_kv != 0 or c.rope.dim > c.head_dim_k:
        return False
    if c.is_moe and model.expert_cache is None:
        return False
    return fused_experts(model)


def fused_experts(model: "DecoderLM") -> bool:
    """Whether every routed expert's block types have the fused decode kernels."""
    if model.expert_cache is None:
        return True
    c = model.cfg
    return all(
        fused_moe_available(le.gate.host.qtype, le.up.host.qtype, le.down.host.qtype, c.n_embd, c.n_ff_exp)
        for le in model.expert_cache.layers.values()
    )


def route_counts(model: "DecoderLM") -> dict[int, torch.Tensor] | None:
    """Per MoE layer, zeroed int32 counts [2, FAST_MAX_ROWS] that two launches count their finished programs in:
    the norm + router launch (fused.norm_route) and the down projection that also writes the next layer's norm
    (gemv.moe_down_combine's next_norm). Made at load, outside any graph capture. None with STRATA_NORM_ROUTE=0
    (the separate launches run instead)."""
    moe = [i for i, lw in model.layers.items() if lw.experts is not None]
    if not runtime_switches().norm_route or not moe:
        return None
    buf = torch.zeros(len(moe), 2, FAST_MAX_ROWS, dtype=torch.int32, device=model.device)
    return {i: buf[j] for j, i in enumerate(moe)}  # [2, rows]: the router's launch, the down projection's


def fuse_qkv(q, k, v):  # -> (qkv QTensor, q view, k view, v view), or None where the block types differ
    """One weight for the three projections (one GEMV launch); q, k and v become views of its rows."""
    if not (q.qtype == k.qtype == v.qtype) or q.raw.shape[-1] != k.raw.shape[-1] or q.raw.dim() != 2:
        return None
    raw = torch.cat((q.raw, k.raw, v.raw), dim=0)  # [qd + kd + vd, row_bytes]
    a, b = q.shape[0], q.shape[0] + k.shape[0]
    qkv = QTensor(raw, q.qtype, (raw.shape[0], q.shape[1]))
    return (
        qkv,
        QTensor(raw[:a], q.qtype, q.shape),
        QTensor(raw[a:b], k.qtype, k.shape),
        QTensor(raw[b:], v.qtype, v.shape),
    )


def layer(
    model: "DecoderLM",
    i: int,
    h: torch.Tensor,
    cache: KVCache,
    pos: torch.Tensor,
    span: int,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, D] float32 at positions `pos` [T] -> hidden [T, D] float32 (T <= FAST_MAX_ROWS). With `base`
    [T] (int64) the rows belong to several sequences whose caches are rows of `cache` (KVCache.split): row t's
    keys and values live at base[t] + pos[t], and `span` bounds every row's own positions."""
    attention, fused, gemv = kernels.attention, kernels.fused, kernels.gemv
    decode_attention, rope_store = attention.decode_attention, attention.rope_store
    norm_route, rms_norm, rms_norm_pair, rms_norm_q8 = (
        fused.norm_route,
        fused.rms_norm,
        fused.rms_norm_pair,
        fused.rms_norm_q8,
    )
    moe_down_combine, moe_gemv, quantize_q8, wants_q8 = (
        gemv.moe_down_combine,
        gemv.moe_gemv,
        gemv.quantize_q8,
        gemv.wants_q8,
    )
    if base is None and span > cache.max_ctx:
        raise KVCacheError(
            f"the sequence needs {span} positions but the KV cache holds {cache.max_ctx} (--max-context)"
        )
    c, lw, dt = model.cfg, model.layers[i], model.dtype
    qd, kd = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k
    lk = cache.layers[i]
    pre, model.prenormed = model.prenormed, None  # the layer before may have written this one's norm (8 bits)
    pre_q8 = pre[2] if pre is not None and pre[0] == i and pre[1] is h else None
    h = h.float()
    # Under --activations int8 a launch may read activations rounded to 8 bits (wants_q8): the norms write
    # them beside their float outputs, other inputs are rounded in one launch.
    if lw.qkv is not None and wants_q8(lw.qkv.qtype, *lw.qkv.shape):
        if pre_q8 is not None:
            qkv = lw.qkv.linear(h, q8=pre_q8, out_dtype=dt)  # [T, qd + kd + vd]
        else:
            x, _, xq = rms_norm_q8(h, lw.attn_norm, c.rms_eps, dt)
            qkv = lw.qkv.linear(x, q8=xq)
    else:
        x = rms_norm(h, lw.attn_norm, c.rms_eps, dt)
        qkv = (
            lw.qkv.linear(x)
            if lw.qkv is not None
            else torch.cat([w.linear(x) for w in (lw.q, lw.k, lw.v)], -1)
        )
    if lw.qkv_bias is not None:
        qkv = qkv + lw.qkv_bias
    swa = c.is_swa(i)
    rope = model.rope_swa if swa else model.rope
    q = rope_store(
        qkv[:, :qd], qkv[:, qd : qd + kd], qkv[:, qd + kd :], lw.q_norm, lw.k_norm, c.rms_eps, pos,
        rope.inv_effective(h.device), rope.cfg.dim, rope.cfg.neox, rope.mscale, lk.k, lk.v, c.n_head, dt, base,
        lk.k_scale, lk.v_scale,
    )  # fmt: skip
    window = c.sliding_window if swa else 0
    if wants_q8(lw.o.qtype, *lw.o.shape):  # the attention kernel writes the 8-bit form beside its output
        aq = torch.empty(q.shape[0], lw.o.shape[1], dtype=torch.float32, device=h.device)
        a = decode_attention(
            q, lk.k, lk.v, pos, span, window, c.attn_scale, c.attn_softcap, q8_out=aq, base=base,
            k_scale=lk.k_scale, v_scale=lk.v_scale,
        )  # fmt: skip
        h = lw.o.linear(a, residual=h, q8=aq)
    else:
        a = decode_attention(
            q, lk.k, lk.v, pos, span, window, c.attn_scale, c.attn_softcap, base=base,
            k_scale=lk.k_scale, v_scale=lk.v_scale,
        )  # fmt: skip
        h = lw.o.linear(a, residual=h)  # float32 [T, D]: h + o(a)
    if lw.experts is None:
        assert lw.ffn_gate is not None and lw.ffn_up is not None and lw.ffn_down is not None
        x = rms_norm(h, lw.ffn_norm, c.rms_eps, dt)
        act = ACTIVATIONS[c.activation]
        return lw.ffn_down.linear(act(lw.ffn_gate.linear(x)) * lw.ffn_up.linear(x), residual=h)
    assert model.expert_cache is not None
    le = model.expert_cache.layers[i]
    g, dn = le.gate.host, le.down.host
    f, d = g.shape[1], c.n_embd
    xq = None
    q8 = wants_q8(g.qtype, f, d, "moe")
    counts = model.expert_counts[i] if model.expert_counts is not None else None
    trace = model.route_trace  # a replayed or recorded routing trace counts what it passes on
    own = counts if trace is None else None
    done = model.route_done.get(i) if model.route_done is not None else None
    experts = model.moe[i]
    assert isinstance(experts, CachedExperts)
    cpu = model.expert_cache.cpu_misses  # --cpu-experts: reads the float32 input on the host
    pf = model.expert_cache.prefetch  # --expert-prefetch: the next layer's experts from the float32 input
    if done is not None and le.router.qtype == QT.F32 and le.router.raw.is_contiguous():
        # the norm and the router's logits in one launch (the top-k too, where the tuning file says so); the
        # float copies only where a later op reads them
        shexp = lw.shexp_gate is not None
        x, x32, xq, w, ids = norm_route(
            h, lw.ffn_norm, c.rms_eps, le.router.raw.view(torch.float32), c.n_expert_used, c.expert_weights_norm,
            own, done[0], dt if shexp or not q8 else None,
            lw.shexp_gate_inp is not None or cpu is not None or pf is not None, q8,
        )  # fmt: skip
    else:
        if q8:
            x, x32, xq = rms_norm_q8(h, lw.ffn_norm, c.rms_eps, dt, f32_copy=True)
        else:
            x, x32 = rms_norm_pair(h, lw.ffn_norm, c.rms_eps, dt)
        assert x32 is not None
        w, ids = route_and_count(x32, le.router, c.n_expert_used, c.expert_weights_norm, own)  # [T, k]
    if trace is not None and counts is not None:
        w, ids = trace.apply(i, w, ids, counts)
    tin = pf.tables(i) if pf is not None else None  # the tables with the experts prefetched for this layer
    claim = None
    if cpu is not None and x32 is not None:  # the CPU's slots: not copied, and no weight in the GPU's sum
        claim, w = experts.hand_off(ids, w, x32, tin)
    # gate, up, down tables; the ids they take
    gt, ut, dnt, sid = expert_tables(model.expert_cache, i, ids, claim, tin)
    if pf is not None and x32 is not None:  # PCIe's next work, after this layer's own copies
        pf.issue(i, x32)
    xin = x if xq is None else xq
    assert xin is not None
    hid = moe_gemv(gt, g.qtype, g.raw.shape[-1], sid, xin, f, d, c.n_expert_used, up_table=ut, act=c.activation,
                   q8=xq is not None)  # fmt: skip
    if lw.shexp_gate is not None:  # the shared expert joins the residual first; the routed ones add to that
        assert lw.shexp_up is not None and lw.shexp_down is not None and x is not None
        act = ACTIVATIONS[c.activation]
        s = lw.shexp_down.linear(act(lw.shexp_gate.linear(x)) * lw.shexp_up.linear(x)).float()
        if lw.shexp_gate_inp is not None:
            assert x32 is not None
            s = s * torch.sigmoid(x32 @ lw.shexp_gate_inp).unsqueeze(-1)  # [T, 1]
        h = h + s
    nxt, next_norm = model.layers.get(i + 1), None
    if (
        done is not None
        and claim is None  # the CPU's share joins the output after this launch
        and nxt is not None
        and nxt.qkv is not None
        and wants_q8(nxt.qkv.qtype, *nxt.qkv.shape)
    ):
        # the next layer's attention norm from this launch's last program (one launch fewer a layer)
        next_norm = (
            nxt.attn_norm,
            c.rms_eps,
            torch.empty(h.shape, dtype=torch.float32, device=h.device),
            done[1],
        )
    q8d = wants_q8(dn.qtype, d, f, "moe_down")
    out = moe_down_combine(dnt, dn.qtype, dn.raw.shape[-1], sid, w, quantize_q8(hid) if q8d else hid, h, d, f,
                           q8=q8d, next_norm=next_norm)  # fmt: skip
    if next_norm is not None:
        model.prenormed = (i + 1, out, next_norm[2])
    return experts.take_back(out, claim)
