"""The Triton kernels on the CPU, through Triton's interpreter, against gguf's dequantizers and the torch paths.

Opt-in (a machine without a GPU, Triton installed, TRITON_INTERPRET=1 set before Python starts): a developer
without a GPU checks a kernel change here first; the GPU tests (tests/engine/test_gpu_*.py) remain the measure.
Triton 3.5's interpreter converts loop bounds with int() on one-element arrays, which NumPy 2 refuses; the fixture
below converts them the way NumPy 1 did, for these tests only."""

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.quants import dequantize
from engine.gguf.random_blocks import random_blocks

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)


@pytest.fixture(autouse=True)
def _interpreter_loop_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    interp = pytest.importorskip("triton.runtime.interpreter")
    patch = interp._patch_lang_tensor  # re-applied at every launch: wrap it

    def patched(tensor: type, *scope: object) -> None:  # 3.9 passes a patch scope too
        patch(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _blocks(qt: QT, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qt, n, k, seed=seed))


@pytest.mark.parametrize(
    "qtype,variant,k",
    [("Q4_K", 0, 1280), ("Q4_K", 5, 1280), ("Q4_K", 10, 1280), ("Q4_K", 12, 1280), ("Q5_K", 4, 512), ("Q6_K", 1, 1280), ("Q6_K", 11, 1280), ("Q6_K", 13, 1280), ("Q8_0", 2, 352),
     ("Q4_0", 3, 352), ("MXFP4", 8, 352), ("IQ4_XS", 9, 512)],
)  # fmt: skip
def test_gemv_bodies(qtype: str, variant: int, k: int) -> None:
    from engine.kernels.gemv import APPROXIMATE, gemv, moe_down_combine, moe_gemv, q8_round

    qt, n = QT[qtype], 24
    raws = [_blocks(qt, n, k, 40 + i) for i in range(3)]
    deq = [dequantize(r, qt) for r in raws]
    x, r = torch.randn(2, k), torch.randn(2, n)
    if variant in APPROXIMATE:  # the 8-bit bodies compute on activations rounded as quantize_q8 rounds them
        x = q8_round(x)
    tol = 0.99999
    y = gemv(raws[0], qt, n, k, x, block_n=4, sb=2, num_warps=4, variant=variant, residual=r)
    assert _cos(y, r + x @ deq[0].T) >= tol
    table = torch.tensor([w.data_ptr() for w in raws])
    ids = torch.tensor([[2, 0], [1, 2]])
    h = moe_gemv(table, qt, raws[0].shape[1], ids, x, n, k, 2, up_table=table, act="silu", launch=(4, 2, 4),
                 variant=variant)  # fmt: skip
    ref = torch.stack([torch.nn.functional.silu(x[t] @ deq[e].T) * (x[t] @ deq[e].T) for t in range(2)
                       for e in ids[t].tolist()])  # fmt: skip
    assert _cos(h, ref) >= tol
    wt, xs = torch.rand(2, 2), torch.randn(4, k)
    if variant in APPROXIMATE:
        xs = q8_round(xs)
    got = moe_down_combine(
        table, qt, raws[0].shape[1], ids, wt, xs, r, n, k, launch=(4, 2, 4), variant=variant
    )
    want = torch.stack([r[t] + sum(wt[t, j] * (xs[2 * t + j] @ deq[int(ids[t, j])].T) for j in range(2))
                        for t in range(2)])  # fmt: skip
    assert _cos(got, want) >= tol


@pytest.mark.parametrize(
    "qtype,k,variant",
    [("Q4_K", 512, None), ("Q4_K", 512, 10), ("Q6_K", 512, None), ("Q8_0", 352, None), ("MXFP4", 352, None),
     ("IQ4_XS", 512, None)],
)  # fmt: skip
def test_grouped_expert_tiles(qtype: str, k: int, variant: int | None) -> None:
    from engine.kernels.moe_gemm import Blocks, moe_gemm

    qt, n, e, t, topk = QT[qtype], 40, 4, 9, 2
    raws = [_blocks(qt, n, k, 60 + i) for i in range(e)]
    deq = [dequantize(r, qt) for r in raws]
    table = torch.tensor([w.data_ptr() for w in raws])
    ids = torch.stack(
        [torch.randperm(e, generator=torch.Generator().manual_seed(i))[:topk] for i in range(t)]
    )
    x = torch.randn(t, k)
    y = moe_gemm(
        Blocks(ids, e),
        table,
        qt,
        raws[0].shape[1],
        x,
        n,
        k,
        topk,
        t * topk,
        up_table=table,
        act="silu",
        variant=variant,
    )
    ref = torch.stack([torch.nn.functional.silu(x[i] @ deq[j].T) * (x[i] @ deq[j].T) for i in range(t)
                       for j in ids[i].tolist()])  # fmt: skip
    assert _cos(y, ref) >= 0.99999


@pytest.mark.parametrize(
    "t,h,hkv,d,span,window,chunk", [(1, 8, 2, 64, 40, 0, 512), (2, 8, 2, 64, 130, 20, 64)]
)
def test_decode_attention(t: int, h: int, hkv: int, d: int, span: int, window: int, chunk: int) -> None:
    from engine.kernels.attention import decode_attention
    from engine.layers.attention import attention, causal_mask

    kc, vc = torch.randn(span + 5, hkv, d), torch.randn(span + 5, hkv, d)
    pos = torch.arange(span - t, span)
    q = torch.randn(t, h, d)
    got = decode_attention(q, kc, vc, pos, span, window, d**-0.5, chunk=chunk)
    ref = attention(q, kc[:span], vc[:span], causal_mask(pos, span, window), d**-0.5).reshape(t, -1)
    assert (got - ref).abs().max().item() < 1e-5
    # the 8-bit form written beside it (the output projection's input under --activations int8), one launch
    # or split and merged: the bytes quantize_q8 makes of the float output
    from engine.kernels.gemv import quantize_q8_torch

    aq = torch.empty(t, h * d)  # split spans: the merge writes it
    again = decode_attention(q, kc, vc, pos, span, window, d**-0.5, chunk=chunk, q8_out=aq)
    assert torch.equal(again, got)
    n = h * d + h * d // 4
    assert torch.equal(aq.view(torch.uint8)[:, :n], quantize_q8_torch(got).view(torch.uint8)[:, :n])


