"""The KV of some layers in page-locked host RAM (--kv-resident) on a card: the same kernels read and write it in
place across PCIe, so greedy tokens equal those with every layer's KV in VRAM (one sequence, slots decoded
together, bf16, int8 and q4_0 caches), prompt chunks included (their attention reads a host layer's span from a
copy in VRAM), and --kv-resident auto moves KV there only where it does not fit the card."""

import logging
from pathlib import Path

import pytest
import torch

from engine.layers.kv_cache import KVCache
from engine.layers.pinned import host_tensors
from engine.link.startup import load_split_model
from engine.pipeline.batch import BatchRunner
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.sampling import GREEDY
from engine.pipeline.split import SplitOptions, geometry_from_gguf

pytestmark = pytest.mark.gpu
PROMPT = torch.randint(3, 400, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def test_host_tensors_are_cuda_tensors_in_host_ram() -> None:
    dev = torch.device("cuda")
    before = torch.cuda.memory_allocated(dev)
    k, s = host_tensors([((4096, 4, 128), torch.bfloat16), ((4096, 4, 1), torch.float16)], dev)
    assert k.is_cuda and s.is_cuda and torch.cuda.memory_allocated(dev) == before  # not the card's memory
    assert not k.any() and not s.any()
    x = torch.randn(7, 4, 128, device=dev, dtype=torch.bfloat16)
    k.index_copy_(0, torch.arange(100, 107, device=dev), x)
    assert torch.equal(k[100:107], x) and torch.equal(k[100:107].cpu(), x.cpu())
    cache = KVCache(range(3), 256, 4, 128, 128, "int8", dev, host_layers={1})
    assert cache.host_layers == [1] and list(cache.layers) == [0, 1, 2]
    assert all(lk.k.is_cuda and lk.k_scale is not None for lk in cache.layers.values())
    half = cache.split(2)[1]  # a slot's rows keep their layer's place
    assert half.host_layers == [1] and half.layers[1].k.data_ptr() == cache.layers[1].k[128].data_ptr()
    copy = half.layers[1].in_vram(5)  # a prompt chunk's copy: on the card
    assert copy.k.shape[0] == 5 and not copy.host and torch.cuda.memory_allocated(dev) > before


def _load(path: Path, kv: str, resident: int | None, **kw: object):  # type: ignore[no-untyped-def]
    opts = SplitOptions(device="cuda", kv_resident=resident, **kw)  # type: ignore[arg-type]
    return load_split_model(path, opts, max_context=512, kv=kv, parallel=4)


@pytest.mark.parametrize("kv", ["bf16", "int8", "q4_0"])
def test_greedy_tokens_with_the_kv_in_host_ram_equal_those_with_it_in_vram(moe_q4k: Path, kv: str) -> None:
    runs = []
    for resident in (None, 0):
        lm = _load(moe_q4k, kv, resident)
        m = lm.model
        assert m.kv_host_layers == (frozenset(m.layer_range) if resident == 0 else frozenset())
        runner = Runner(m, lm.tokenizer, 512, kv, prefill_chunk=64)
        req = GenerationRequest(PROMPT, max_tokens=24, sampling=GREEDY, ignore_eos=True)
        done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
        assert runner.cache.host_layers == sorted(m.kv_host_layers)
        reqs = [GenerationRequest(PROMPT[: 20 + 9 * i], max_tokens=12, sampling=GREEDY, ignore_eos=True)
                for i in range(4)]  # fmt: skip
        br = BatchRunner(m, lm.tokenizer, 512, kv, slots=4)
        got: list[list[object]] = [[] for _ in reqs]
        for r, g in zip(reqs, got, strict=True):
            br.admit(r, g.append)
        while br.busy:
            br.step()
        runs.append((done.tokens, [g[-1].tokens for g in got]))  # type: ignore[attr-defined]
        del lm, m, runner, br
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


def test_auto_moves_kv_to_host_ram_only_where_it_does_not_fit(moe_q4k: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    from engine.gguf.reader import GGUFFile
    from engine.models.registry import file_config
    from engine.tokenizer import Tokenizer

    gf = GGUFFile.open(moe_q4k)
    cfg = file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)
    per = sum(geometry_from_gguf(gf, cfg, "bf16").kv_bytes_per_token)
    context = (2 << 30) // per // 1024 * 1024  # 2 GiB of KV for one slot
    caplog.set_level(logging.INFO, logger="strata.engine")
    lm = load_split_model(moe_q4k, SplitOptions(device="cuda", vram_budget_mib=2048), max_context=context,
                          kv="bf16", parallel=1)  # fmt: skip
    assert lm.model.kv_host_layers, caplog.text
    assert "--kv-resident" in caplog.text and "host RAM" in caplog.text
    room = torch.cuda.memory_allocated()
    cache = lm.model.new_cache(context, "bf16")
    assert torch.cuda.memory_allocated() - room < 1 << 30  # the host layers' KV is not on the card
    assert cache.host_layers == sorted(lm.model.kv_host_layers)
    caplog.clear()
    small = load_split_model(moe_q4k, SplitOptions(device="cuda", vram_budget_mib=2048), max_context=4096,
                             kv="bf16", parallel=1)  # fmt: skip
    assert not small.model.kv_host_layers and "--kv-resident" not in caplog.text
