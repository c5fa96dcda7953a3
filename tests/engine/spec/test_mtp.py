"""Drafts from GLM's own draft (nextn / MTP) layer: which states and slots the draft layer reads (a toy that
records its calls), its draft logits against a reference written out here from the math (HF transformers' target
for the hidden states and its decoder layer for the block, on weights dequantized by gguf.quants), and greedy
tokens identical to decoding without drafts on one stage and on a 2-stage CPU split - also with a draft layer
perturbed so that every draft is wrong."""

import logging
from pathlib import Path

import gguf
import pytest
import torch

from engine.layers.qtensor import QTensor
from engine.models.glm4moe import Glm4MoeLM
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.mtp import DraftLayerSource, draft_layer_of
from engine.pipeline.sampling import GREEDY, Sampler, SamplingParams
from engine.pipeline.spec import Draft, DraftPicker, SpecConfig, SpecError, draft_sources, window_graphs_for
from engine.testing.tiny_families import write_tiny_family
from tests.engine.hf_reference import read_gguf
from tests.engine.hf_reference_families import hf_family_model
from tests.engine.spec.toys import BigramToy, ScriptedDraft, family_split, reference_greedy, two_stage_split

PROMPT = [5, 9, 33, 71, 120, 200, 7, 64, 3, 11, 5, 9, 33, 71, 120, 200, 7, 64, 3, 11]
N = 16
CTX = 128
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)  # q = softmax(logits)


def test_slots_and_states_the_draft_layer_reads() -> None:
    """Slot i pairs the target's state at i with the token after it; a chain reads its own states; the slots of
    kept drafts are written again from the target's states, in one call with the next chain's first step."""
    toy = BigramToy(torch.zeros(4, 4), torch.eye(4)[[1, 2, 3, 0]] * 5)  # the draft layer says t + 1 mod 4
    cache = toy.new_cache(16, "f32")
    src = DraftLayerSource(toy, Sampler(GREEDY), cache)
    src.reset([])
    toy.forward(torch.tensor([0, 1]), cache, 0)  # a prompt in two chunks
    src.commit([0, 1])
    toy.forward(torch.tensor([2]), cache, 2)
    src.commit([2])
    assert toy.draft_calls == [[(0, 1, 0.0), (1, 2, 1.0)]]  # a chunk's slots are written at the next one
    toy.draft_calls.clear()
    assert src.propose([3], 3) == Draft([0, 1, 2])
    assert toy.draft_calls == [
        [(2, 3, 2.0)],  # the last chunk's slots with the chain's first step
        [(3, 0, -3.0)],
        [(4, 1, -4.0)],
    ]
    toy.draft_calls.clear()
    toy.forward(torch.tensor([3, 0, 1, 2]), cache, 3)  # the window; draft 0 kept
    src.commit([3, 0])
    assert src.propose([1], 2).tokens == [2, 3]
    assert toy.draft_calls == [
        [(3, 0, 3.0), (4, 1, 4.0)],
        [(5, 2, -5.0)],
    ]  # slot 3 from the target's state now
    toy.draft_calls.clear()
    # Two windows drafted elsewhere (no chain in between): the earlier rows' slots are written at the next one.
    toy.forward(torch.tensor([1, 2, 3]), cache, 5)
    src.commit([1, 2])
    toy.forward(torch.tensor([3, 0]), cache, 7)
    src.commit([3])
    assert toy.draft_calls == [[(5, 2, 5.0), (6, 3, 6.0)]]
    toy.draft_calls.clear()
    # A guessed window: the chain reads through its tokens, then drafts.
    assert src.propose([0, 1], 1).tokens == [2]
    assert toy.draft_calls == [[(7, 0, 7.0)], [(8, 1, -8.0)]]
    toy.draft_calls.clear()
    toy.forward(torch.tensor([0, 1, 2]), cache, 8)
    src.commit([0, 1])
    src.finish()  # the kept draft's slot, for a later request that continues this sequence
    assert toy.draft_calls == [[(8, 1, 8.0)]]
    # The chain stops at the end of the cache.
    src.reset(list(range(15)))
    toy.forward(torch.tensor([0]), cache, 15)
    src.commit([0])
    assert src.propose([1], 4).tokens == [2]


