"""Sizes read from metadata are checked before anything is sized from them: a file whose key_length says 2^28 or
2^32-1 (the RoPE table would take 2.3 GiB, 16 GiB) or 0 (a division by zero) is refused at once, with the key and
what is wrong, and the process does not grow; a tensor of a block type the engine does not read is a GGUFError
naming the tensor and what to do."""

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.gguf.model_config import ModelConfigError
from engine.gguf.reader import GGUFError
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model


def with_u32(path: Path, key: str, value: int) -> Path:
    """A copy of the model at `path` whose uint32 metadata `key` holds `value` (tensors unchanged)."""
    data = bytearray(path.read_bytes())
    at = data.find(key.encode())
    assert at > 0 and struct.unpack_from("<I", data, at + len(key))[0] == 4  # GGUF's uint32 value type
    struct.pack_into("<I", data, at + len(key) + 4, value)
    out = path.with_name(f"{path.stem}-{key.rsplit('.', 1)[-1]}-{value}.gguf")
    out.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "qwen3moe", seed=1, qtype="Q4_K")


@pytest.mark.parametrize("value", [0, 1 << 28, (1 << 32) - 1])
def test_a_hostile_key_length_is_refused_before_anything_is_allocated(tiny: Path, value: int) -> None:
    bad = with_u32(tiny, "qwen3moe.attention.key_length", value)
    with pytest.raises(ModelConfigError, match=f"qwen3moe.attention.key_length = {value} is outside 1..4096"):
        load_model(bad, device="cpu")


def test_the_refusal_is_fast_and_the_process_does_not_grow(tiny: Path) -> None:
    """In a process of its own: the peak RSS of refusing key_length 2^28 is that of loading the good file, not
    2.3 GiB more."""
    bad = with_u32(tiny, "qwen3moe.attention.key_length", 1 << 28)
    probe = textwrap.dedent(
        """
        import resource, sys, time
        from engine.pipeline.loader import load_model
        t = time.monotonic()
        try:
            load_model(sys.argv[1], device="cpu")
        except Exception as e:
            print(type(e).__name__)
        print(time.monotonic() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
        """
    )
    peaks = {}
    for name, path in (("good", tiny), ("bad", bad)):
        out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[3], check=True).stdout.split()  # fmt: skip
        peaks[name] = (float(out[-2]), int(out[-1]))
    assert peaks["bad"][0] < 1.0
    assert peaks["bad"][1] <= peaks["good"][1] + 50  # MiB


def test_an_unsupported_block_type_is_a_gguf_error_naming_the_tensor(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.models import family_base

    monkeypatch.setattr(family_base, "SUPPORTED_TYPES", frozenset())
    with pytest.raises(GGUFError) as got:
        load_model(tiny, device="cpu")
    assert "has block type" in str(got.value) and "use a file quantized to one of them" in str(got.value)