@pytest.mark.parametrize(
    "t,start,h,hkv,dk,dv,window,softcap,int8,sinks",
    [(37, 0, 4, 2, 64, 64, 0, 0.0, False, False), (100, 50, 8, 2, 64, 64, 0, 0.0, False, False),
     (70, 130, 4, 1, 32, 48, 40, 0.0, False, False), (33, 10, 4, 4, 64, 64, 0, 30.0, False, False),
     (64, 90, 4, 2, 64, 64, 0, 0.0, True, False), (50, 20, 4, 2, 64, 64, 16, 0.0, False, True),
     (3, 2100, 4, 2, 64, 64, 0, 0.0, False, False), (8, 2200, 8, 2, 64, 64, 300, 0.0, True, False)],
)  # fmt: skip
def test_prefill_attention(
    t: int,
    start: int,
    h: int,
    hkv: int,
    dk: int,
    dv: int,
    window: int,
    softcap: float,
    int8: bool,
    sinks: bool,
) -> None:
    """The flash prompt kernel against the torch paths: causal rows deep into the cache, grouped heads, a window
    (the masked blocks at both ends), soft-capping, int8 codes with their scales, gpt-oss's sinks, and steps of a
    few rows deep into the cache (the new tokens after a long shared prefix)."""
    from engine.kernels.prefill_attention import prefill_attention
    from engine.layers.attention import attention, causal_mask, sink_attention

    torch.manual_seed(t + start)
    span = start + t
    q, kc, vc = torch.randn(t, h, dk), torch.randn(span + 5, hkv, dk), torch.randn(span + 5, hkv, dv)
    ks = vs = None
    keys, values = kc, vc
    if int8:
        ks, vs = (x.abs().amax(-1, keepdim=True) / 127 for x in (kc, vc))
        kc, vc = (torch.round(x / s).to(torch.int8) for x, s in ((kc, ks), (vc, vs)))
        ks, vs = ks.half(), vs.half()
        keys, values = kc.float() * ks.float(), vc.float() * vs.float()
    pos = torch.arange(start, span)
    sk = torch.randn(h) if sinks else None
    got = prefill_attention(q, kc, vc, pos, span, window, dk**-0.5, softcap, ks, vs, sk)
    mask = causal_mask(pos, span, window)
    if sk is not None:
        ref = sink_attention(q, keys[:span], values[:span], mask, dk**-0.5, sk)
    else:
        ref = attention(q, keys[:span], values[:span], mask, dk**-0.5, softcap)
    # soft-capping's tanh from exp: a few float32 ulps of the cap on each score
    assert (got - ref).abs().max().item() < (1e-4 if softcap else 1e-5)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_store(neox: bool) -> None:
    from engine.gguf.model_config import RopeConfig
    from engine.kernels.attention import rope_store
    from engine.layers.rope import Rope

    t, h, hkv, d = 2, 4, 2, 32
    rope = Rope(RopeConfig(dim=d, base=10000.0, neox=neox))
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    kc, vc = torch.zeros(10, hkv, d), torch.zeros(10, hkv, d)
    pos = torch.tensor([3, 7])
    q, k, v = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d], qkv[:, (h + hkv) * d :]
    qo = rope_store(q, k, v, qn, kn, 1e-6, pos, rope.inv_effective(torch.device("cpu")), d, neox, rope.mscale, kc,
                    vc, h, torch.float32)  # fmt: skip
    assert (qo - rope.apply_at(q.reshape(t, h, d), pos, qn, 1e-6)).abs().max().item() < 1e-5
    assert (kc[pos] - rope.apply_at(k.reshape(t, hkv, d), pos, kn, 1e-6)).abs().max().item() < 1e-5
    assert torch.equal(vc[pos], v.reshape(t, hkv, d))


def _write_through_rope_store(kv: str, d: int) -> tuple:
    """Two `kv` caches holding the same 150 positions; two rows more written into one by rope_store and into the
    other by KVCache.store -> (t, h, pos, queries, the kernel-written layer, the torch-written layer, keys and values
    torch's store gives back)."""
    from engine.gguf.model_config import RopeConfig
    from engine.kernels.attention import rope_store
    from engine.layers.kv_cache import KVCache
    from engine.layers.rope import Rope

    t, h, hkv, ctx = 2, 8, 2, 200
    rope = Rope(RopeConfig(dim=d, base=10000.0, neox=True))
    ours, ref = (KVCache(range(1), ctx, hkv, d, d, kv, torch.device("cpu")) for _ in range(2))
    old = torch.arange(150)
    for c in (ours, ref):
        g = torch.Generator().manual_seed(0)
        c.write(0, old, torch.randn(150, hkv, d, generator=g), torch.randn(150, hkv, d, generator=g), 150)
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    q, k, v = qkv[:, : h * d], qkv[:, h * d : (h + hkv) * d], qkv[:, (h + hkv) * d :]
    pos = torch.tensor([150, 151])
    lk = ours.layers[0]
    inv = rope.inv_effective(torch.device("cpu"))
    qo = rope_store(q, k, v, None, None, 1e-6, pos, inv, d, True, rope.mscale, lk.k, lk.v, h, torch.float32,
                    k_scale=lk.k_scale, v_scale=lk.v_scale)  # fmt: skip
    keys, values = ref.store(0, pos, rope.apply_at(k.reshape(t, hkv, d), pos), v.reshape(t, hkv, d), 152)
    return t, h, pos, qo, lk, ref.layers[0], keys, values


@pytest.mark.parametrize("d", [64, 48])  # 48: value heads not a power of two skip the 32-bit word tiles
def test_int8_cache_write_and_decode(d: int) -> None:
    """The decode path on an int8 KV cache: rope_store writes the codes and float16 scales KVCache.write makes of the
    same keys and values, and decode_attention over the codes (one launch, and split and merged) equals torch's
    attention over the dequantized cache."""
    from engine.kernels.attention import decode_attention
    from engine.layers.attention import attention, causal_mask

    t, _, pos, qo, lk, rk, keys, values = _write_through_rope_store("int8", d)
    assert torch.equal(lk.k_scale, rk.k_scale) and torch.equal(lk.v_scale, rk.v_scale)
    assert (lk.k.int() - rk.k.int()).abs().max().item() <= 1 and torch.equal(lk.v, rk.v)  # keys: RoPE's ulps
    want = attention(qo, keys, values, causal_mask(pos, 152, 0), d**-0.5).reshape(t, -1)
    for chunk in (512, 32):
        got = decode_attention(qo, lk.k, lk.v, pos, 152, 0, d**-0.5, chunk=chunk, k_scale=lk.k_scale,
                               v_scale=lk.v_scale)  # fmt: skip
        assert (got - want).abs().max().item() < 2e-2


def test_router() -> None:
    from engine.kernels.fused import route

    logits = torch.randn(5, 128) * 3
    counts = torch.zeros(128, dtype=torch.int64)
    w, ids = route(logits, 8, True, counts)
    rw, rid = torch.topk(torch.softmax(logits, -1), 8)
    assert torch.equal(ids, rid) and (w - rw / rw.sum(-1, keepdim=True)).abs().max().item() < 1e-6
    assert torch.equal(counts, torch.bincount(rid.flatten(), minlength=128))