def _reference_logits(
    t: dict, hf_target: torch.nn.Module, hf_block: torch.nn.Module, seq: list[int], committed: int, chain: int
) -> torch.Tensor:
    """The draft layer's logits for the last `chain` + 1 slots, written out from the math: slot i reads (g_i,
    x_{i+1}), g_i the target's final hidden state after the output norm for i < committed, else the draft
    layer's own output at slot i-1 after its shared head norm; -> [chain + 1, V]."""
    n = hf_target.config.num_hidden_layers
    b = f"blk.{n}.nextn."
    eps = hf_target.config.rms_norm_eps

    def w(name: str) -> torch.Tensor:
        return torch.from_numpy(t[name].copy())

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w(name)

    table = w(b + "embed_tokens.weight") if b + "embed_tokens.weight" in t else w("token_embd.weight")
    head = w(b + "shared_head_head.weight") if b + "shared_head_head.weight" in t else w("output.weight")
    with torch.inference_mode():
        states = hf_target.model(torch.tensor(seq[:committed])[None]).last_hidden_state[0]  # [L, D], normed
        out = []
        for _ in range(chain + 1):
            m = states.shape[0]
            e = rms(table[torch.tensor(seq[1 : m + 1])], b + "enorm.weight")
            z = torch.cat((e, rms(states, b + "hnorm.weight")), -1) @ w(b + "eh_proj.weight").T  # [m, D]
            pos = torch.arange(m)[None]
            mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
            pe = hf_block.model.rotary_emb(z[None], pos)
            y = hf_block.model.layers[n](
                z[None], attention_mask=mask, position_ids=pos, position_embeddings=pe
            )
            g = rms((y[0] if isinstance(y, tuple) else y)[0], b + "shared_head_norm.weight")  # [m, D]
            out.append(g[-1] @ head.T)
            states = torch.cat((states, g[-1:]))
    return torch.stack(out)


