"""The layer split on CUDA: two stages on one card (`--split-device 0`) give the unsplit model's logits bit for bit
- prompt, decode steps through the stages' CUDA graphs, and greedy tokens - and the pinned-host hand-off moves
every byte, across ring reuse, sizes and devices."""

import pytest
import torch

from engine.link.startup import load_split_model
from engine.models.family_base import BatchPart
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.handoff import Handoff
from engine.pipeline.loader import load_model
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import SplitModel
from engine.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.gpu
PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180, 3, 8, 77, 19]


@pytest.mark.parametrize(
    ("arch", "qtype", "dtype"), [("qwen3moe", "Q4_K", "bf16"), ("qwen2moe", "Q8_0", "f32")]
)
def test_two_stages_on_one_card_are_bit_identical(
    tmp_path_factory: pytest.TempPathFactory, arch: str, qtype: str, dtype: str
) -> None:
    path = write_tiny_model(tmp_path_factory.mktemp("g") / "m.gguf", arch, qtype=qtype, seed=4, n_layer=6)
    kv = "bf16" if dtype == "bf16" else "f32"
    base = load_model(path, "cuda", dtype)
    lm = load_split_model(
        path, SplitOptions(device="cuda", layer_split=(3,), split_device=("0",)), 128, kv, dtype
    )
    sm = lm.model
    # "cuda" and "cuda:0" name the same card here; compare indices, not spellings.
    card = torch.device("cuda", torch.cuda.current_device())
    assert isinstance(sm, SplitModel)
    assert [torch.device("cuda", d.index if d.index is not None else card.index) for d in sm.devices] == [
        card
    ] * 2
    assert sm.handoffs[0].mode == "host" and not sm.pipeline
    with torch.inference_mode():
        rc, sc = base.model.new_cache(128, kv), sm.new_cache(128, kv)
        assert torch.equal(
            sm.forward(torch.tensor(PROMPT), sc, 0), base.model.forward(torch.tensor(PROMPT), rc, 0)
        )
        tok = torch.tensor([5])
        for p in range(
            len(PROMPT), len(PROMPT) + 12
        ):  # decode steps: CUDA graphs per stage vs the whole model's
            ours, ref = sm.forward(tok, sc, p), base.model.forward(tok, rc, p)
            assert torch.equal(ours, ref), f"step at position {p}"
            tok = ref[-1].argmax().view(1).cpu()
    assert sm.handoffs[0].bytes > 0
    if sm.stages[0].graphs is not None:  # type: ignore[attr-defined]
        assert sm.stages[0].graphs.graphs  # type: ignore[attr-defined]

    def greedy(model: object, tok: object) -> list[int]:
        r = Runner(model, tok, 128, kv, 8)  # type: ignore[arg-type]
        req = GenerationRequest(PROMPT, max_tokens=24, sampling=GREEDY, ignore_eos=True)
        return next(e for e in r.generate(req) if isinstance(e, DoneEvent)).tokens

    assert greedy(sm, lm.tokenizer) == greedy(base.model, base.tokenizer)