@pytest.mark.parametrize("t,d,e,k", [(1, 2048, 128, 8), (3, 768, 60, 4)])
def test_norm_route_matches_the_norm_and_the_router(t: int, d: int, e: int, k: int) -> None:
    """The FFN norm + router GEMV + top-k launch against the torch ops: the same ids, weights, counts, normalised
    rows and 8-bit form; its done-counts are zero again afterwards (a replayed graph starts from zero)."""
    from engine.kernels.fused import norm_route
    from engine.kernels.gemv import quantize_q8_torch

    g = torch.Generator().manual_seed(5)
    h, nw = torch.randn(t, d, generator=g) * 3, torch.rand(d, generator=g) + 0.5
    router = torch.randn(e, d, generator=g) * 0.05
    counts, done = torch.zeros(e, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    y, y32, yq, w, ids = norm_route(h, nw, 1e-6, router, k, True, counts, done, torch.bfloat16, True, True)
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    rw, rid = torch.topk(torch.softmax(ref @ router.T, -1), k)
    assert y is not None and y32 is not None and yq is not None
    assert (y32 - ref).abs().max().item() < 1e-4 and (
        y.float() - y32
    ).abs().max().item() <= y32.abs().max().item() / 64
    assert torch.equal(
        yq.view(torch.uint8)[:, : d + d // 4], quantize_q8_torch(y32).view(torch.uint8)[:, : d + d // 4]
    )
    assert torch.equal(ids, rid) and (w - rw / rw.sum(-1, keepdim=True)).abs().max().item() < 1e-5
    assert torch.equal(counts, torch.bincount(rid.flatten(), minlength=e))
    assert not done.any()
    y, y32, yq, w2, ids2 = norm_route(h, nw, 1e-6, router, k, False, None, done, None, False, False)
    assert y is None and y32 is None and yq is None and torch.equal(ids2, rid)
    assert (w2 - rw).abs().max().item() < 1e-5


@pytest.mark.parametrize("variant", [10, 12])
def test_down_combine_writes_the_next_layers_norm(variant: int) -> None:
    """The experts' down projection with the combine also writes the next layer's attention norm, rounded to 8
    bits, from its last program: the same bytes as quantize_q8 of the torch norm of its output; counts zeroed."""
    from engine.kernels.gemv import moe_down_combine, q8_round, quantize_q8_torch

    qt, n, k = QT.Q4_K, 96, 512
    raws = [_blocks(qt, n, k, 60 + i) for i in range(3)]
    table = torch.tensor([w.data_ptr() for w in raws])
    ids, wt = torch.tensor([[2, 0], [1, 2]]), torch.rand(2, 2)
    xs, r = q8_round(torch.randn(4, k)), torch.randn(2, n)
    nw, q_out, done = torch.rand(n) + 0.5, torch.empty(2, n), torch.zeros(8, dtype=torch.int32)
    y = moe_down_combine(table, qt, raws[0].shape[1], ids, wt, xs, r, n, k, launch=(8, 2, 4), variant=variant,
                         next_norm=(nw, 1e-6, q_out, done))  # fmt: skip
    want = moe_down_combine(
        table, qt, raws[0].shape[1], ids, wt, xs, r, n, k, launch=(8, 2, 4), variant=variant
    )
    assert torch.equal(y, want) and not done.any()
    normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    got, ref = (
        q_out.view(torch.uint8)[:, : n + n // 4],
        quantize_q8_torch(normed).view(torch.uint8)[:, : n + n // 4],
    )
    codes = (got[:, :n].view(torch.int8).int() - ref[:, :n].view(torch.int8).int()).abs()
    assert codes.max().item() <= 1  # the kernel's sum of squares may round differently from torch's mean
    assert (codes > 0).float().mean().item() < 0.02


def _stage_setup(e_n: int, vram_experts: tuple[int, ...]):  # type: ignore[no-untyped-def]
    host = [[_blocks(QT.Q4_K, 16, 512, 10 * p + e) for e in range(e_n)] for p in range(3)]
    vram = {p: {e: host[p][e].clone() for e in vram_experts} for p in range(3)}
    tables = torch.tensor(
        [
            [vram[p][e].data_ptr() if e in vram[p] else host[p][e].data_ptr() for e in range(e_n)]
            for p in range(3)
        ]
    )
    host_tables = torch.tensor([[host[p][e].data_ptr() for e in range(e_n)] for p in range(3)])
    nbytes = torch.tensor([host[p][0].numel() for p in range(3)])
    return host, vram, tables, host_tables, nbytes


def _staged_copy(st, out: torch.Tensor, p: int, e: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The bytes the step's table points at for projection p of expert e (an address in the staging area)."""
    at = (out[p, e].item() - st.area.data_ptr()) // st.stride
    assert 0 <= at < 3 * st.slots
    return st.area.view(-1, st.stride)[at]


def test_missed_experts_are_staged_and_hits_keep_their_slot() -> None:
    from engine.kernels.stage_copy import Stager

    e_n, k = 6, 3
    host, vram, tables, host_tables, nbytes = _stage_setup(e_n, (1, 4))
    st = Stager(torch.device("cpu"), k, int(nbytes.max()), e_n)
    ids = torch.tensor([[4, 0, 5]])
    out = st.stage(ids, tables, host_tables, nbytes)
    for p in range(3):
        for e in range(e_n):
            if e in vram[p] or e not in ids[0].tolist():
                assert out[p, e].item() == tables[p, e].item()  # the layer's own entry
            else:
                assert torch.equal(_staged_copy(st, out, p, e)[: host[p][e].numel()], host[p][e].reshape(-1))
    # an expert the CPU claims (--cpu-experts) is not copied: its entry points into the area, whose bytes stay
    before = st.area.clone()
    out = st.stage(
        torch.tensor([[2, 3, 1]]), tables, host_tables, nbytes, torch.tensor([1, 0, 0], dtype=torch.int32)
    )
    for p in range(3):
        assert st.area.data_ptr() <= out[p, 2].item() < st.area.data_ptr() + st.area.numel()
        assert torch.equal(_staged_copy(st, out, p, 3)[: host[p][3].numel()], host[p][3].reshape(-1))
        assert out[p, 1].item() == vram[p][1].data_ptr()
        assert out[p, 0].item() == host[p][0].data_ptr()  # not chosen this step: the layer's own entry
    assert torch.equal(st.area[:, 1:], before[:, 1:])  # only slot 0 was written (expert 3)


def test_a_step_of_several_rows_stages_each_missed_expert_once() -> None:
    """Rows that chose the same missed expert share one staging slot; a step that misses more distinct experts
    than the area holds reads the rest in place (their host addresses stay in the table)."""
    from engine.kernels.stage_copy import Stager

    e_n = 8
    host, vram, tables, host_tables, nbytes = _stage_setup(e_n, (1,))
    st = Stager(torch.device("cpu"), 4, int(nbytes.max()), e_n)
    ids = torch.tensor([[0, 1, 2], [2, 0, 3], [5, 2, 1]])  # misses 0, 2, 3, 5: four distinct, 2 chosen thrice
    out = st.stage(ids, tables, host_tables, nbytes)
    slots = set()
    for p in range(3):
        for e in (0, 2, 3, 5):
            assert torch.equal(_staged_copy(st, out, p, e)[: host[p][e].numel()], host[p][e].reshape(-1))
            slots.add(out[p, e].item())
        assert out[p, 1].item() == vram[p][1].data_ptr()
    assert len(slots) == 12  # four experts, three projections, each in a slot of its own
    ids = torch.tensor([[0, 2, 3], [4, 5, 6], [7, 0, 2]])  # seven distinct misses, four slots
    out = st.stage(ids, tables, host_tables, nbytes)
    staged = [e for e in (0, 2, 3, 4, 5, 6, 7) if out[0, e].item() != host_tables[0, e].item()]
    assert staged == [0, 2, 3, 4]  # in the order the step first chose them
    for p in range(3):
        for e in (5, 6, 7):
            assert out[p, e].item() == host[p][e].data_ptr()  # read in place
        for e in staged:
            assert torch.equal(_staged_copy(st, out, p, e)[: host[p][e].numel()], host[p][e].reshape(-1))


@pytest.mark.parametrize(
    "qtype,k",
    [
        ("Q4_K", 512),
        ("Q5_K", 512),
        ("Q6_K", 512),
        ("Q8_0", 352),
        ("Q4_0", 96),
        ("IQ4_XS", 512),
        ("MXFP4", 352),
    ],
)
def test_dequantize_rows(qtype: str, k: int) -> None:
    from engine.kernels.dequant import dequantize_rows

    qt = QT[qtype]
    raw = _blocks(qt, 19, k, 7).reshape(19, -1)
    got = dequantize_rows(raw, qt, k, torch.float32)
    assert (got - dequantize(raw, qt)).abs().max().item() <= 1e-6 * dequantize(raw, qt).abs().max().item()


def test_decode_attention_default_split() -> None:
    """The default split of a long span (many programs, then the merge) against the plain attention."""
    from engine.kernels.attention import _split_chunk, decode_attention
    from engine.layers.attention import attention, causal_mask

    cpu = torch.device("cpu")  # counted as 64 multiprocessors
    assert _split_chunk(1, 4, 256, 64, cpu) == 256  # short spans: one launch
    assert _split_chunk(1, 4, 4096, 64, cpu) == 128  # 32 programs a key head, 128 positions each
    assert _split_chunk(3, 4, 8192, 64, cpu) == 832  # 10 wanted: 13 whole blocks each, 10 programs
    # a 32K bucket (258 blocks of 128) over the 32 programs wanted: 9 whole blocks each, 29 programs, the last
    # one's short, and none ends on a nearly empty block
    assert _split_chunk(1, 4, 33024, 128, cpu) == 9 * 128
    t, h, hkv, d, span = 1, 8, 2, 64, 900  # 5 splits of 3 blocks: a merge over a count no power of two
    kc, vc = torch.randn(span, hkv, d), torch.randn(span, hkv, d)
    pos = torch.tensor([span - 1])
    q = torch.randn(t, h, d)
    got = decode_attention(q, kc, vc, pos, span, 0, d**-0.5)
    ref = attention(q, kc, vc, causal_mask(pos, span, 0), d**-0.5).reshape(t, -1)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "kv,t,window,softcap",
    [("f32", 1, 0, 0.0), ("f32", 2, 100, 30.0), ("int8", 1, 0, 0.0), ("int8", 2, 150, 0.0), ("q4_0", 1, 0, 0.0),
     ("q4_0", 1, 37, 0.0)],
)  # fmt: skip
def test_split_decode_matches_torch_where_splits_end_mid_block(
    kv: str, t: int, window: int, softcap: float
) -> None:
    """The split decode (whole blocks without masks, then the partial last one; exp2 with log2(e) in the score
    scale, an int8 key's scale folded into it, q4_0 codes made floats by their bit patterns, the merge in base 2)
    against torch's attention over the dequantized cache, where splits end mid-block, with a window and with a
    soft cap."""
    from engine.kernels.attention import decode_attention
    from engine.layers.attention import attention, causal_mask
    from engine.layers.kv_cache import dequantize_kv, quantize_kv

    h, hkv, d, span = 8, 2, 64, 700
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(span, hkv, d, generator=g), torch.randn(span, hkv, d, generator=g)
    q = torch.randn(t, h, d, generator=g)
    pos = torch.arange(span - t, span)
    (kc, ks), (vc, vs) = quantize_kv(kv, k), quantize_kv(kv, v)
    k, v = dequantize_kv(kv, kc, ks, torch.float32), dequantize_kv(kv, vc, vs, torch.float32)
    want = attention(q, k, v, causal_mask(pos, span, window), d**-0.5, softcap).reshape(t, -1)
    # 8 splits of 88 positions (a whole block of 64 and a partial one each), and one program a key head
    for chunk in (88, span):
        got = decode_attention(
            q, kc, vc, pos, span, window, d**-0.5, softcap, chunk=chunk, k_scale=ks, v_scale=vs
        )
        assert (got - want).abs().max().item() < 1e-4, chunk


@pytest.mark.parametrize("t,chunk", [(1, 88), (2, 700)])
def test_int8_keys_against_q_in_two_int8_halves(t: int, chunk: int) -> None:
    """DecodeTune(qk8=True): an int8 cache's scores as int8 products of the codes and q's two int8 halves equal
    torch's attention over the dequantized cache as closely as the float16 products do (bfloat16 queries, some of
    them large: the halves' scale is a row's own)."""
    from engine.kernels.attention import DecodeTune, decode_attention
    from engine.layers.attention import attention, causal_mask
    from engine.layers.kv_cache import dequantize_kv, quantize_kv

    h, hkv, d, span = 8, 2, 64, 700
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(span, hkv, d, generator=g), torch.randn(span, hkv, d, generator=g)
    q = torch.randn(t, h, d, generator=g)
    q[:, 0, :4] *= 40.0  # one head with outliers, another tiny: a scale per row serves both
    q[:, 1] *= 1e-3
    q = q.to(torch.bfloat16)
    pos = torch.arange(span - t, span)
    (kc, ks), (vc, vs) = quantize_kv("int8", k), quantize_kv("int8", v)
    kd, vd = dequantize_kv("int8", kc, ks, torch.float32), dequantize_kv("int8", vc, vs, torch.float32)
    want = attention(q.float(), kd, vd, causal_mask(pos, span, 0), d**-0.5).reshape(t, -1)
    errs = []
    for tune in (DecodeTune(), DecodeTune(qk8=True)):
        got = decode_attention(
            q, kc, vc, pos, span, 0, d**-0.5, chunk=chunk, k_scale=ks, v_scale=vs, tune=tune
        )
        errs.append((got.float() - want).abs().max().item())
    assert errs[1] < 2e-2 and errs[1] <= 1.5 * errs[0] + 1e-3, errs


@pytest.mark.parametrize("t,topk,e", [(9, 2, 4), (300, 8, 128), (64, 10, 512), (1, 8, 128), (700, 8, 128)])
def test_block_table_matches_the_torch_schedule(t: int, topk: int, e: int) -> None:
    """The block table and the expert order (a stable sort by expert, as torch.argsort) from their launches
    against the torch ops."""
    from engine.kernels import moe_gemm
    from engine.kernels.moe_blocks import Blocks

    gen = torch.Generator().manual_seed(t * e)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])
    ids[: t // 2, 0] = 0  # one expert with more rows than a block (and, at 700 rows, than a 1,024 tile)
    ref, got = Blocks(ids, e), Blocks(ids, e, moe_gemm.block_table, moe_gemm.expert_order)
    assert torch.equal(got.order, ref.order) and got.max_blocks == ref.max_blocks
    n = int(ref.nblocks)
    assert int(got.nblocks) == n
    for name in ("expert", "start", "end"):
        assert torch.equal(getattr(got, name)[:n], getattr(ref, name)[:n]), name


@pytest.mark.parametrize("d", [2048, 768])
def test_q8_activations_from_the_kernels_match_torch(d: int) -> None:
    """quantize_q8's one-launch kernel and the RMS norm that writes the 8-bit form too, against the torch ops."""
    from engine.kernels.fused import rms_norm_q8
    from engine.kernels.gemv import quantize_q8, quantize_q8_torch

    x = torch.randn(3, d) * 2
    x[1, :32] = 0.0  # a block of zeros: scale 0

    def raw(t: torch.Tensor) -> torch.Tensor:  # the packed bytes a kernel reads (as floats some would be NaN)
        return t.view(torch.uint8)[:, : d + d // 4]

    assert torch.equal(raw(quantize_q8(x)), raw(quantize_q8_torch(x)))
    w = torch.rand(d) + 0.5
    y, y32, yq = rms_norm_q8(x, w, 1e-6, torch.float32, f32_copy=True)
    assert y32 is not None and torch.equal(y, y32)
    assert torch.equal(raw(yq), raw(quantize_q8_torch(y32)))


def test_delta_net_step_matches_the_torch_ops() -> None:
    """One decode step of a gated delta-net layer in two launches (engine/kernels/delta_net.py) against the torch
    ops qwen3next runs: the causal convolution and its state, the delta rule's state and read-out, the gated norm."""
    import torch.nn.functional as F

    from engine.kernels.delta_net import conv_step, delta_step
    from engine.layers.norm import rms_norm
    from engine.models.gated_delta import causal_conv, delta_rule_steps

    g = torch.Generator().manual_seed(3)
    nk, nv, dk, dv, kw = 2, 4, 32, 32, 4
    c = 2 * nk * dk + nv * dv
    x = torch.randn(1, c, generator=g)
    conv_state = torch.randn(kw - 1, c, generator=g)
    w = torch.randn(c, kw, generator=g) * 0.5
    ssm = torch.randn(nv, dk, dv, generator=g) * 0.1
    z, b, a = torch.randn(nv * dv, generator=g), torch.randn(nv, generator=g), torch.randn(nv, generator=g)
    a_log, dt_bias = -torch.rand(nv, generator=g) - 0.1, torch.randn(nv, generator=g)
    nw, eps = torch.rand(dv, generator=g) + 0.5, 1e-6

    # the torch ops, as engine/models/qwen3next.py runs them
    y_ref, window = causal_conv(x, conv_state.clone(), w)
    q = y_ref[:, : nk * dk].view(1, nk, dk)
    k = y_ref[:, nk * dk : 2 * nk * dk].view(1, nk, dk)
    v = y_ref[:, 2 * nk * dk :].view(1, nv, dv)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
    gdec = a_log * F.softplus(a + dt_bias)
    o_ref, s_ref, _ = delta_rule_steps(q, k, v, gdec[None], torch.sigmoid(b)[None], ssm.clone())
    o_ref = rms_norm(o_ref, nw, eps) * F.silu(z.view(1, nv, dv))

    st = conv_state.clone()
    y = conv_step(x[0], st, w)
    assert (y - y_ref[0]).abs().max().item() < 1e-5
    assert torch.equal(st, window[-(kw - 1) :])
    s = ssm.clone()
    o = delta_step(y, z, b, a, a_log, dt_bias, nw, s, nk, eps)
    assert (s - s_ref).abs().max().item() < 1e-5
    assert (o - o_ref.reshape(-1)).abs().max().item() < 1e-4


def _moe_layer(e_n: int, f: int, d: int) -> "object":
    from engine.layers.moe import ExpertWeights
    from engine.layers.qtensor import QTensor

    def stack(n: int, k: int, seed: int) -> QTensor:
        raw = torch.stack([_blocks(QT.Q4_K, n, k, seed + e) for e in range(e_n)])
        return QTensor(raw, QT.Q4_K, (e_n, n, k))

    router = QTensor(torch.randn(e_n, d).view(torch.uint8).view(e_n, 4 * d), QT.F32, (e_n, d))
    return ExpertWeights(router=router, gate=stack(f, d, 100), up=stack(f, d, 200), down=stack(d, f, 300))


def _expert_ref(ew: "object", e: int, x: torch.Tensor) -> torch.Tensor:
    """float64 down(silu(gate x) * up x) from gguf's dequantizer."""
    g, u, dn = (dequantize(q.raw[e], QT.Q4_K).double() for q in (ew.gate, ew.up, ew.down))  # type: ignore[attr-defined]
    x64 = x.double().view(-1)
    return dn @ (torch.nn.functional.silu(g @ x64) * (u @ x64))


@pytest.mark.parametrize("step_server", [True, False])
def test_cpu_share_of_misses_goes_through_the_mailbox(
    monkeypatch: pytest.MonkeyPatch, step_server: bool
) -> None:
    """--cpu-experts: the post launch gives the CPU round(ratio * misses) of the missed slots it holds, writes them
    to the mailbox and raises its number; the host answers with their weighted sum (through the step server, or
    request by request from Python with STRATA_CPU_STEP_SERVE=0); collect adds it."""
    monkeypatch.setenv("STRATA_CPU_STEP_SERVE", "1" if step_server else "0")
    from engine.experts.cache import ExpertCache
    from engine.experts.cpu_misses import CpuMisses
    from engine.kernels import cpu_handoff as ho

    e_n, f, d, k = 8, 256, 256, 4
    ew = _moe_layer(e_n, f, d)
    cache = ExpertCache({0: ew}, torch.device("cpu"), {0: 2})  # type: ignore[dict-item]
    assert cache.layers[0].slot_of[:3] == [0, 1, -1]  # experts 0 and 1 "in VRAM"
    cm = CpuMisses(cache, 1.0, k, "silu", ratio=0.5)
    ids = torch.tensor([[0, 3, 5, 6]])  # one hit, three misses: the CPU takes round(1.5) = 2 of them
    w = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    x = torch.randn(1, d)
    posted = cm.post(0, ids, w, x)
    assert posted is not None
    claim, wg = posted
    assert claim.tolist() == [0, 1, 1, 0]
    assert wg.view(-1).tolist() == pytest.approx([0.4, 0.0, 0.0, 0.1])
    out = torch.ones(1, d)
    cm.collect(0, out)
    ref = 0.3 * _expert_ref(ew, 3, x) + 0.2 * _expert_ref(ew, 5, x)
    assert _cos(out - 1, ref) >= 0.999  # the CPU rounds its inputs (8 bits a 256 in place, or bf16 on a copy)
    row = cm.box[0]
    assert row[ho.HDR_MISS].item() == 3 and row[ho.HDR_TAKE].item() == 2 and row[ho.HDR_REQ].item() == 1
    assert cm.slots == 2
    cache.cpu_misses = cm
    assert cache.stats().cpu_computed == 2  # what /stats and /metrics report as computed_on_cpu
    # no share: nothing is claimed and the output is left as it is (no wait)
    cm.set_ratio(0.0)
    claim, _ = cm.post(0, ids, w, x)  # type: ignore[misc]
    assert claim.tolist() == [0, 0, 0, 0]
    out = torch.ones(1, d)
    cm.collect(0, out)
    assert torch.equal(out, torch.ones(1, d))
    assert row[ho.HDR_REQ].item() == 2  # every post raises the number: the thread counts them
    assert cm.post(1, ids, w, x) is None  # a layer the CPU holds nothing of
    assert cm.post(0, ids.repeat(17, 1), w.repeat(17, 1), x.repeat(17, 1)) is None  # over 16 rows: the GPU's
    # a failing CPU kernel is answered with zeros (the device is never left waiting), and the caller hears
    cm.set_ratio(1.0)
    assert (cm._fast is not None) == step_server  # every held layer is read in place
    failing = cm._fast if cm._fast is not None else cm.layers[0]
    working = failing.serve if cm._fast is not None else failing.serve_box

    def broken(*args: object) -> None:
        raise MemoryError("no room")

    if cm._fast is not None:
        cm._fast.serve = broken  # type: ignore[method-assign]
    else:
        failing.serve_box = broken  # type: ignore[method-assign]
    cm.post(0, ids, w, x)
    out = torch.zeros(1, d)
    with pytest.raises(RuntimeError, match=r"computing experts on the CPU failed.*no room"):
        cm.collect(0, out)
    assert torch.equal(out, torch.zeros(1, d))
    assert cm.box[0, cm.answer].item() == cm.box[0, ho.HDR_REQ].item()  # answered all the same
    # a request the host never answered: the device gives up (marked -1 in the mailbox, shortened here), the
    # caller hears, and the next step is answered normally
    if cm._fast is not None:
        cm._fast.serve = working  # type: ignore[method-assign]
    else:
        failing.serve_box = working  # type: ignore[method-assign]
    monkeypatch.setattr(ho, "WAIT_LIMIT", 5)
    cm.post(0, ids, w, x)
    # the device's side only
    ho.collect(torch.zeros(1, d), cm.claim[0, :k], cm.cnt[0:1], cm.box[0], cm.layout)
    assert cm.box[0, ho.HDR_WAIT].item() == -1
    with pytest.raises(RuntimeError, match="GPU waited too long"):
        cm.check()
    cm.post(0, ids, w, x)
    out = torch.zeros(1, d)
    cm.collect(0, out)
    ref = 0.3 * _expert_ref(ew, 3, x) + 0.2 * _expert_ref(ew, 5, x) + 0.1 * _expert_ref(ew, 6, x)
    assert _cos(out, ref) >= 0.999  # ratio 1: the CPU took every miss
    assert cm.box[0, cm.answer].item() == cm.box[0, ho.HDR_REQ].item()


def test_prefetched_experts_are_read_from_their_area_and_not_copied_or_claimed_again() -> None:
    """--expert-prefetch: the experts predicted for layer 1 are staged into the prefetch's area while layer 0 runs;
    layer 1's staging then copies only what the prediction missed, its prefetched experts read from the
    prefetch's area, and the CPU's share of the misses (--cpu-experts) counts them as hits. A wrong prediction
    costs a copy and nothing else."""
    from engine.experts.cache import ExpertCache
    from engine.experts.cpu_misses import CpuMisses
    from engine.experts.prefetch import Prefetch

    e_n, f, d, k = 8, 256, 256, 4
    layers = {0: _moe_layer(e_n, f, d), 1: _moe_layer(e_n, f, d)}
    cache = ExpertCache(layers, torch.device("cpu"), {0: 2, 1: 2})  # type: ignore[arg-type]
    le = cache.layers[1]
    assert le.slot_of[:3] == [0, 1, -1] and le.tables is not None and le.host_tables is not None

    def predict(li: int, x32: torch.Tensor) -> torch.Tensor:
        assert li == 0 and x32.shape == (1, d)
        return torch.tensor([[3, 5, 1, 7]])  # 3, 5, 7 left in host RAM, 1 in VRAM

    pf = Prefetch(cache, predict, {0: 1}, k, "test")
    pf.issue(0, torch.randn(1, d))
    pf.issue(1, torch.randn(1, d))  # the last MoE layer has no next one to predict
    assert set(pf.pending) == {1}
    tin = pf.tables(1)
    assert tin is not None and pf.tables(1) is None  # taken once
    area = pf.stagers[pf.parity[1]].area

    def in_area(a: int, t: torch.Tensor) -> bool:
        return t.data_ptr() <= a < t.data_ptr() + t.numel()

    def bytes_at(a: int, t: torch.Tensor, n: int) -> torch.Tensor:
        off = a - t.data_ptr()
        return t.view(-1)[off : off + n]

    projs = (le.gate, le.up, le.down)
    for p, pr in enumerate(projs):
        n = pr.host.raw[0].numel()
        for e in (3, 5, 7):
            assert in_area(int(tin[p, e]), area)
            assert torch.equal(bytes_at(int(tin[p, e]), area, n), pr.host.raw[e].reshape(-1))
        assert int(tin[p, 1]) == int(le.tables[p, 1]) and int(tin[p, 2]) == int(le.host_tables[p, 2])
    # the step chooses 3 and 7 (predicted), 2 (not predicted, in host RAM) and 0 (in VRAM)
    ids = torch.tensor([[3, 2, 0, 7]])
    staged = cache.staged_tables(1, ids, tables=tin)
    assert staged is not None
    out, _ = staged
    main = cache.stager
    assert main is not None
    for p, pr in enumerate(projs):
        n = pr.host.raw[0].numel()
        for e in (3, 7):
            assert int(out[p, e]) == int(tin[p, e])  # read from the prefetch's area, not copied again
        assert in_area(int(out[p, 2]), main.area)
        assert torch.equal(bytes_at(int(out[p, 2]), main.area, n), pr.host.raw[2].reshape(-1))
        assert int(out[p, 0]) == int(le.tables[p, 0])
    assert int(main.area[:, 1:].abs().sum()) == 0  # one miss copied by the step (expert 2, the first slot)
    # the CPU's share: the prefetched experts are hits, so of this step's one miss (2) it takes round(0.5) = 0 or 1
    cm = CpuMisses(cache, 1.0, k, "silu", ratio=1.0)
    w = torch.full((1, k), 0.25)
    claim, _ = cm.post(1, ids, w, torch.randn(1, d), tin)  # type: ignore[misc]
    assert claim.tolist() == [0, 1, 0, 0]  # only expert 2
    cm.collect(1, torch.zeros(1, d))
    claim, _ = cm.post(1, ids, w, torch.randn(1, d))  # type: ignore[misc]
    assert claim.tolist() == [1, 1, 0, 1]  # without the prefetch: every miss
    cm.collect(1, torch.zeros(1, d))


def test_cpu_share_of_a_batched_step_takes_whole_experts() -> None:
    """A decode step of several rows: the quota counts the step's distinct missed experts, and the CPU takes an
    expert for every row that chose it (its blocks read once); each row gets its own sum back."""
    from engine.experts.cache import ExpertCache
    from engine.experts.cpu_misses import CpuMisses
    from engine.kernels import cpu_handoff as ho

    e_n, f, d, k = 8, 256, 256, 4
    ew = _moe_layer(e_n, f, d)
    cache = ExpertCache({0: ew}, torch.device("cpu"), {0: 2})  # type: ignore[dict-item]
    cm = CpuMisses(cache, 1.0, k, "silu", ratio=0.5)
    # six distinct misses (3, 5, 6, 7, 2, 4; 3 and 5 chosen by two rows each): the CPU takes round(0.5 * 6) = 3,
    # the first three in pair order, for every row that chose them
    ids = torch.tensor([[0, 3, 5, 6], [5, 1, 3, 7], [1, 0, 2, 4]])
    w = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    x = torch.randn(3, d)
    claim, wg = cm.post(0, ids, w, x)  # type: ignore[misc]
    assert claim.view(3, k).tolist() == [[0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]
    assert cm.box[0, ho.HDR_MISS].item() == 6 and cm.box[0, ho.HDR_ROWS].item() == 3
    assert wg.tolist() == [pytest.approx(r) for r in ([0.4, 0, 0, 0], [0, 0.2, 0, 0.1], [0.25] * 4)]
    out = torch.zeros(3, d)
    cm.collect(0, out)
    refs = [
        0.3 * _expert_ref(ew, 3, x[0]) + 0.2 * _expert_ref(ew, 5, x[0]) + 0.1 * _expert_ref(ew, 6, x[0]),
        0.5 * _expert_ref(ew, 5, x[1]) + 0.2 * _expert_ref(ew, 3, x[1]),
    ]
    for t in range(2):
        assert _cos(out[t], refs[t]) >= 0.999
    assert torch.equal(out[2], torch.zeros(d))  # nothing of row 3 was taken
    assert cm.slots == 5  # pairs


def test_a_tuned_share_reaches_the_device() -> None:
    """Without --cpu-ratio the share is tuned (engine/experts/share_tuner.py, tested on its own): the host times
    the steps between its first layer's requests, hands them to the tuner, and the share it returns is the quota
    the device reads from the next post on; set_ratio fixes the share and stops the tuning."""
    from engine.experts.cache import ExpertCache
    from engine.experts.cpu_misses import DEFAULT_RATIO, CpuMisses

    e_n, f, d, k = 8, 256, 256, 4
    cache = ExpertCache({0: _moe_layer(e_n, f, d)}, torch.device("cpu"), {0: 2})  # type: ignore[dict-item]
    from engine.experts import cpu_misses
    from engine.experts.share_tuner import nested_turn

    alive = len(cpu_misses._TUNERS)
    cm = CpuMisses(cache, 1.0, k, "silu")
    assert cm.tuner is not None and cm.ratio == DEFAULT_RATIO
    other = CpuMisses(cache, 1.0, k, "silu")  # a second card's in the same process: its turns nest over cm's
    assert (cm.tuner.turn, other.tuner.turn) == (nested_turn(alive), nested_turn(alive + 1))  # type: ignore[union-attr]
    seen: list[float] = []

    class AllToTheCpu:
        ratio, best_median, decisions = DEFAULT_RATIO, 0.01, []

        def observe(self, seconds: float) -> float:
            seen.append(seconds)
            self.ratio = 1.0
            return 1.0

    cm.tuner = AllToTheCpu()  # type: ignore[assignment]
    ids, w, x = torch.tensor([[0, 3, 5, 6]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]]), torch.randn(1, d)
    for _ in range(2):
        cm.post(0, ids, w, x)
        cm.collect(0, torch.zeros(1, d))
    assert len(seen) == 1 and seen[0] > 0  # the first step has no step before it to time
    assert cm.ratio == 1.0 and cm.quota.tolist()[:5] == [0, 1, 2, 3, 4]
    claim, _ = cm.post(0, ids, w, x)  # type: ignore[misc]
    assert claim.tolist() == [0, 1, 1, 1]  # the three misses all go to the CPU now
    cm.collect(0, torch.zeros(1, d))
    assert cm.timing()["tuned"] and cm.timing()["ratio"] == 1.0
    cache.cpu_misses = cm
    assert cache.stats().cpu_share == 1.0  # what /stats and /metrics report as cpu_share
    cm.set_ratio(0.5)
    assert cm.tuner is None and not cm.timing()["tuned"]


@pytest.mark.parametrize("qtype,k", [("Q4_K", 512), ("Q6_K", 512), ("Q8_0", 352), ("IQ4_XS", 512)])
@pytest.mark.parametrize("rows", [2, 5])
def test_rows_gemm_matches_the_dequantized_weight(qtype: str, k: int, rows: int) -> None:
    """A few rows at once, each weight tile decoded once: float rows (with a residual) and 8-bit rows."""
    from engine.kernels.gemv import q8_round, quantize_q8
    from engine.kernels.rows_gemm import rows_gemm

    qt, n = QT[qtype], 24
    raw = _blocks(qt, n, k, 7)
    w = dequantize(raw, qt)
    x, r = torch.randn(rows, k), torch.randn(rows, n)
    y = rows_gemm(raw, qt, n, k, x, residual=r, block_n=16)
    assert y.shape == (rows, n) and _cos(y, r + x @ w.T) >= 0.99999
    y8 = rows_gemm(raw, qt, n, k, quantize_q8(x), q8=True, block_n=16)
    assert _cos(y8, q8_round(x) @ w.T) >= 0.9999
    with pytest.raises(ValueError, match="2-16 rows"):
        rows_gemm(raw, qt, n, k, x[:1])


@pytest.mark.parametrize("qtype,variant", [("Q4_K", 12), ("Q6_K", 13)])
@pytest.mark.parametrize("t,g", [(2, 2), (5, 4), (9, 2)])
def test_batched_rows_give_each_rows_own_sums(
    monkeypatch: pytest.MonkeyPatch, qtype: str, variant: int, t: int, g: int
) -> None:
    """A step of t token rows through the batched launches (dense rows together, each expert's pairs together,
    then the combine with the next layer's norm) gives what each row's own launches give, and the reference."""
    from engine.kernels import gemv as gm

    qt, n, k, topk, e = QT[qtype], 40, 512, 3, 4
    monkeypatch.setattr(gm, "_ROWS_DEFAULT", {kind: (4, 2, 4, g) for kind in ("dense", "moe", "moe_down")})
    monkeypatch.setattr(gm, "_config", lambda *a, **kw: (4, 2, 4, variant))
    raws = [_blocks(qt, n, k, 80 + i) for i in range(e)]
    downs = [_blocks(qt, n, k, 90 + i) for i in range(e)]
    deq, ddeq = [dequantize(r, qt) for r in raws], [dequantize(r, qt) for r in downs]
    table, dtable = torch.tensor([w.data_ptr() for w in raws]), torch.tensor([w.data_ptr() for w in downs])
    gen = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])  # experts shared by rows
    x, r = gm.q8_round(torch.randn(t, k, generator=gen)), torch.randn(t, n, generator=gen)
    xq = gm.quantize_q8_torch(x)
    wt = torch.rand(t, topk, generator=gen)
    hs = gm.q8_round(torch.randn(t * topk, k, generator=gen))
    nw, done = torch.rand(n) + 0.5, torch.zeros(16, dtype=torch.int32)

    def step() -> tuple[torch.Tensor, ...]:
        q_out = torch.zeros(t, n)
        dense = gm.gemv(raws[0], qt, n, k, xq, residual=r, q8=True)
        hid = gm.moe_gemv(
            table, qt, raws[0].shape[1], ids, xq, n, k, topk, up_table=dtable, act="silu", q8=True
        )
        hq, norm = gm.quantize_q8_torch(hs), (nw, 1e-6, q_out, done)
        down = gm.moe_down_combine(
            dtable, qt, downs[0].shape[1], ids, wt, hq, r, n, k, q8=True, next_norm=norm
        )
        return dense, hid, down, q_out

    assert gm.rows_config(qt, n, k, "moe", t) is not None
    batched = step()
    monkeypatch.setattr(gm, "mma_config", lambda *a: (16, 2, 4))  # the tuning file's pick of tensor cores
    on_mma = gm.gemv(raws[0], qt, n, k, xq, residual=r, q8=True)
    assert torch.allclose(on_mma, batched[0], rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("STRATA_BATCHED_GEMV", "0")
    assert gm.rows_config(qt, n, k, "moe", t) is None
    alone = step()
    for a, b in zip(batched[:3], alone[:3], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)
    assert not done.any()
    codes = (batched[3].view(torch.uint8)[:, :n].view(torch.int8).int()
             - alone[3].view(torch.uint8)[:, :n].view(torch.int8).int()).abs()  # fmt: skip
    assert codes.max().item() <= 1
    assert _cos(batched[0], r + x @ deq[0].T) >= 0.99999
    want = torch.stack([torch.nn.functional.silu(x[i] @ deq[j].T) * (x[i] @ ddeq[j].T) for i in range(t)
                        for j in ids[i].tolist()])  # fmt: skip
    assert _cos(batched[1], want) >= 0.99999
    down = torch.stack([r[i] + sum(wt[i, j] * (hs[topk * i + j] @ ddeq[int(ids[i, j])].T) for j in range(topk))
                        for i in range(t)])  # fmt: skip
    assert _cos(batched[2], down) >= 0.99999


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows,split", [(2, 1), (7, 2), (16, 3)])
def test_rows_mma_matches_the_8_bit_bodies(qtype: str, rows: int, split: int) -> None:
    """Rows on int8 tensor cores: the 8-bit GEMV bodies' products (the same integer sums) and the reference."""
    from engine.kernels.gemv import q8_round, quantize_q8_torch
    from engine.kernels.rows_mma import rows_mma

    qt, n, k = QT[qtype], 40, 768
    raw = _blocks(qt, n, k, 21)
    w = dequantize(raw, qt)
    x, r = torch.randn(rows, k), torch.randn(rows, n)
    y = rows_mma(raw, qt, n, k, quantize_q8_torch(x), residual=r, block_n=16, split=split)
    want = r + q8_round(x) @ w.T
    assert y.shape == (rows, n) and _cos(y, want) >= 0.99999
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


def test_the_token_mask_kernel_matches_the_torch_unpacking() -> None:
    """engine/kernels/token_mask.py against Constraint.mask's torch path: the same -inf rows, a padded head's
    rows past the grammar's vocabulary included."""
    from engine.kernels.token_mask import apply_token_mask_

    g = torch.Generator().manual_seed(2)
    n_vocab, v = 1000, 1056
    words = torch.randint(-(2**31), 2**31 - 1, ((n_vocab + 31) // 32,), dtype=torch.int32, generator=g)
    logits = torch.randn(v, generator=g)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(-1).bool()[:n_vocab]
    keep = torch.zeros(v, dtype=torch.bool)
    keep[:n_vocab] = allowed
    want = logits.masked_fill(~keep, float("-inf"))
    got = apply_token_mask_(logits.clone(), words, n_vocab)
    assert torch.equal(got, want)


@pytest.mark.parametrize("d", [64, 128])
def test_q4_cache_write_decode_and_prompt(d: int) -> None:
    """The q4_0 KV cache through the kernels: rope_store writes the codes and float16 scales KVCache.write makes of
    the same keys and values (a code in a thousand may round the other way: the kernel's product and sum are one
    fused operation), and decode_attention (one launch, split and merged) and prefill_attention over the packed
    bytes equal torch's attention over the dequantized cache."""
    from engine.kernels.attention import decode_attention
    from engine.kernels.prefill_attention import prefill_attention
    from engine.layers.attention import attention, causal_mask
    from engine.layers.kv_cache import dequant4

    t, h, pos, qo, lk, rk, _, _ = _write_through_rope_store("q4_0", d)
    for got_c, want_c, got_s, want_s in (
        (lk.k, rk.k, lk.k_scale, rk.k_scale),
        (lk.v, rk.v, lk.v_scale, rk.v_scale),
    ):
        assert torch.allclose(got_s.float(), want_s.float(), rtol=1e-3)  # keys: RoPE's ulps
        a = dequant4(got_c, got_s, torch.float32)
        b = dequant4(want_c, want_s, torch.float32)
        step = want_s.float().abs().repeat_interleave(32, -1)
        assert ((a - b).abs() <= step * 1.01 + 1e-6).all()
        assert ((a - b).abs() > 1e-6).float().mean().item() < 2e-3
    keys = dequant4(lk.k[:152], lk.k_scale[:152], torch.float32)
    values = dequant4(lk.v[:152], lk.v_scale[:152], torch.float32)
    want = attention(qo, keys, values, causal_mask(pos, 152, 0), d**-0.5).reshape(t, -1)
    for chunk in (512, 32):
        got = decode_attention(qo, lk.k, lk.v, pos, 152, 0, d**-0.5, chunk=chunk, k_scale=lk.k_scale,
                               v_scale=lk.v_scale)  # fmt: skip
        assert (got - want).abs().max().item() < 1e-4
    # a prompt chunk of 40 rows at positions 100..139 over the same cache
    pq = torch.randn(40, h, d)
    ppos = torch.arange(100, 140)
    got = prefill_attention(pq, lk.k, lk.v, ppos, 140, 0, d**-0.5, 0.0, lk.k_scale, lk.v_scale)
    want = attention(pq, keys[:140], values[:140], causal_mask(ppos, 140, 0), d**-0.5)
    assert (got - want).abs().max().item() < 1e-5
