"""Which steps attend through the flash prompt kernel, and with what: each family hands it the cache's own tensors
(int8 codes with their scales), its window and gpt-oss's sinks. The kernel's contract is played here by torch's
attention (the kernel itself is checked against torch in test_kernels_interpreter.py and on CUDA), so that the
dispatch runs on a CPU in CI: logits equal those of the torch path, and the kernel was called."""

from pathlib import Path

import pytest
import torch

from engine.layers.attention import FLASH_MIN_ROWS, attention, causal_mask, sink_attention
from engine.pipeline.loader import load_model
from engine.testing.tiny_families import write_tiny_family
from engine.testing.tiny_models import write_tiny_model


class TorchPrefill:
    """engine.kernels.prefill_attention's signature and results, computed by torch from the cache as it lies."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool, bool]] = []  # (rows, window, int8, sinks)

    def prefill_attention(self, q, k_cache, v_cache, pos, span, window, scale, softcap=0.0, k_scale=None,
                          v_scale=None, sinks=None):  # fmt: skip
        self.calls.append((q.shape[0], window, k_scale is not None, sinks is not None))
        keys, values = k_cache[:span].float(), v_cache[:span].float()
        if k_scale is not None:
            keys, values = keys * k_scale[:span].float(), values * v_scale[:span].float()
        mask = causal_mask(pos, span, window)
        if sinks is not None:
            return sink_attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, sinks)
        return attention(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, softcap)


def _logits(path: Path, kv: str, kernel: TorchPrefill | None) -> torch.Tensor:
    m = load_model(path, device="cpu", dtype="f32").model
    m.prefill_kernel = kernel
    ids = torch.randint(0, 200, (60,), generator=torch.Generator().manual_seed(1))
    cache = m.new_cache(72, kv)
    return torch.cat([m.forward(ids[s : s + 20], cache, s).float() for s in range(0, 60, 20)])


@pytest.mark.parametrize(
    ("arch", "kv"),
    [("qwen3", "f32"), ("qwen3", "int8"), ("gemma3", "f32"), ("gpt-oss", "f32"), ("qwen3next", "f32"),
     ("glm4moe", "int8")],
)  # fmt: skip
def test_families_take_the_kernel_for_prompt_chunks(tmp_path: Path, arch: str, kv: str) -> None:
    if arch in ("qwen3", "gemma3"):
        path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, seed=4)
    else:
        path = write_tiny_family(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0", seed=4)
    kernel = TorchPrefill()
    got, want = _logits(path, kv, kernel), _logits(path, kv, None)
    assert (got - want).abs().max().item() < 1e-4
    assert kernel.calls and all(rows > FLASH_MIN_ROWS for rows, *_ in kernel.calls)
    assert all(int8 == (kv == "int8") for _, _, int8, _ in kernel.calls)
    assert any(sinks for *_, sinks in kernel.calls) == (arch == "gpt-oss")
    if arch == "gemma3":  # its sliding layers pass their window
        assert {w for _, w, _, _ in kernel.calls} > {0}


def test_decode_sized_steps_keep_torch_and_masks(tmp_path: Path) -> None:
    """Steps of up to FLASH_MIN_ROWS rows do not take the prompt kernel, and get their masks made once a step."""
    path = write_tiny_model(tmp_path / "q.gguf", "qwen3", seed=4)
    m = load_model(path, device="cpu", dtype="f32").model
    kernel = TorchPrefill()
    m.prefill_kernel = kernel
    cache = m.new_cache(32, "f32")
    m.forward(torch.arange(1, FLASH_MIN_ROWS + 1), cache, 0)
    m.forward(torch.tensor([5]), cache, FLASH_MIN_ROWS)
    assert kernel.calls == []
    assert m.step_masks(torch.arange(4), 4) and m.step_masks(torch.arange(FLASH_MIN_ROWS + 1), 9) == {}
