"""Causal grouped-query attention over the KV cache, with sliding windows, logit soft-capping and attention sinks."""

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import kernels
from engine.kernels import cpu_attention
from engine.layers.kv_cache import KVCache
from engine.layers.qtensor import QTensor, linear_many
from installer.engine_options import runtime_switches

# Steps of more rows than this attend through the flash prompt kernel on CUDA; decode-sized steps have their own
# kernel (engine/kernels/attention.py) or are too small for a block of query rows to pay.
FLASH_MIN_ROWS = 8
# ... and so does a step of a few rows over a span longer than this: torch's path copies the whole span of every
# layer's keys and values to the compute dtype (at 32K positions 3 GB a step for Qwen3-30B-A3B), which held the
# few new tokens of a request sharing a 32K-token prefix for 0.25 s.
FLASH_DEEP_SPAN = 2048


def takes_flash(kernel: Any, rows: int, span: int) -> bool:
    """Whether a step of `rows` rows over `span` positions attends through the flash prompt kernel."""
    return kernel is not None and (rows > FLASH_MIN_ROWS or (rows > 1 and span > FLASH_DEEP_SPAN))


def project_qkv(
    x: torch.Tensor,
    q: QTensor,
    k: QTensor,
    v: QTensor,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    v_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] -> queries, keys, values [T, H*Dh] with their biases where the family has them."""
    ys = linear_many([q, k, v], x)  # decode rows on the CPU: one kernel call for the three
    out = [y if b is None else y + b.to(y.dtype) for y, b in zip(ys, (q_bias, k_bias, v_bias), strict=True)]
    return out[0], out[1], out[2]


def causal_mask(q_pos: torch.Tensor, k_len: int, window: int) -> torch.Tensor:
    """Boolean [T, S] mask, True where query position may attend key position."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if window > 0:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    return allowed


_SCORE_ELEMS = 1 << 26  # 256 MB of float32 scores: within the workspace the expert cache leaves (policy.py)


