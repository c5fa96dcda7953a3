"""A prompt read layer by layer in spans of several chunks (FamilyLM.forward_span, used where a card streams experts
for its prompt chunks) against HF transformers on the same dequantized weights: the last row's logits, and greedy
tokens through the Runner's span path; the span arithmetic (engine/pipeline/prefill.py)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.gguf.model_config import ModelConfig
from engine.models.family_base import FamilyLM
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.loader import load_model
from engine.pipeline.prefill import SPAN_MAX, span_tokens
from engine.pipeline.sampling import GREEDY
from engine.testing.tiny_families import write_tiny_family
from engine.testing.tiny_models import write_tiny_model
from tests.engine.hf_reference import hf_greedy, hf_logits, hf_model
from tests.engine.hf_reference_families import hf_family_model

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180, 21, 8, 60]
CASES = [
    ("qwen3moe", "Q4_K"),
    ("qwen2moe", "Q8_0"),
    ("mixtral", "F32"),
    ("gemma3", "F32"),
    ("deepseek2", "Q8_0"),
    ("glm4moe", "F32"),
    ("gpt-oss", "F32"),
]
FAMILIES = {"deepseek2", "glm4moe", "gpt-oss"}


def _write(tmp_path: Path, arch: str, qtype: str) -> tuple[Path, object]:
    path = tmp_path / f"{arch}-{qtype}.gguf"
    if arch in FAMILIES:
        write_tiny_family(path, arch, qtype=qtype, seed=5)
        return path, hf_family_model(path)
    write_tiny_model(path, arch, qtype=qtype, seed=5)
    return path, hf_model(path)


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_span_logits_match_transformers(tmp_path: Path, arch: str, qtype: str) -> None:
    """Chunks of 5 tokens, layer by layer, starting after a first forward of 3 tokens (a span that starts inside
    the cache): the last row's logits as HF's for the whole prompt, and the cache's length moved on."""
    path, ref_model = _write(tmp_path, arch, qtype)
    ref = hf_logits(ref_model, PROMPT)[-1]
    lm = load_model(path, device="cpu", dtype="f32")
    cache = lm.model.new_cache(64, "f32")
    lm.model.forward(torch.tensor(PROMPT[:3]), cache, 0)
    ours = lm.model.forward_span(torch.tensor(PROMPT[3:]), cache, 3, 5)[0]
    assert cache.length == len(PROMPT)
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=0).item()
    assert cos >= 0.9999, f"cosine {cos}"
    assert (ours - ref).abs().max().item() <= 1e-3


def test_runner_reads_spans_and_greedy_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Runner reads a prompt in spans where the model streams experts. On a CPU nothing streams, so the test
    says it does (the GPU test in test_expert_cache.py runs the real expert cache): spans of 8 in chunks of 3
    (23 tokens: 8, 8, then 7), every forward_span call seen, then 16 greedy tokens as HF's."""
    path, ref_model = _write(tmp_path, "qwen3moe", "Q4_K")
    lm = load_model(path, device="cpu", dtype="f32")
    monkeypatch.setattr(type(lm.model), "streams_experts", property(lambda self: True))
    calls: list[tuple[int, int, int]] = []
    span = FamilyLM.forward_span

    def spy(self: FamilyLM, tokens: torch.Tensor, cache: object, start: int, chunk: int) -> torch.Tensor:
        calls.append((start, int(tokens.shape[0]), chunk))
        return span(self, tokens, cache, start, chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(FamilyLM, "forward_span", spy)
    runner = Runner(lm.model, lm.tokenizer, 128, "f32", prefill_chunk=3, prefill_span=8)
    req = GenerationRequest(PROMPT, max_tokens=16, sampling=GREEDY, ignore_eos=True)
    done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
    assert calls == [(0, 8, 3), (8, 8, 3), (16, 7, 3)]
    assert done.tokens == hf_greedy(ref_model, PROMPT, 16)


def test_runner_keeps_chunks_where_nothing_streams(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", seed=1)
    lm = load_model(path, device="cpu", dtype="f32")
    assert not lm.model.streams_experts  # a CPU model: no expert cache
    assert Runner(lm.model, lm.tokenizer, 64, "f32", prefill_chunk=4, prefill_span=16).prefill_span == 4


def test_span_tokens() -> None:
    c: ModelConfig = SimpleNamespace(n_embd=2048)  # type: ignore[assignment]  # span_tokens reads n_embd only
    per_token = int(1.5 * 4 * 2048)
    assert span_tokens(c, 512, 4096 * per_token, 8192) == 4096  # room for 4,096 rows
    assert span_tokens(c, 512, 4000 * per_token, 8192) == 3584  # a whole number of chunks
    assert span_tokens(c, 512, 100 * per_token, 8192) == 512  # no room: chunk by chunk
    assert span_tokens(c, 512, -5, 8192) == 512
    assert span_tokens(c, 512, 1 << 40, 6000) == 5632  # not past the context
    assert span_tokens(c, 512, 1 << 40, 1 << 20) == SPAN_MAX


LONG = [(i * 37 + 11) % 500 + 1 for i in range(80)]
# Chunks longer than a fused step's rows (FAST_MAX_ROWS, 16): chunks of up to 16 rows run the fused decode path,
# which reads missed experts from host RAM in place instead of staging them.
CHUNK = 20


@pytest.mark.gpu
def test_cuda_span_streams_each_layer_once_and_matches_transformers(tmp_path: Path) -> None:
    """On CUDA with 4 of 16 experts in VRAM: an 80-token prompt in chunks of 20 (grouped kernels, the missed
    experts staged from host RAM) read layer by layer stages each layer's experts once (chunk by chunk: 4 times),
    gives HF's last-row logits as the chunk-by-chunk reading does, and the Runner's span path HF's greedy tokens."""
    from engine.experts.policy import ExpertPolicy
    from engine.models.fast_decode import FAST_MAX_ROWS

    assert CHUNK > FAST_MAX_ROWS
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q4_K", types={"ffn_down": "Q6_K"}, seed=5)
    ref_model = hf_model(path)
    ref = hf_logits(ref_model, LONG)[-1]
    lm = load_model(path, device="cuda", dtype="f32", experts=ExpertPolicy(slots=4))
    m, ec = lm.model, lm.model.expert_cache
    assert m.streams_experts

    def moved() -> int:
        return sum(le.bytes_moved for le in ec.layers.values())

    per_staging = sum(
        sum(c < 0 for c in le.slot_of) * sum(p.expert_bytes for p in le.projections)
        for le in ec.layers.values()
    )
    cache = m.new_cache(128, "f32")
    before = moved()
    span = m.forward_span(torch.tensor(LONG), cache, 0, CHUNK)[0].cpu()
    assert moved() - before == per_staging
    cache = m.new_cache(128, "f32")
    before = moved()
    for s in range(0, len(LONG), CHUNK):
        chunked = m.forward(torch.tensor(LONG[s : s + CHUNK]), cache, s, last_only=True)[0].cpu()
    assert moved() - before == 4 * per_staging
    for ours in (span, chunked):
        cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=0).item()
        assert cos >= 0.9999, f"cosine {cos}"
    assert (span - chunked).abs().max().item() <= 1e-4

    runner = Runner(m, lm.tokenizer, 128, "f32", prefill_chunk=CHUNK, prefill_span=3 * CHUNK)
    assert runner.prefill_span == 3 * CHUNK
    req = GenerationRequest(LONG, max_tokens=16, sampling=GREEDY, ignore_eos=True)
    done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
    assert done.tokens == hf_greedy(ref_model, LONG, 16)
