"""Prompt cache: a request that extends a kept sequence reads only its new tokens, and answers exactly as a fresh
run of the whole prompt does (the reference: a runner with no cache, or `cache_prompt: false`)."""

from pathlib import Path

import pytest
import torch

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import LoadedModel, load_model
from engine.pipeline.prompt_cache import PromptCache, common_prefix
from engine.pipeline.sampling import GREEDY
from tests.engine.serve.harness import ServerProc


@pytest.fixture(scope="module")
def lm(tiny_model: Path) -> LoadedModel:
    return load_model(tiny_model, device="cpu")


def _run(runner: Runner, prompt: list[int], n: int = 6, cache: bool = True) -> DoneEvent:
    evs = list(runner.generate(GenerationRequest(prompt, max_tokens=n, sampling=GREEDY, cache_prompt=cache)))
    done = evs[-1]
    assert isinstance(done, DoneEvent)
    return done


def _fresh(lm: LoadedModel, prompt: list[int], kv: str = "f32", n: int = 6) -> DoneEvent:
    return _run(Runner(lm.model, lm.tokenizer, 512, kv), prompt, n)


def _prompt(lm: LoadedModel, text: str) -> list[int]:
    return lm.tokenizer.encode(lm.chat.render([{"role": "user", "content": text}]))


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_pinned_entries_take_slabs_of_a_power_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a card an entry's copies are page-locked in slabs of a power of two (torch's pinned allocator rounds each
    block up to one), and the entry counts the slabs, so that --prompt-cache-mib bounds the memory taken; in plain
    memory one buffer, counted by its bytes. (Pinning needs a card: here the slabs are plain memory.)"""
    from engine.pipeline import prompt_cache as pc

    parts = [torch.randn(n, 8) for n in (3000, 5, 700, 12000)]
    plain = torch.empty
    asked: list[int] = []

    def unpinned(n: int, pin_memory: bool = False, **k: object) -> torch.Tensor:
        asked.append(n)
        return plain(n, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(pc.torch, "empty", unpinned)
    copies, held = pc._copy_out(parts, pin=True)
    assert all(torch.equal(c, p) for c, p in zip(copies, parts, strict=True))
    assert held == sum(asked) and all(n & (n - 1) == 0 for n in asked)
    need = sum(p.numel() * 4 for p in parts)
    assert need <= held <= 1.5 * need + 4 * 4096  # one buffer of 1 << 19 would have been 1.67x
    asked.clear()
    copies, held = pc._copy_out(parts, pin=False)
    assert all(torch.equal(c, p) for c, p in zip(copies, parts, strict=True))
    assert len(asked) == 1 and held == asked[0] < need + 4 * 16


@pytest.mark.parametrize("kv", ["f32", "int8", "q4_0"])
def test_switching_conversations_reuses_kept_kv(lm: LoadedModel, kv: str) -> None:
    runner = Runner(lm.model, lm.tokenizer, 512, kv, prompt_cache=PromptCache(64 << 20, min_tokens=4))
    a = _prompt(lm, "Conversation A talks about the sea and its ships.")
    b = _prompt(lm, "Conversation B is about mountains.")
    a1 = _run(runner, a)
    _run(runner, b)  # replaces A in the live cache; A goes to the prompt cache
    a2_prompt = a + a1.tokens + lm.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
    a2 = _run(runner, a2_prompt)
    # Everything of turn 1 that was in the KV (its prompt and all answer tokens but the last) was reused.
    assert a2.timings.prompt_cached == len(a) + len(a1.tokens) - 1
    assert runner.prompt_cache is not None and runner.prompt_cache.stats().restores == 1
    assert a2.tokens == _fresh(lm, a2_prompt, kv).tokens
    # And B, now kept, comes back too.
    b2 = _run(runner, b + lm.tokenizer.encode(" more"))
    assert b2.timings.prompt_cached == len(b)
    assert b2.tokens == _fresh(lm, b + lm.tokenizer.encode(" more"), kv).tokens


def test_restored_logits_match_a_fresh_prefill(lm: LoadedModel) -> None:
    pc = PromptCache(64 << 20, min_tokens=4)
    runner = Runner(lm.model, lm.tokenizer, 512, "f32", prompt_cache=pc)
    a = _prompt(lm, "The logits after a restore are those of a full prefill.")
    _run(runner, a, n=1)
    _run(runner, _prompt(lm, "something else entirely"), n=1)
    entry, n = pc.lookup(a[:-1])  # as the runner asks: the last prompt token is always read again
    assert entry is not None and n == len(a) - 1
    pc.restore(entry, n, runner.cache)
    with torch.inference_mode():
        got = lm.model.forward(torch.tensor(a[n:]), runner.cache, n)[-1]
        ref_cache = lm.model.new_cache(512, "f32")
        want = lm.model.forward(torch.tensor(a), ref_cache, 0)[-1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cache_prompt_false_reads_everything(lm: LoadedModel) -> None:
    runner = Runner(lm.model, lm.tokenizer, 512, "f32", prompt_cache=PromptCache(64 << 20))
    a = _prompt(lm, "Read me twice.")
    first = _run(runner, a)
    again = _run(runner, a, cache=False)
    assert again.timings.prompt_cached == 0
    assert again.tokens == first.tokens
    assert _run(runner, a).timings.prompt_cached == len(a) - 1


def test_memory_bound_and_lru(lm: LoadedModel) -> None:
    probe = lm.model.new_cache(512, "f32")
    per_token = probe.nbytes // 512
    prompts = [_prompt(lm, f"Conversation number {i} about topic {i * 7}.") for i in range(8)]
    size = len(prompts[0]) + 1
    budget = per_token * size * 3  # room for about three conversations
    pc = PromptCache(budget, min_tokens=4)
    runner = Runner(lm.model, lm.tokenizer, 512, "f32", prompt_cache=pc)
    for p in prompts:
        _run(runner, p, n=2)
        assert pc.nbytes <= budget
    s = pc.stats()
    assert 1 <= s.entries <= 3 and s.evictions >= 4
    # The most recent conversations are the ones kept (the last one is still live, not in the cache).
    kept = {tuple(e.tokens[: len(prompts[0]) - 2]) for e in pc.entries}
    assert tuple(prompts[-2][: len(prompts[0]) - 2]) in kept
    assert tuple(prompts[0][: len(prompts[0]) - 2]) not in kept


def test_prefixes_are_merged(lm: LoadedModel) -> None:
    cache = lm.model.new_cache(64, "f32")
    toks = list(range(1, 41))
    with torch.inference_mode():
        lm.model.forward(torch.tensor(toks), cache, 0)
    pc = PromptCache(64 << 20, min_tokens=4)
    pc.save(toks[:20], cache)
    pc.save(toks[:40], cache)  # covers the first
    assert [len(e.tokens) for e in pc.entries] == [40]
    pc.save(toks[:30], cache)  # already covered
    assert [len(e.tokens) for e in pc.entries] == [40]
    pc.save(toks[:3], cache)  # too short to be worth a copy
    assert len(pc.entries) == 1
    entry, n = pc.lookup([*toks[:25], 999])
    assert entry is pc.entries[0] and n == 25


def test_server_second_turn_reuses_the_first(server: ServerProc) -> None:
    system = {"role": "system", "content": "You answer in a few words."}
    a1 = [system, {"role": "user", "content": "What is the colour of the sea on a sunny day?"}]
    r1 = server.post("/v1/chat/completions", {"messages": a1, "max_tokens": 6, "temperature": 0}).json()
    # As many other conversations in between as the server has slots, so that the first one's slot is taken (the
    # least recently used goes first) and it must come back from the prompt cache.
    slots = server.get("/stats").json()["slots"]["total"]
    for i in range(slots):
        topic = ("trains and stations", "a recipe for bread", "the rules of chess", "mountains in winter")[
            i % 4
        ]
        other = [{"role": "user", "content": f"{i}: something unrelated about {topic}."}]
        server.post("/v1/chat/completions", {"messages": other, "max_tokens": 6, "temperature": 0})
    a2 = [*a1, r1["choices"][0]["message"], {"role": "user", "content": "And at night?"}]
    body = {"messages": a2, "max_tokens": 8, "temperature": 0}
    cached = server.post("/v1/chat/completions", body).json()
    fresh = server.post("/v1/chat/completions", {**body, "cache_prompt": False}).json()
    t = cached["timings"]
    assert t["cache_n"] >= r1["usage"]["prompt_tokens"]
    assert t["cache_n"] + t["prompt_n"] == cached["usage"]["prompt_tokens"]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    assert fresh["timings"]["cache_n"] == 0
    assert fresh["timings"]["prompt_n"] == fresh["usage"]["prompt_tokens"]
    assert cached["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
    assert cached["usage"]["completion_tokens"] == fresh["usage"]["completion_tokens"]
    pc = server.get("/stats").json()["prompt_cache"]
    assert pc["restores"] >= 1 and pc["entries"] >= 1 and 0 < pc["bytes"] <= pc["max_bytes"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_a_save_on_a_card_is_queued_and_restores_what_it_saw(kv: str) -> None:
    """On a card the save's copies go to page-locked memory behind the device's work (no wait), so a write
    queued after the save does not reach the entry, and a restore gives back exactly the saved positions."""
    from engine.layers.kv_cache import KVCache

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    src = KVCache(range(3), 64, 2, 16, 16, kv, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(1)
    for lk in src.layers.values():
        for t in (lk.k, lk.v, lk.k_scale, lk.v_scale):
            if t is not None:
                t.copy_((torch.rand(t.shape, generator=g, device="cuda") * 100).to(t.dtype))
    src.length = 40
    want = {i: [t[:40].clone() if t is not None else None for t in (lk.k, lk.v, lk.k_scale, lk.v_scale)]
            for i, lk in src.layers.items()}  # fmt: skip
    pc = PromptCache(1 << 30)
    torch.cuda.set_sync_debug_mode("error")  # the save gathers on the card and copies out without a wait
    try:
        pc.save(list(range(40)), src)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for lk in src.layers.values():  # queued after the save's copies
        lk.k.zero_()
    (entry,) = pc.entries
    assert all(t.is_pinned() for parts in entry.layers.values() for t in parts if t is not None)
    dst = KVCache(range(3), 64, 2, 16, 16, kv, torch.device("cuda"))
    pc.restore(entry, 40, dst)
    for i, lk in dst.layers.items():
        for got, w in zip((lk.k, lk.v, lk.k_scale, lk.v_scale), want[i], strict=True):
            assert (got is None) == (w is None)
            if got is not None:
                assert torch.equal(got[:40], w)
