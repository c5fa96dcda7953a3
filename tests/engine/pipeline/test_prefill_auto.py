"""`--prefill auto`: on a CPU 512-token chunks; on a GPU the largest chunk whose temporaries fit in the VRAM left
once the KV cache and the reserve are counted (a 4,096-token chunk read a prompt twice as fast as 512-token ones on
an H200, bench/results/ours_full.json)."""

from engine.gguf.model_config import ModelConfig, RopeConfig
from engine.pipeline.prefill import auto_chunk, chunk_bytes

MiB = 1 << 20


def _a3b() -> ModelConfig:  # Qwen3-30B-A3B's geometry
    return ModelConfig(
        arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim_k=128, head_dim_v=128,
        n_ff=6144, n_vocab=151936, n_ctx_train=40960, rms_eps=1e-6, rope=RopeConfig(dim=128, base=1e6, neox=True),
        attn_scale=128**-0.5, n_expert=128, n_expert_used=8, n_ff_exp=768,
    )  # fmt: skip


def _cuda_model(monkeypatch, allocated: int, reserved: int, free: int | None = None) -> object:
    """What device_chunk reads of a loaded one-card model, with the device's memory queries faked (bytes)."""
    import torch

    class Model:
        device = torch.device("cuda", 0)
        cfg = _a3b()
        layer_range = range(48)

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: reserved)
    if free is not None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free, 80 << 30))
    return Model()


def test_temporaries_grow_with_the_chunk() -> None:
    c = _a3b()
    small, large = chunk_bytes(c, 512, 4096), chunk_bytes(c, 4096, 4096)
    assert 100 * MiB < small < large < 1500 * MiB  # a 4,096-token chunk of this model: ~1 GB with slack


def test_flash_attention_holds_no_repeated_keys() -> None:
    """Where the flash kernel reads the cache in place, a long context adds nothing to a chunk's temporaries: a
    4,096-token chunk fits beside a 131,072-position context in the room it needs at 4,096 positions."""
    c = _a3b()
    assert chunk_bytes(c, 4096, 131072, flash=True) == chunk_bytes(c, 4096, 4096, flash=True)
    assert chunk_bytes(c, 4096, 131072) - chunk_bytes(c, 4096, 131072, flash=True) > 2 << 30
    room = dict(free_bytes=4 << 30, kv_bytes=0, reserve_bytes=512 * MiB, max_ctx=131072)
    assert auto_chunk(c, cuda=True, flash=True, **room) == 4096
    assert auto_chunk(c, cuda=True, **room) < 4096


def test_the_largest_chunk_that_fits() -> None:
    c = _a3b()
    assert auto_chunk(c, cuda=False, free_bytes=10**12, kv_bytes=0, reserve_bytes=0) == 512
    assert auto_chunk(c, cuda=True, free_bytes=80 << 30, kv_bytes=400 * MiB, reserve_bytes=512 * MiB) == 4096
    # a small card whose experts filled it: only the workspace left
    got = auto_chunk(c, cuda=True, free_bytes=1300 * MiB, kv_bytes=0, reserve_bytes=512 * MiB, max_ctx=4096)
    assert 512 <= got < 4096
    assert chunk_bytes(c, got, 4096) <= 1300 * MiB - 512 * MiB or got == 512
    # nothing to spare: never below 512
    assert auto_chunk(c, cuda=True, free_bytes=100 * MiB, kv_bytes=0, reserve_bytes=512 * MiB) == 512
    # the KV cache still to come is counted
    assert auto_chunk(c, cuda=True, free_bytes=3 << 30, kv_bytes=3 << 30, reserve_bytes=0) == 512


def test_no_chunk_longer_than_the_context_needs() -> None:
    """A prompt is at most --max-context tokens: a longer chunk's temporaries would be kept for nothing (a server
    at --max-context 2048 had chosen 4,096-token chunks, ~940 MiB, and built their kernels at load)."""
    c = _a3b()
    room = dict(free_bytes=80 << 30, kv_bytes=0, reserve_bytes=0)
    assert auto_chunk(c, cuda=True, max_ctx=2048, **room) == 2048
    assert auto_chunk(c, cuda=True, max_ctx=1000, **room) == 1024  # one chunk still holds the longest prompt
    assert auto_chunk(c, cuda=True, max_ctx=300, **room) == 512
    assert auto_chunk(c, cuda=True, max_ctx=131072, **room) == 4096


