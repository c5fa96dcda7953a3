"""The KV cache's side of --kv-resident that runs without a card: a host layer's span handed to the flash prompt
kernel is a copy of the positions below the span (read across PCIe once a chunk, not once per block of query rows),
and on the CPU every layer is plain host memory. On a card: tests/engine/test_kv_resident_gpu.py."""

from dataclasses import replace

import torch

from engine.layers import attention
from engine.layers.kv_cache import KVCache


class _Recorder:
    """Stands in for the flash prompt kernel: keeps what it was given."""

    def __init__(self) -> None:
        self.got: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prefill_attention(self, q, k, v, pos, span, *rest):  # type: ignore[no-untyped-def]
        self.got.append((k, v))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])


def test_a_host_layer_reaches_the_prompt_kernel_as_a_copy_of_its_span() -> None:
    cache = KVCache(range(2), 64, 2, 16, 16, "bf16", torch.device("cpu"))
    cache.layers[1] = replace(cache.layers[1], host=True)  # as a card's cache marks it
    kernel = _Recorder()
    q, k, v = torch.randn(12, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    pos = torch.arange(12)
    for layer in (0, 1):
        attention.cached_attention(cache, layer, q, k, v, pos, 12, 0, 0.25, kernel=kernel)
    (k0, _), (k1, v1) = kernel.got
    assert k0.data_ptr() == cache.layers[0].k.data_ptr() and k0.shape[0] == 64  # in place
    assert k1.shape[0] == 12 and k1.data_ptr() != cache.layers[1].k.data_ptr()  # a copy of the span
    assert torch.equal(k1, k.to(torch.bfloat16)) and torch.equal(v1, v.to(torch.bfloat16))


def test_on_the_cpu_every_layer_is_plain_host_memory() -> None:
    cache = KVCache(range(2), 64, 2, 64, 64, "int8", torch.device("cpu"), host_layers={1})
    assert cache.host_layers == [] and cache.layers[1].in_vram(8) is cache.layers[1]
    assert [lk.host for lk in cache.split(2)[0].layers.values()] == [False, False]