# Not cuDNN's attention: it builds a plan for every new (rows, keys) shape, which made the first prompt of each new
# length wait ~40 ms more than the next one of that length.
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attention(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [S, Hkv, Dk]
    v: torch.Tensor,  # [S, Hkv, Dv]
    mask: torch.Tensor,  # [T, S] bool
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """-> [T, H, Dv]. Long prompt chunks go in slices of query rows, so that a kernel that materialises the
    [H, T, S] scores (the masked, grouped case) holds at most ~_SCORE_ELEMS of them at once."""
    t, n_head, s = q.shape[0], q.shape[1], k.shape[0]
    rows = max(1, _SCORE_ELEMS // (n_head * s))
    if t > rows:
        return torch.cat(
            [attention(q[a : a + rows], k, v, mask[a : a + rows], scale, softcap) for a in range(0, t, rows)]
        )
    if not q.is_cuda and t <= GROUPED_MAX_ROWS:
        return _grouped(q, k, v, mask, scale, softcap)
    n_kv = k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D], [Hkv, S, D]
    if softcap <= 0:
        if q.is_cuda:
            # CUDA's fused kernels want 4-D inputs, and the one that takes a mask (memory-efficient) does not take
            # grouped heads: otherwise torch falls back to its float32 math path, which held a 4,096-token prompt
            # for a third of its time. So: a batch dimension, and the key/value heads repeated.
            if n_head != n_kv:
                kh, vh = (
                    kh.repeat_interleave(n_head // n_kv, dim=0),
                    vh.repeat_interleave(n_head // n_kv, dim=0),
                )
            with sdpa_kernel(_CUDA_BACKENDS):
                out = F.scaled_dot_product_attention(
                    qh[None], kh[None], vh[None], attn_mask=mask, scale=scale
                )
            return out[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=n_head != n_kv
        )
        return out.transpose(0, 1)
    rep = n_head // n_kv
    kh, vh = kh.repeat_interleave(rep, dim=0), vh.repeat_interleave(rep, dim=0)
    scores = (qh.float() @ kh.float().transpose(1, 2)) * scale  # [H, T, S]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1).to(vh.dtype) @ vh  # [H, T, Dv]
    return out.transpose(0, 1)


# CPU steps of up to this many rows attend through `_grouped`: on 2 cores torch's SDPA with grouped heads took 375 us
# for one row of Gemma 3 270M's 4 heads over 300 keys, two products and a softmax 35.
GROUPED_MAX_ROWS = 16


def _grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """A few rows' attention as two products: each key head's group of query heads and all the rows against its
    keys at once, q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv], mask [T, S] -> [T, H, Dv]."""
    t, h, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = h // hkv
    qg = q.reshape(t, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * t, d)  # rows (query head in group, row)
    scores = (qg @ k.permute(1, 2, 0)) * scale  # [Hkv, G*T, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # the mask broadcast over a group's query heads (no repeated copy)
    scores = scores.view(hkv, g, t, -1).masked_fill(~mask, float("-inf")).view(hkv, g * t, -1)
    out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v.transpose(0, 1)  # [Hkv, G*T, Dv]
    return out.reshape(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, h, dv)


_QUERY_BLOCK = 128  # queries per score block: bounds the [H, block, S] scores of long prompt chunks


def sink_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, Dv]
    mask: torch.Tensor,  # [T, S] bool
    scale: float,
    sinks: torch.Tensor,  # [H] float32 logits
) -> torch.Tensor:
    """Attention whose softmax has one more column per head, the sink logit, that is dropped afterwards."""
    n_head, n_kv = q.shape[1], k.shape[1]
    rep = n_head // n_kv
    kh = k.transpose(0, 1).float().repeat_interleave(rep, dim=0)  # [H, S, D]
    vh = v.transpose(0, 1).float().repeat_interleave(rep, dim=0)  # [H, S, Dv]
    outs = []
    for a in range(0, q.shape[0], _QUERY_BLOCK):
        qh = q[a : a + _QUERY_BLOCK].transpose(0, 1).float()  # [H, t, D]
        scores = (qh @ kh.transpose(1, 2)) * scale  # [H, t, S]
        scores = scores.masked_fill(~mask[a : a + _QUERY_BLOCK], float("-inf"))
        sink = sinks.view(n_head, 1, 1).expand(n_head, qh.shape[1], 1)
        p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # [H, t, S]
        outs.append((p @ vh).transpose(0, 1))  # [t, H, Dv]
    return torch.cat(outs).to(q.dtype)


def flash_kernel(device: torch.device) -> Any:
    """engine.kernels.prefill_attention for a model on a CUDA `device` with Triton (unless STRATA_FLASH_PREFILL=0);
    None elsewhere. Read once, at load: a chunk of each layer would otherwise read the environment."""
    if device.type != "cuda" or not runtime_switches().flash_prefill:
        return None
    return kernels.loaded("prefill_attention")


ROW_BY_ROW = 8  # CPU steps of up to this many rows attend row by row (cached_attention)


def cached_attention(
    cache: KVCache,
    layer: int,
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor,  # [T, Hkv, Dv]
    pos: torch.Tensor,  # [T] device positions
    span: int,
    window: int,
    scale: float,
    softcap: float = 0.0,
    masks: dict[int, torch.Tensor] | None = None,
    kernel: Any = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v at `pos` in `cache` and attend q to its positions below `span` -> [T, H, Dv]. `kernel`: the flash
    prompt kernel (flash_kernel), which the steps takes_flash names take: it reads the cache in place,
    int8 included, and skips the keys the mask rules out. Otherwise the cache's keys and values up to `span` in the
    compute dtype through torch, with `masks` (FamilyLM.step_masks) or a mask made here. `sinks` [H] (gpt-oss):
    a logit per head that joins each row's softmax with no value (sink_attention on the torch path)."""
    if takes_flash(kernel, q.shape[0], span):
        lk = cache.write(layer, pos, k, v, span).in_vram(span)
        return kernel.prefill_attention(
            q, lk.k, lk.v, pos, span, window, scale, softcap, lk.k_scale, lk.v_scale, sinks
        )
    keys, values = cache.store(layer, pos, k, v, span)
    if not q.is_cuda and q.shape[0] <= ROW_BY_ROW:
        # A few rows on the CPU (slots' decode rows, a verify window, a short chunk): each row as a one-token step
        # computes it (its own keys, no masked columns), so that the window's logits are the one-token steps' to
        # the bit. A float difference of 1e-6 here flips 8-bit activation codes downstream and can flip a greedy
        # near-tie. A row whose keys are few enough takes the Numba kernel (one call for all such rows: whether
        # it does depends on the row's own position only), the others torch.
        plist = pos.tolist()
        short = [sinks is None and cpu_attention.takes(q, keys, values, p + 1) for p in plist]
        if all(short):
            return cpu_attention.attend(q, keys, values, pos, window, scale, softcap)
        rows = []
        for j, p in enumerate(plist):  # row j: the keys up to its position, as a one-token step's
            one = (q[j : j + 1], keys[: p + 1], values[: p + 1])
            if short[j]:
                rows.append(cpu_attention.attend(*one, pos[j : j + 1], window, scale, softcap))
            else:
                rows.append(_attend(*one, causal_mask(pos[j : j + 1], p + 1, window), scale, softcap, sinks))
        return torch.cat(rows)
    mask = masks[window] if masks is not None and window in masks else causal_mask(pos, span, window)
    return _attend(q, keys, values, mask, scale, softcap, sinks)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The torch path's attention: with the sink logits where the family has them."""
    if sinks is not None:
        return sink_attention(q, keys, values, mask, scale, sinks)
    return attention(q, keys, values, mask, scale, softcap)