def test_every_slots_kv_cache_is_counted(monkeypatch) -> None:
    """A server of several slots allocates each one's KV cache after the chunk is chosen: the chunk gets what all
    of them leave, not what one leaves (8 slots of 2,048 positions of Qwen3-30B-A3B take 1.5 GiB, one 192 MiB:
    counting one let a chunk's temporaries into the room of the other seven and of the reserve)."""
    from engine.pipeline.prefill import device_chunk
    from engine.pipeline.split import prefill_chunk

    m = _cuda_model(monkeypatch, allocated=4 << 30, reserved=4 << 30)
    budget = 4 * 1024 + 2400  # 2,400 MiB left before the KV caches
    assert device_chunk(m, 2048, "bf16", budget, 512) == 2048  # one slot's KV: room for the longest
    got = prefill_chunk(m, "auto", max_ctx=2048, kv_type="bf16", budget_mib=budget, reserve_mib=512, slots=8)
    assert got == 1024 and chunk_bytes(_a3b(), got, 2048) <= (2400 - 1536 - 512) * MiB
    assert device_chunk(m, 2048, "bf16", budget, 512, slots=16) == 512  # the KV leaves no room: the least


def test_a_cpu_model_reads_512_token_chunks(tmp_path) -> None:
    from engine.pipeline.loader import load_model
    from engine.pipeline.split import prefill_chunk
    from engine.testing.tiny_models import write_tiny_model

    m = load_model(str(write_tiny_model(tmp_path / "t.gguf", "qwen3moe", qtype="Q8_0")), device="cpu").model
    assert prefill_chunk(m, "auto", max_ctx=256) == 512
    assert prefill_chunk(m, "96", max_ctx=256) == 96


def test_a_gpu_models_chunk_from_the_free_vram(monkeypatch) -> None:
    """device_chunk's GPU branch with the device queries faked: free VRAM, or what a --vram-budget-mib leaves."""
    from engine.pipeline.prefill import device_chunk

    m = _cuda_model(monkeypatch, allocated=5 << 30, reserved=5 << 30, free=40 << 30)
    assert device_chunk(m, 4096, "bf16", None, 512) == 4096
    assert device_chunk(m, 4096, "bf16", 5 * 1024 + 900, 512) == 512  # a budget with ~900 MiB left
    assert device_chunk(object(), 4096, "bf16", None, 512) == 512  # not a CUDA model


def test_cached_blocks_count_as_room(monkeypatch) -> None:
    """What the allocator holds cached but not allocated (loading's temporaries) is room for the chunk too: the
    measured case, an H200 held to llama.cpp -ncmoe 36's VRAM at a 32K context, had ~650 MiB of it."""
    from engine.pipeline.prefill import device_chunk

    m = _cuda_model(monkeypatch, allocated=4 << 30, reserved=5 << 30, free=1 << 30)
    budget = 5 * 1024 + 900  # ~900 MiB beyond what is reserved, 1,924 beyond what is allocated
    assert device_chunk(m, 4096, "bf16", budget, 512) > 512
    assert device_chunk(m, 4096, "bf16", None, 512) > 512  # 1 GiB free on the card, 1 GiB cached


def test_a_card_that_streams_experts_keeps_room_for_a_span(monkeypatch) -> None:
    """The measured case (an H200 held to llama.cpp -ncmoe 36's 6,111 MiB, Qwen3-30B-A3B): 757 MiB left before a
    4,104-token KV cache once the experts' staging area (not yet allocated) is counted. Chunk by chunk the largest
    chunk is 1,024 tokens; a card that streams experts keeps room for a 4,096-token span's rows first and reads
    512-token chunks layer by layer (each layer's experts cross PCIe once for the 4,096, not four times)."""
    import torch

    from engine.pipeline.prefill import device_chunk, device_span

    class Cache:
        pending_bytes = 340 * MiB

    class Model:
        device = torch.device("cuda", 0)
        cfg = _a3b()
        layer_range = range(48)
        expert_cache = Cache()
        layer_major = True
        streams_experts = False

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 4826 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 4826 * MiB)
    budget = 4826 + 757 + 340
    m = Model()
    assert device_chunk(m, 4104, "bf16", budget, 0) == 1024
    assert device_span(m, 1024, 4104, "bf16", budget, 0) == 1024  # nothing streams: chunk by chunk
    m.streams_experts = True
    chunk = device_chunk(m, 4104, "bf16", budget, 0)
    assert chunk == 512
    assert device_span(m, chunk, 4104, "bf16", budget, 0) == 4096
    Cache.pending_bytes = 0  # the area allocated: the same room is counted once, not twice
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: (4826 + 340) * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: (4826 + 340) * MiB)
    assert device_chunk(m, 4104, "bf16", budget, 0) == 512