CASES = [
    pytest.param(True, "cpu", "Q8_0", id="own-tables"),
    pytest.param(False, "cpu", "Q8_0", id="shared-tables"),
    pytest.param(True, "cuda", "Q4_K", id="cuda-graphs", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("tables", "device", "qtype"), CASES)
def test_draft_logits_match_reference(tmp_path: Path, tables: bool, device: str, qtype: str) -> None:
    """A prompt read in two chunks, a chain of three drafts, a window with one kept, a chain of two, a one-token
    step, a chain of one: the draft distributions equal the reference's (GLM-4.5 layout with the block's own token
    table and head, and GLM-4.6's without; on CUDA the window and the step replay CUDA graphs)."""
    path = write_tiny_family(tmp_path / "glm.gguf", "glm4moe", qtype=qtype, seed=7, nextn_tables=tables)
    model = load_model(path, device, "f32").model
    assert isinstance(model, Glm4MoeLM) and draft_layer_of(model) is model
    assert (model.nextn[model.cfg.n_layer].head is not None) == tables
    cache = model.new_cache(64, "f32")
    graphs = window_graphs_for(model, SpecConfig(n=4))
    assert (graphs is not None) == (device == "cuda")
    src = DraftLayerSource(model, Sampler(PLAIN), cache)
    src.reset([])
    p = len(PROMPT)
    with torch.inference_mode():
        for pos, chunk in ((0, PROMPT[:12]), (12, PROMPT[12:])):
            model.forward(torch.tensor(chunk), cache, pos)
            src.commit(chunk)
        y, z, x = 77, 5, 300
        first = src.propose([y], 3)
        window = [y, *first.tokens]
        if graphs is not None:
            graphs.forward(window, cache, p)
        else:
            model.forward(torch.tensor(window), cache, p)
        cache.truncate(p + 2)
        src.commit(window[:2])  # the first draft kept
        second = src.propose([z], 2)
        model.forward(torch.tensor([z]), cache, p + 2)  # a window without drafts: the model's own step
        src.commit([z])
        third = src.propose([x], 1)

    _, t = read_gguf(path)
    target, block = hf_family_model(path), hf_family_model(path, with_draft=True)
    cases = [
        (first, PROMPT + window, p),
        (second, PROMPT + window[:2] + [z, *second.tokens], p + 2),
        (third, PROMPT + window[:2] + [z, x, *third.tokens], p + 3),
    ]
    for draft, seq, committed in cases:
        assert draft.probs is not None
        ref = _reference_logits(t, target, block, seq, committed, len(draft.tokens) - 1)
        diff = (draft.probs.log() - torch.log_softmax(ref, -1)).abs().max().item()
        assert diff <= 1e-3, diff


def _run(model: object, tok: object, spec: SpecConfig) -> DoneEvent:
    runner = Runner(model, tok, CTX, "f32", 8, spec=spec)  # type: ignore[arg-type]
    req = GenerationRequest(PROMPT, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    return [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]


def _always_wrong(model: Glm4MoeLM, ref: list[int]) -> None:
    """Give the draft block a head that says one of two tokens the answer never has: every draft is wrong."""
    nw = model.nextn[model.cfg.n_layer]
    v, d = model.cfg.n_vocab, model.cfg.n_embd
    x, y = [i for i in range(v) if i not in ref][:2]
    w = torch.zeros(v, d)
    u = torch.randn(d, generator=torch.Generator().manual_seed(0))
    w[x], w[y] = u, -u  # whatever the state, one of the two has the largest logit
    nw.head = QTensor(w.contiguous().view(torch.uint8), gguf.GGMLQuantizationType.F32, (v, d))


def test_greedy_tokens_identical_one_stage(tiny_models: dict[str, Path]) -> None:
    lm = load_model(tiny_models["glm4moe"], "cpu", "f32")
    ref = reference_greedy(lm.model, PROMPT, N, CTX)
    assert _run(lm.model, lm.tokenizer, SpecConfig(n=0)).tokens == ref
    for n in (2, 4):
        mtp = _run(lm.model, lm.tokenizer, SpecConfig(n=n, suffix=False))
        assert mtp.tokens == ref, f"--spec {n}, draft layer only"
        assert mtp.timings.drafts_proposed >= mtp.timings.decode_windows  # every window drafts
        both = _run(lm.model, lm.tokenizer, SpecConfig(n=n))
        assert both.tokens == ref, f"--spec {n}, draft layer and earlier context"
    assert isinstance(lm.model, Glm4MoeLM)
    _always_wrong(lm.model, ref)
    for n in (2, 4):
        wrong = _run(lm.model, lm.tokenizer, SpecConfig(n=n, suffix=False))
        assert wrong.tokens == ref, f"--spec {n}, every draft wrong"
        t = wrong.timings
        assert t.drafts_accepted == 0 and t.drafts_proposed > 0 and t.decode_windows == N - 1


def test_greedy_tokens_identical_two_stages(tiny_models: dict[str, Path]) -> None:
    """The draft layer sits with the head on the last stage; serial windows and --pipeline-windows 2; prompt chunks
    read in pieces that flow through the stages give the draft layer the rows of every piece."""
    path = tiny_models["glm4moe"]
    lm = load_model(path, "cpu", "f32")
    ref = reference_greedy(lm.model, PROMPT, N, CTX)
    sm = two_stage_split(path, "glm4moe", 1, CTX)
    last = sm.stages[-1].model
    assert draft_layer_of(sm) is last and draft_layer_of(sm.stages[0].model) is None
    for spec in (
        SpecConfig(n=2, suffix=False),
        SpecConfig(n=4),
        SpecConfig(n=4, suffix=False, pipeline_windows=2),
    ):
        done = _run(sm, lm.tokenizer, spec)
        assert done.tokens == ref, spec
        assert done.timings.drafts_proposed > 0

    # The one-stage model and a split whose 8-token prompt chunks go through the stages in pieces of 5 and 3
    mtp = SpecConfig(n=4, suffix=False)
    whole = Runner(lm.model, lm.tokenizer, CTX, "f32", 8, spec=mtp)
    piped = family_split(path, 1, pipeline=True, pipe_chunk=5)
    pieces = Runner(piped, lm.tokenizer, CTX, "f32", 8, spec=mtp)
    req = GenerationRequest(PROMPT, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    for runner in (whole, pieces):
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
        assert done.tokens == ref
    j, n = lm.model.cfg.n_layer, len(PROMPT) + N - 2
    a, b = whole.cache.layers[j], pieces.cache.layers[j]
    assert torch.allclose(a.k[:n], b.k[:n], atol=1e-4) and torch.allclose(a.v[:n], b.v[:n], atol=1e-4)

    assert isinstance(last, Glm4MoeLM)
    _always_wrong(last, ref)
    wrong = _run(sm, lm.tokenizer, SpecConfig(n=4, suffix=False))
    assert (
        wrong.tokens == ref and wrong.timings.drafts_accepted == 0 and wrong.timings.decode_windows == N - 1
    )


def test_draft_kv_follows_the_sequence_across_requests(tiny_models: dict[str, Path]) -> None:
    """Drafts kept from another source (always right here), then a second request that continues the first: the
    draft layer's KV of the reused positions is what a fresh read of the whole sequence writes (but the one slot at
    the boundary), and the tokens are those of decoding without drafts."""
    lm = load_model(tiny_models["glm4moe"], "cpu", "f32")
    model = lm.model
    assert isinstance(model, Glm4MoeLM)
    ref = reference_greedy(model, PROMPT, N, CTX)
    truth = PROMPT + ref
    spec = SpecConfig(n=4, suffix=False)
    runner = Runner(model, lm.tokenizer, CTX, "f32", 8, spec=spec)
    # Copies of the known answer come first (strong_match 0), so the draft layer only follows the kept tokens.
    runner.drafts = lambda s: DraftPicker(
        ScriptedDraft(truth, model.cfg.n_vocab, 0),  # type: ignore[arg-type]
        DraftLayerSource(model, s, runner.cache),
        0,
    )
    req = GenerationRequest(PROMPT, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    first = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
    assert first.tokens == ref and first.timings.drafts_accepted >= N // 2
    runner.drafts = lambda s: draft_sources(model, spec, s, runner.cache)
    longer = PROMPT + ref + [3, 11]
    ref2 = reference_greedy(model, longer, N, CTX)
    req2 = GenerationRequest(longer, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    second = [e for e in runner.generate(req2) if isinstance(e, DoneEvent)][0]
    assert second.tokens == ref2 and second.timings.prompt_cached == len(PROMPT) + N - 1

    fresh = Runner(model, lm.tokenizer, CTX, "f32", 8, spec=spec)
    again = [e for e in fresh.generate(req2) if isinstance(e, DoneEvent)][0]
    assert again.tokens == ref2
    j, n = (
        model.cfg.n_layer,
        second.timings.prompt_cached - 1,
    )  # slots 0..n-1: pairs known in the first request
    kept, read = runner.cache.layers[j], fresh.cache.layers[j]
    assert torch.allclose(kept.k[:n], read.k[:n], atol=1e-4) and torch.allclose(
        kept.v[:n], read.v[:n], atol=1e-4
    )


def test_mtp_flags(tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """--mtp 1 refuses a model without a draft layer, and needs --spec; --mtp 0 leaves the layer out; the log
    says where the drafts come from."""
    lm = load_model(tiny_models["qwen2"], "cpu", "f32")
    with pytest.raises(SpecError, match="--mtp 1: the model has no draft layer"):
        Runner(lm.model, lm.tokenizer, CTX, "f32", spec=SpecConfig.from_flags(4, True, "1"))
    with pytest.raises(SpecError, match="give --spec N"):
        SpecConfig.from_flags(0, True, "1")
    with pytest.raises(SpecError, match="--mtp yes: use auto"):
        SpecConfig.from_flags(4, True, "yes")
    glm = load_model(tiny_models["glm4moe"], "cpu", "f32")
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        Runner(glm.model, glm.tokenizer, CTX, "f32", spec=SpecConfig.from_flags(4, True, "auto"))
        Runner(lm.model, lm.tokenizer, CTX, "f32", spec=SpecConfig.from_flags(4, False, "auto"))
    assert [r.getMessage() for r in caplog.records] == [
        "verify windows: up to 4 drafts each, from the model's draft layer and earlier context",
        "verify windows: nothing to draft from (no draft layer, --suffix-draft 0): one token a step",
    ]
    off = _run(glm.model, glm.tokenizer, SpecConfig.from_flags(4, False, "0"))
    assert off.timings.drafts_proposed == 0  # no source left: one token per forward


@pytest.mark.gpu
def test_greedy_tokens_identical_on_cuda(tmp_path: Path) -> None:
    """One card: windows and steps replay CUDA graphs, whose head rows feed the draft layer."""
    path = write_tiny_family(tmp_path / "glm.gguf", "glm4moe", qtype="Q4_K", seed=3)
    lm = load_model(path, "cuda", "f32")
    ref = reference_greedy(lm.model, PROMPT, N, CTX)
    runner = Runner(lm.model, lm.tokenizer, CTX, "f32", 8, spec=SpecConfig(n=4, suffix=False))
    assert runner.window_graphs is not None
    req = GenerationRequest(PROMPT, max_tokens=N, sampling=GREEDY, ignore_eos=True)
    done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
    assert done.tokens == ref and done.timings.drafts_proposed > 0
