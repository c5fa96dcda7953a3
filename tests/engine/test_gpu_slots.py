"""Decode rows of several slots in one pass of the fused decode path, their caches rows of one shared cache
(KVCache.split): the attention kernels with a cache base per row against separate caches, the model's rows
against each sequence alone (eager and as CUDA graphs, with the CPU's share of misses too), and the BatchRunner
end to end against the Runner."""

from pathlib import Path

import pytest
import torch

from engine.experts.policy import ExpertPolicy
from engine.models.family_base import BatchPart
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("span", [200, 300])  # one launch; split over the span with a merge
def test_attention_with_row_bases_matches_separate_caches(span: int) -> None:
    from engine.kernels.attention import decode_attention

    s, ctx, hkv, dk, h = 3, 320, 2, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(s * ctx, hkv, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(s * ctx, hkv, dk, device="cuda", generator=g).bfloat16()
    q = torch.randn(s, h, dk, device="cuda", generator=g).bfloat16()
    pos = torch.tensor([5, span - 1, span // 2], device="cuda")
    base = torch.arange(s, device="cuda") * ctx
    got = decode_attention(q, k, v, pos, span, 0, dk**-0.5, base=base)
    for r in range(s):
        rows = slice(r * ctx, (r + 1) * ctx)
        ref = decode_attention(q[r : r + 1], k[rows], v[rows], pos[r : r + 1], span, 0, dk**-0.5)
        torch.testing.assert_close(got[r : r + 1], ref)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_few_rows_decode_each_weight_tile_once_and_match_one_row_at_a_time(
    qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QTensor.linear of 2-8 rows runs rows_gemm (each tile decoded once for all rows): the same products as the
    one-row GEMV, float rows with a residual and 8-bit rows, with STRATA_ROWS_GEMM=1; without it, the GEMV."""
    from gguf import GGMLQuantizationType as QT

    from engine.gguf.random_blocks import random_blocks
    from engine.kernels import rows_gemm
    from engine.kernels.gemv import quantize_q8, wants_q8
    from engine.layers.qtensor import QTensor

    qt, n, k = QT[qtype], 1000, 2048
    w = QTensor(torch.from_numpy(random_blocks(qt, n, k, seed=5)).cuda(), qt, (n, k))
    monkeypatch.setenv("STRATA_ROWS_GEMM", "1")
    calls = []
    real = rows_gemm.rows_gemm
    monkeypatch.setattr(rows_gemm, "rows_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for t in (2, 5, 8):
        x = torch.randn(t, k, device="cuda").bfloat16()
        r = torch.randn(t, n, device="cuda")
        got = w.linear(x, residual=r)
        one = torch.cat([w.linear(x[i : i + 1], residual=r[i : i + 1]) for i in range(t)])
        assert _cos(got, one) >= 0.9999
        if not wants_q8(qt, n, k):  # this weight's one-row launch reads float activations
            continue
        xq = quantize_q8(x.float())
        got8 = w.linear(x, q8=xq, out_dtype=torch.float32)
        one8 = torch.cat([w.linear(x[i : i + 1], q8=quantize_q8(x[i : i + 1].float()), out_dtype=torch.float32)
                          for i in range(t)])  # fmt: skip
        assert _cos(got8, one8) >= 0.9999
    done = len(calls)
    assert done >= 3
    monkeypatch.setenv("STRATA_ROWS_GEMM", "0")
    w.linear(torch.randn(4, k, device="cuda").bfloat16())
    assert len(calls) == done


def test_rope_store_writes_each_row_at_its_base() -> None:
    from engine.kernels.attention import rope_store

    t, ctx, h, hkv, dh = 3, 16, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * dh, device="cuda")
    q, k, v = qkv[:, : h * dh], qkv[:, h * dh : (h + hkv) * dh], qkv[:, (h + hkv) * dh :]
    inv = 1.0 / (10000 ** (torch.arange(0, dh, 2, device="cuda").float() / dh))
    pos = torch.tensor([3, 0, 15], device="cuda")
    kc, vc = torch.zeros(t * ctx, hkv, dh, device="cuda"), torch.zeros(t * ctx, hkv, dh, device="cuda")
    base = torch.arange(t, device="cuda") * ctx
    qo = rope_store(q, k, v, None, None, 1e-6, pos, inv, dh, True, 1.0, kc, vc, h, torch.float32, base)
    for r in range(t):
        kr, vr = torch.zeros(ctx, hkv, dh, device="cuda"), torch.zeros(ctx, hkv, dh, device="cuda")
        qr = rope_store(q[r : r + 1], k[r : r + 1], v[r : r + 1], None, None, 1e-6, pos[r : r + 1], inv, dh, True,
                        1.0, kr, vr, h, torch.float32)  # fmt: skip
        torch.testing.assert_close(qo[r : r + 1], qr)
        torch.testing.assert_close(kc[r * ctx : (r + 1) * ctx], kr)
        torch.testing.assert_close(vc[r * ctx : (r + 1) * ctx], vr)


@pytest.mark.parametrize(
    ("graphs", "policy"),
    [
        (False, None),
        (True, None),
        (True, ExpertPolicy(slots=4, cpu_share=0.0, rows=2)),  # misses staged, more than the area holds
        (False, ExpertPolicy(slots=4, cpu_share=1.0, cpu_ratio=1.0)),
        (True, ExpertPolicy(slots=4, cpu_share=1.0, cpu_ratio=1.0)),
        (True, ExpertPolicy(slots=4, cpu_share=1.0, cpu_ratio=0.5, rows=16)),
    ],
    ids=["eager", "graphs", "graphs-staged", "eager-cpu-share", "graphs-cpu-share", "graphs-cpu-half"],
)
def test_rows_of_several_slots_match_each_sequence_alone(
    moe_q4k: Path, graphs: bool, policy: ExpertPolicy | None
) -> None:
    """Each row of a step of 18 slots (two passes: 16 and 2) against its sequence alone; with most experts in host
    RAM, the step's misses staged once each (an area for 2 rows' misses: the rest read in place) or handed to the
    CPU a whole expert at a time for all the rows that chose it."""
    lm = load_model(moe_q4k, device="cuda", dtype="bf16", cuda_graphs=graphs, experts=policy)
    m = lm.model
    n = 18  # more rows than one pass takes (16): two passes a step
    caches = m.new_caches(n, 128, "bf16")
    assert all(c.shared is caches[0].shared is not None for c in caches)
    refs = [m.new_cache(128, "bf16") for _ in range(n)]
    prompts = [PROMPT[: 3 + i] for i in range(n)]  # every slot at its own position
    for p, c, r in zip(prompts, caches, refs, strict=True):
        m.forward(torch.tensor(p), c, 0, last_only=True)
        m.forward(torch.tensor(p), r, 0, last_only=True)
    toks = [40 + i for i in range(n)]
    cm = m.expert_cache.cpu_misses if m.expert_cache is not None else None
    for step in range(6):
        parts = [BatchPart(torch.tensor([toks[s]]), caches[s], len(prompts[s]) + step) for s in range(n)]
        before = cm.timing()["experts"] if cm is not None else 0
        got = m.forward_batch(parts)
        if cm is not None:  # the step's rows handed experts to the CPU
            assert cm.timing()["experts"] > before
        for s in range(n):
            ref = m.forward(torch.tensor([toks[s]]), refs[s], len(prompts[s]) + step)
            assert _cos(got[s], ref[-1]) >= 0.999, (step, s)
            assert caches[s].length == len(prompts[s]) + step + 1
        toks = [int(got[s].argmax()) for s in range(n)]
    if graphs:
        assert len(m.slot_graphs.graphs) > 0  # the rows ran as graphs


def test_the_batch_runner_decodes_slots_together_with_each_ones_tokens(moe_q4k: Path) -> None:
    """Six requests decode in shared steps after a warm-up that captured the graphs of 1-6 rows. Each one's greedy
    tokens are the Runner's alone up to bf16 near-ties (the kernels' tiles depend on the row count): every token
    the batch chose is within a hair of the best under the sequence's own forward, and most runs are identical."""
    lm = load_model(moe_q4k, device="cuda", dtype="bf16")
    m = lm.model
    reqs = [
        GenerationRequest(PROMPT[: 2 + i], max_tokens=12, sampling=GREEDY, ignore_eos=True) for i in range(6)
    ]
    br = BatchRunner(m, lm.tokenizer, 128, "bf16", slots=6)
    assert br.warm() == 6 and len(m.slot_graphs.graphs) == 6
    got: list[list[object]] = [[] for _ in reqs]
    for r, g in zip(reqs, got, strict=True):
        br.admit(r, g.append)
    rows = []
    while br.busy:
        rows += [st.decode_rows for st in br.step()]
    assert max(rows) == 6  # the six decoded in shared steps
    assert len(m.slot_graphs.graphs) == 6  # and found their graphs captured
    same = 0
    for r, g in zip(reqs, got, strict=True):
        done = g[-1]
        assert isinstance(done, DoneEvent) and len(done.tokens) == 12
        alone = list(Runner(m, lm.tokenizer, 128, "bf16").generate(r))
        same += done.tokens == alone[-1].tokens  # type: ignore[attr-defined]
        seq = torch.tensor(r.prompt + done.tokens)
        logits = m.forward(seq, m.new_cache(128, "bf16"), 0)[len(r.prompt) - 1 : -1]
        for row, tok in zip(logits, done.tokens, strict=True):
            assert row.max() - row[tok] <= 0.05 * row.std(), (r.prompt, done.tokens)
    assert same >= 4


def test_a_split_on_one_card_decodes_slots_through_each_stages_fused_path(tmp_path: Path) -> None:
    """Two stages on one card (--layer-split K --split-device 0): the slots' caches are rows of one cache on the
    stages' devices, a step's decode rows cross each stage as one pass of its slot graphs, and each row's logits
    are the unsplit model's for that sequence alone."""
    from engine.link.startup import load_split_model
    from engine.pipeline.split import SplitOptions
    from engine.pipeline.stages import SplitModel

    path = write_tiny_model(tmp_path / "m4.gguf", "qwen3moe", qtype="Q4_K", types={"ffn_down": "Q6_K"}, seed=5,
                            n_layer=4)  # fmt: skip
    whole = load_model(path, device="cuda", dtype="bf16").model
    k = whole.cfg.n_layer // 2  # each stage keeps 2 layers at least
    lm = load_split_model(
        path, SplitOptions(layer_split=(k,), split_device=("0",)), 128, "bf16", "bf16", parallel=5
    )
    m = lm.model
    assert isinstance(m, SplitModel) and len(m.stages) == 2
    caches = m.new_caches(5, 128, "bf16")
    assert all(c.shared is caches[0].shared is not None for c in caches)
    assert m.warm_rows(caches) == 5 and all(c.length == 0 for c in caches)
    refs = [whole.new_cache(128, "bf16") for _ in range(5)]
    prompts = [PROMPT[: 3 + i] for i in range(5)]
    for p, c, r in zip(prompts, caches, refs, strict=True):
        m.forward(torch.tensor(p), c, 0, last_only=True)
        whole.forward(torch.tensor(p), r, 0, last_only=True)
    toks = [40 + i for i in range(5)]
    for step in range(4):
        parts = [BatchPart(torch.tensor([toks[s]]), caches[s], len(prompts[s]) + step) for s in range(5)]
        got = m.forward_batch(parts)
        for s in range(5):
            ref = whole.forward(torch.tensor([toks[s]]), refs[s], len(prompts[s]) + step)
            assert _cos(got[s], ref[-1]) >= 0.999, (step, s)
        toks = [int(got[s].argmax()) for s in range(5)]
    assert all(len(st.model.slot_graphs.graphs) > 0 for st in m.stages)  # each stage ran its rows as graphs


def test_an_overlapped_step_is_queued_without_waiting_for_the_device(moe_q4k: Path) -> None:
    """With every slot decoding on the device (greedy and seeded top-k rows), a step is queued with no call that
    waits for the card (torch's sync debug mode raises on one): the host then reads the step before while this
    one runs."""
    from engine.pipeline.sampling import SamplingParams

    lm = load_model(moe_q4k, device="cuda", dtype="bf16")
    br = BatchRunner(lm.model, lm.tokenizer, 128, "bf16", slots=4, overlap=True)
    br.warm()
    for i in range(4):
        sampling = SamplingParams(temperature=0.8, top_k=20, seed=i) if i % 2 else GREEDY
        br.admit(
            GenerationRequest(PROMPT[: 3 + i], max_tokens=30, sampling=sampling, ignore_eos=True),
            lambda e: None,
        )
    for _ in range(8):
        br.step()
    assert all(s.request is not None and s.request.pending is not None for s in br.slots)
    parts, plan = br._plan()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flight = br._launch(parts, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert flight is not None and flight.deferrable and flight.decode_rows == 4


def test_verify_windows_of_slots_run_as_rows_of_the_fused_path(moe_q4k: Path) -> None:
    """--spec with slots on a card: each slot's window (its token and drafts) runs as rows of the fused decode path
    (the slot graphs of more rows than slots, captured at warm-up), each row attending up to its own position.
    Each request's greedy tokens are decoding's without drafts up to bf16 near-ties, as above, and drafts are
    kept."""
    from engine.pipeline.spec import SpecConfig

    lm = load_model(moe_q4k, device="cuda", dtype="bf16")
    m = lm.model
    loop = [5, 6, 7, 8, 9]
    reqs = [
        GenerationRequest(loop * (3 + i), max_tokens=24, sampling=GREEDY, ignore_eos=True) for i in range(3)
    ]
    br = BatchRunner(m, lm.tokenizer, 256, "bf16", slots=3, spec=SpecConfig(n=4))
    assert br.warm() == 15 and len(m.slot_graphs.graphs) == 15  # up to 3 windows of 5 rows
    got: list[list[object]] = [[] for _ in reqs]
    for r, g in zip(reqs, got, strict=True):
        br.admit(r, g.append)
    while br.busy:
        br.step()
    kept = 0
    for r, g in zip(reqs, got, strict=True):
        done = g[-1]
        assert isinstance(done, DoneEvent) and len(done.tokens) == 24
        kept += done.timings.drafts_accepted
        seq = torch.tensor(r.prompt + done.tokens)
        logits = m.forward(seq, m.new_cache(256, "bf16"), 0)[len(r.prompt) - 1 : -1]
        for row, tok in zip(logits, done.tokens, strict=True):
            assert row.max() - row[tok] <= 0.05 * row.std(), (r.prompt, done.tokens)
    assert kept > 0
    assert len(m.slot_graphs.graphs) == 15  # every step found its graph captured
