"""Qwen3-Next's recurrent state: the delta rule and the causal convolution against transformers' reference torch
functions, prompt chunks of any size against one chunk, and the cache's truncation (checkpoints, per-token states
of verify windows, reading lost positions again), snapshots for the prompt cache, and refusing a state that does
not match the cached keys and values."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.models.gated_delta import (
    RecurrentCache,
    RecurrentStateError,
    causal_conv,
    delta_rule_chunked,
    delta_rule_steps,
)
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_families import write_tiny_family

TOKENS = torch.randint(0, 500, (160,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_family(tmp_path_factory.mktemp("q3n") / "q3n.gguf", "qwen3next", qtype="Q8_0", seed=7)


def _inputs(t: int, h: int = 4, hk: int = 2, dk: int = 16, dv: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=g)
    k = torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 3  # strong decays too: exp(cumsum) underflows within a block
    beta = torch.rand(t, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, s0


def _ours(q, k, v, g, beta, s0, chunked: bool):
    r = v.shape[1] // q.shape[1]
    qn = F.normalize(q, dim=-1, eps=0) * q.shape[-1] ** -0.5
    kn = F.normalize(k, dim=-1, eps=0)
    qn, kn = qn.repeat_interleave(r, 1), kn.repeat_interleave(r, 1)
    if chunked:
        return delta_rule_chunked(qn, kn, v, g, beta, s0)
    o, s, _ = delta_rule_steps(qn, kn, v, g, beta, s0)
    return o, s


@pytest.mark.parametrize("t", [1, 5, 150])
def test_delta_rule_matches_transformers_reference(t: int) -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    q, k, v, g, beta, s0 = _inputs(t)
    want_o, want_s = ref.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    chunk_o, _ = ref.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    for chunked in (False, True):
        o, s = _ours(q, k, v, g, beta, s0, chunked)
        assert torch.allclose(o, want_o[0], atol=2e-5), (chunked, (o - want_o[0]).abs().max())
        assert torch.allclose(s, want_s[0], atol=2e-5)
        assert torch.allclose(o, chunk_o[0], atol=2e-5)


def test_causal_conv_matches_conv1d_with_carried_state() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 24, generator=g), torch.randn(24, 4, generator=g)
    want = ref.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()  # [T, C]
    state = torch.zeros(3, 24)
    got = []
    for a, b in ((0, 4), (4, 5), (5, 11)):  # pieces of 4, 1 and 6 tokens carry the state across
        y, window = causal_conv(x[a:b], state, w)
        state = window[-3:]
        got.append(y)
    assert torch.allclose(torch.cat(got), want, atol=1e-5)


def test_prompt_chunks_of_any_size_give_the_logits_of_one_chunk(path: Path) -> None:
    m = load_model(path, device="cpu", dtype="f32").model
    one = m.forward(torch.tensor(TOKENS), m.new_cache(256, "f32"), 0)
    cache = m.new_cache(256, "f32")
    parts, at = [], 0
    for n in (7, 13, 1, 64, 65, 10):  # across the 64-token blocks of the chunked rule, and single tokens
        parts.append(m.forward(torch.tensor(TOKENS[at : at + n]), cache, at))
        at += n
    assert cache.length == at == len(TOKENS)
    assert (torch.cat(parts) - one).abs().max().item() <= 1e-4


def _fresh_logits(m, ids: list[int], then: list[int]) -> torch.Tensor:
    cache = m.new_cache(256, "f32")
    m.forward(torch.tensor(ids), cache, 0)
    return m.forward(torch.tensor(then), cache, len(ids))


def test_truncate_goes_back_exactly_through_checkpoints_and_reading_again(path: Path) -> None:
    m = load_model(path, device="cpu", dtype="f32").model
    cache = m.new_cache(256, "f32")
    assert isinstance(cache, RecurrentCache)
    m.forward(torch.tensor(TOKENS[:30]), cache, 0)  # a prompt chunk: checkpoint at 30
    m.forward(torch.tensor(TOKENS[30:40]), cache, 30)  # checkpoint at 40
    for p in range(40, 44):  # decode steps: no checkpoints
        m.forward(torch.tensor([TOKENS[p]]), cache, p)
    assert sorted(cache.checkpoints) == [30, 40]
    cache.truncate(40)  # a checkpoint: exact at once
    assert cache.length == cache.state_pos == 40
    nxt = TOKENS[40:46]
    assert (m.forward(torch.tensor(nxt), cache, 40) - _fresh_logits(m, TOKENS[:40], nxt)).abs().max() <= 1e-4
    cache.truncate(35)  # between checkpoints: the state goes back to 30, positions 30-34 are read again
    assert cache.length == 35 and cache.state_pos == 30 and 40 not in cache.checkpoints
    nxt = TOKENS[35:41]
    got = m.forward(torch.tensor(nxt), cache, 35)
    assert cache.state_pos == cache.length == 41
    assert (got - _fresh_logits(m, TOKENS[:35], nxt)).abs().max() <= 1e-4
    cache.truncate(3)  # below every checkpoint: from the empty state
    assert cache.state_pos == 0 and not cache.checkpoints
    nxt = TOKENS[3:5]
    assert (m.forward(torch.tensor(nxt), cache, 3) - _fresh_logits(m, TOKENS[:3], nxt)).abs().max() <= 1e-4


def test_verify_window_states_make_truncation_exact(path: Path) -> None:
    m = load_model(path, device="cpu", dtype="f32").model
    cache = m.new_cache(256, "f32")
    cache.max_checkpoints = 0
    cache.step_states = 8
    m.forward(torch.tensor(TOKENS[:20]), cache, 0)
    window = TOKENS[20:26]  # a drafted window of 6 tokens, 2 accepted
    m.forward(torch.tensor(window), cache, 20)
    cache.truncate(22)
    assert cache.length == cache.state_pos == 22  # no reading again: the window kept every state
    nxt = TOKENS[40:43]
    assert (m.forward(torch.tensor(nxt), cache, 22) - _fresh_logits(m, TOKENS[:22], nxt)).abs().max() <= 1e-4


def test_snapshot_restore_and_a_foreign_length_is_refused(path: Path) -> None:
    m = load_model(path, device="cpu", dtype="f32").model
    cache = m.new_cache(256, "f32")
    m.forward(torch.tensor(TOKENS[:25]), cache, 0)
    saved, kv = (
        cache.snapshot(),
        {i: (lk.k[:25].clone(), lk.v[:25].clone()) for i, lk in cache.layers.items()},
    )
    m.forward(torch.tensor(TOKENS[100:140]), cache, 25)  # another continuation overwrites state and KV
    for i, (k, v) in kv.items():  # what a prompt-cache entry restores: its KV ...
        cache.layers[i].k[:25].copy_(k)
        cache.layers[i].v[:25].copy_(v)
    cache.restore(saved, TOKENS[:25])  # ... and its states
    nxt = TOKENS[25:30]
    assert (m.forward(torch.tensor(nxt), cache, 25) - _fresh_logits(m, TOKENS[:25], nxt)).abs().max() <= 1e-4
    cache.length = 10  # a restore that knows nothing of the state
    with pytest.raises(RecurrentStateError, match="start the sequence again"):
        m.forward(torch.tensor([1]), cache, 10)
    cache.truncate(0)
    with pytest.raises(RecurrentStateError, match="starts at 5"):
        m.forward(torch.tensor([1]), cache, 5)


def test_runner_reuses_a_conversation_prefix(path: Path) -> None:
    """A second request that shares a prefix with the first (as a chat's next turn does, cut inside the answer)
    gives the tokens of reading it from scratch."""
    lm = load_model(path, device="cpu", dtype="f32")
    runner = Runner(lm.model, lm.tokenizer, 256, "f32", prefill_chunk=16)

    def greedy(r: Runner, prompt: list[int]) -> list[int]:
        req = GenerationRequest(prompt, max_tokens=6, sampling=GREEDY, ignore_eos=True)
        return next(e for e in r.generate(req) if isinstance(e, DoneEvent)).tokens

    first = TOKENS[:40]
    answer = greedy(runner, first)
    second = first + answer[:3] + TOKENS[60:70]
    assert greedy(runner, second) == greedy(Runner(lm.model, lm.tokenizer, 256, "f32"), second)