def test_pipelined_pieces_on_one_card_match(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Stage threads sharing one card's stream, pieces handed through pinned memory: the same logits as the unsplit
    model reading the same pieces."""
    path = write_tiny_model(
        tmp_path_factory.mktemp("g") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=9, n_layer=6
    )
    base = load_model(path, "cuda", "f32")
    opts = SplitOptions(
        device="cuda", layer_split=(2, 4), split_device=("0", "0"), pipeline=True, pipe_chunk=4
    )
    sm = load_split_model(path, opts, 64, "f32", "f32").model
    with torch.inference_mode():
        rc, sc = base.model.new_cache(64, "f32"), sm.new_cache(64, "f32")
        ref = torch.cat([base.model.forward(torch.tensor(PROMPT[o : o + 4]), rc, o) for o in range(0, 24, 4)])
        assert torch.equal(sm.forward(torch.tensor(PROMPT), sc, 0), ref)


@pytest.mark.parametrize(
    ("arch", "qtype"), [("qwen3moe", "Q4_K"), ("qwen3", "Q4_K"), ("gemma3", "Q8_0")]
)  # gemma3: sliding windows, its embedding scale on the first stage only
def test_prompt_chunks_run_from_each_stages_prompt_graphs(
    tmp_path_factory: pytest.TempPathFactory, arch: str, qtype: str
) -> None:
    """Each stage captures prompt graphs of its own layers (the second stage takes hidden rows in place of token
    ids, the first hands its hidden rows on): once warm, the prompt chunks of two slots in one step run through
    no eager layer and give the unsplit model's graphed logits and KV; a second chunk at a later position too."""
    path = write_tiny_model(tmp_path_factory.mktemp("g") / "m.gguf", arch, qtype=qtype, seed=5, n_layer=6)
    base = load_model(path, "cuda", "bf16").model
    sm = load_split_model(
        path, SplitOptions(device="cuda", layer_split=(3,), split_device=("0",)), 128, "bf16", "bf16"
    ).model
    assert isinstance(sm, SplitModel) and sm._prompts_graphed()
    assert sm.warm_prompt_graphs(64, "bf16") == [4, 8, 12, 16, 24, 32, 48, 64]
    base.prompt_graphs.warm(64, "bf16")

    def eager(*a: object, **k: object) -> None:
        raise AssertionError("a prompt chunk ran through the eager layers")

    for st in sm.stages:
        st.model.layer_at = eager  # type: ignore[attr-defined]
        st.model.layers_batch = eager  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 400, (n,), generator=g) for n in (37, 29)]
    with torch.inference_mode():
        caches = [sm.new_cache(128, "bf16") for _ in prompts]
        refs = [base.new_cache(128, "bf16") for _ in prompts]
        for at, n in ((0, 15), (15, 9)):  # two chunks each: the second attends to the first's KV
            parts = [BatchPart(p[at : at + n], c, at) for p, c in zip(prompts, caches, strict=True)]
            got = sm.forward_batch(parts)
            ref = torch.cat(
                [
                    base.forward(p[at : at + n], c, at, last_only=True)
                    for p, c in zip(prompts, refs, strict=True)
                ]
            )
            assert got.shape == ref.shape == (2, ref.shape[1])
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    for c, r in zip(caches, refs, strict=True):
        for i in range(6):
            torch.testing.assert_close(c.layers[i].k[:24], r.layers[i].k[:24], rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(c.layers[i].v[:24], r.layers[i].v[:24], rtol=1e-2, atol=1e-2)


def test_host_handoff_moves_every_byte() -> None:
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    h = Handoff(dev, dev, "host", slots=2)
    outs, ins = [], []
    for t in (1, 7, 4096, 3, 1, 513):  # sizes change, slots are reused before the reader has synchronised
        x = torch.randn(t, 2048, device=dev, generator=g)
        ins.append(x)
        outs.append(h.send(x))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ins, outs, strict=True))
    up, down = Handoff(torch.device("cpu"), dev, "host"), Handoff(dev, torch.device("cpu"), "host")
    x = torch.randn(33, 64)
    assert torch.equal(down.send(up.send(x)), x)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA cards")
def test_two_cards_match_one(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = write_tiny_model(
        tmp_path_factory.mktemp("g") / "m.gguf", "qwen3moe", qtype="Q8_0", seed=3, n_layer=6
    )
    base = load_model(path, "cuda:0", "f32")
    for handoff in ("host", "auto"):
        opts = SplitOptions(gpus=(0, 1), layer_split=(3,), handoff=handoff, pipe_chunk=4)  # type: ignore[arg-type]
        sm = load_split_model(path, opts, 64, "f32", "f32").model
        with torch.inference_mode():
            rc, sc = base.model.new_cache(64, "f32"), sm.new_cache(64, "f32")
            ref = torch.cat(
                [base.model.forward(torch.tensor(PROMPT[o : o + 4]), rc, o) for o in range(0, 24, 4)]
            )
            ours = sm.forward(torch.tensor(PROMPT), sc, 0).to(ref.device)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # two cards may pick other kernels
