"""bench/retype_experts.py: the routed experts of a tiny qwen3moe become another block type, everything else is
copied byte for byte with the metadata, and our engine loads the copy and decodes on the CPU."""

import importlib.util
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("retype_experts", ROOT / "bench" / "retype_experts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("qtype", [QT.IQ4_XS, QT.Q8_0])
def test_experts_take_the_type_and_the_rest_is_copied(tmp_path: Path, qtype: QT) -> None:
    src = write_tiny_model(tmp_path / "src.gguf", "qwen3moe", qtype="Q4_K", seed=2, n_embd=256, n_ff_exp=256)
    dst = tmp_path / "dst.gguf"
    assert _script().retype(src, dst, qtype) == 3 * 2  # gate, up, down of each of the two layers
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert list(ta.shape) == list(tb.shape), ta.name
        if "_exps." in ta.name:
            assert tb.tensor_type == qtype
        else:
            assert tb.tensor_type == ta.tensor_type and np.array_equal(ta.data, tb.data), ta.name
    keys = {k for k in a.fields if not k.startswith("GGUF.")}
    assert keys == {k for k in b.fields if not k.startswith("GGUF.")}
    assert b.fields["qwen3moe.expert_count"].contents() == a.fields["qwen3moe.expert_count"].contents()
    lm = load_model(dst, device="cpu")
    ids = lm.tokenizer.encode("hello there")
    logits = lm.model.forward(torch.tensor(ids), lm.model.new_cache(64, "bf16"), 0)
    assert torch.isfinite(logits).all()
