"""Triton kernels for one decode step (one token) of a gated delta-net layer (qwen3next's linear attention).

The step in torch ops (engine/models/qwen3next.py `_delta_net`, engine/models/gated_delta.py) is ~45 small kernels
a layer: the causal convolution, the L2 norms of q and k, the decay and the gate, the delta rule's state update and
read-out, the gated RMS norm. Here it is two launches:

- `conv_step`: the depthwise causal convolution with SiLU over the new input row and the K-1 rows before it, and the
  shift of those rows (the convolution state) in place; one program per block of channels, so each channel's state
  is read and written by one program only.
- `delta_step`: per value head, the L2-normalised q and k of its key head, beta = sigmoid(b), the decay
  exp(A * softplus(a + dt_bias)), the state update S = S * decay + k (beta * (v - k S)) in place, the read-out q S
  and the gated RMS norm (weight, times SiLU of the gate z). One program per value head: its [Dk, Dv] state tile is
  read once and written once.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x_ptr,  # [C] the new row (the in-projection's q, k and v channels)
    state_ptr,  # float32 [K-1, C]: the rows before it, shifted in place
    w_ptr,  # [C, K] depthwise weights
    y_ptr,  # float32 [C]
    C,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    x = tl.load(x_ptr + c, mask=m, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * K + (K - 1), mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        r = tl.load(state_ptr + j * C + c, mask=m, other=0.0)
        acc += r * tl.load(w_ptr + c * K + j, mask=m, other=0.0).to(tl.float32)
        if j > 0:  # row j moves to j - 1 (every load of this program's channels comes first)
            tl.store(state_ptr + (j - 1) * C + c, r, mask=m)
    tl.store(state_ptr + (K - 2) * C + c, x, mask=m)
    tl.store(y_ptr + c, acc / (1.0 + tl.exp(-acc)), mask=m)  # SiLU


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [C] (any float type), state float32 [K-1, C] (updated in place: its rows shift up by one and x becomes the
    last), weight [C, K] -> SiLU of the causal convolution at the new row, float32 [C]."""
    c = x.numel()
    k = weight.shape[1]
    if k < 2 or tuple(state.shape) != (k - 1, c) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"conv state must be contiguous float32 [{k - 1}, {c}], not {tuple(state.shape)}")
    y = torch.empty(c, dtype=torch.float32, device=x.device)
    block = 256
    _conv_step_kernel[(triton.cdiv(c, block),)](
        x.contiguous(), state, weight.contiguous(), y, c, K=k, BLOCK=block
    )
    return y


@triton.jit
def _delta_step_kernel(
    y_ptr,  # float32 [2 * NK * DK + NV * DV]: q, k, v after the convolution
    z_ptr,  # [NV * DV] the output gate
    b_ptr,  # [NV] beta before its sigmoid
    a_ptr,  # [NV] the decay's input
    alog_ptr,  # [NV] A (negative): the decay is exp(A * softplus(a + dt_bias))
    dt_ptr,  # [NV] dt_bias
    nw_ptr,  # [DV] the gated norm's weight
    s_ptr,  # float32 [NV, DK, DV] the state, updated in place
    o_ptr,  # float32 [NV * DV]
    NK,
    R,  # value heads per key head
    eps,
    DK: tl.constexpr,
    DV: tl.constexpr,
):
    h = tl.program_id(0)
    kh = h // R
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(y_ptr + kh * DK + dk)
    k = tl.load(y_ptr + NK * DK + kh * DK + dk)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(y_ptr + 2 * NK * DK + h * DV + dv)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + h).to(tl.float32)))
    x = tl.load(a_ptr + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's softplus threshold
    decay = tl.exp(tl.load(alog_ptr + h).to(tl.float32) * softplus)
    sp = s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(sp) * decay  # [DK, DV]
    pred = tl.sum(k[:, None] * s, axis=0)  # [DV]: what the state already says for k
    u = (v - pred) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(sp, s)
    o = tl.sum(q[:, None] * s, axis=0)  # [DV]
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps) * tl.load(nw_ptr + dv).to(tl.float32)
    z = tl.load(z_ptr + h * DV + dv).to(tl.float32)
    tl.store(o_ptr + h * DV + dv, o * (z / (1.0 + tl.exp(-z))))


def delta_step(
    y: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    nk: int,
    eps: float,
) -> torch.Tensor:
    """One token: y float32 [2 * nk * Dk + Hv * Dv] (conv_step's output), z [Hv * Dv], b and a [Hv], a_log and
    dt_bias [Hv], norm_weight [Dv], state float32 [Hv, Dk, Dv] (updated in place) -> the gated, normed read-out
    float32 [Hv * Dv]."""
    hv, dk, dv = state.shape
    if hv % nk or y.numel() != 2 * nk * dk + hv * dv or not state.is_contiguous():
        raise ValueError(
            f"delta_step: y [{y.numel()}] does not fit {nk} key heads and a state {tuple(state.shape)}"
        )
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"delta_step needs power-of-two head sizes, not {dk} and {dv}")
    o = torch.empty(hv * dv, dtype=torch.float32, device=y.device)
    _delta_step_kernel[(hv,)](
        y, z.contiguous(), b.contiguous(), a.contiguous(), a_log, dt_bias, norm_weight, state, o, nk, hv // nk, eps,
        DK=dk, DV=dv, num_warps=8,
    )  # fmt: skip
    return o
