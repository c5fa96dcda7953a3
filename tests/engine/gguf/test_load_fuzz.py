"""Mutants of a tiny MoE model through the whole load path (reader, metadata, tokenizer, chat template, weights):
each one loads cleanly or is refused with one of the loader's typed errors naming what is wrong, none takes over
10 s, and none raises the process's peak memory by 500 MB.

Mutations land where a hostile or damaged file does harm: in the metadata values and the tensor table (a byte, a
flipped bit, a 32- or 64-bit number among sizes that break arithmetic), and the file cut short. 3,000 mutants run
here (derandomized in CI by the "ci" hypothesis profile, so every run sees the same ones)."""

from __future__ import annotations

import resource
import time
from datetime import timedelta
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf.model_config import ModelConfigError
from engine.gguf.quants import UnsupportedQuantTypeError
from engine.gguf.reader import GGUFError
from engine.models.registry import UnsupportedArchitecture
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model
from engine.tokenizer.vocab import TokenizerError

LOAD_ERRORS = (
    GGUFError,
    ModelConfigError,
    TokenizerError,
    UnsupportedArchitecture,
    UnsupportedQuantTypeError,
)
"""What the loader raises for a bad file; the CLI and the server print each as one line."""


def _base(tmp: Path) -> tuple[bytes, list[int], list[tuple[int, int]], int]:
    path = write_tiny_model(tmp / "base.gguf", "qwen3moe", qtype="Q8_0", n_layer=2, seed=1)
    reader = gguf.GGUFReader(path)
    spots, values = set(), set()
    for f in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        # each part of a field or tensor entry in turn: key length, key, type, value / array length / dims ...
        at = f.offset
        for i, part in enumerate(f.parts[:8]):
            spots.add(at)
            if i >= 3 and part.nbytes in (
                1,
                2,
                4,
                8,
            ):  # past the key: a number (a value, a length, a dim, a type)
                values.add((at, part.nbytes))
            at += part.nbytes
    return path.read_bytes(), sorted(spots), sorted(values), int(reader.data_offset)


BASE, SPOTS, VALUES, DATA_OFFSET = _base(Path(__import__("tempfile").mkdtemp(prefix="strata-fuzz-")))
_BIG = [
    0,
    1,
    2,
    255,
    2**16,
    2**28,
    2**31 - 1,
    2**32 - 1,
    2**32,
    2**40,
    2**63,
    2**64 - 1,
    len(BASE),
    len(BASE) + 1,
]


class Mutant(bytes):
    """The mutated file; shown as what was changed (a failing example's repr stays short)."""

    what: str = ""

    def __repr__(self) -> str:
        return f"Mutant({self.what})"


@st.composite
def _mutants(draw: st.DrawFn) -> Mutant:
    data = bytearray(BASE)
    what = []
    for _ in range(draw(st.integers(1, 3))):  # a number of the header (a size, a count, a dim) set to another
        pos, size = draw(st.sampled_from(VALUES))
        value = draw(st.sampled_from(_BIG) | st.integers(0, 2 ** (8 * size) - 1)) % (1 << (8 * size))
        data[pos : pos + size] = value.to_bytes(size, "little")
        what.append(f"value {value} at {pos}")
    for _ in range(draw(st.integers(0, 1))):
        # where a part of a field or tensor entry starts (a length, a type, a value, a shape), or a little past it
        pos = min(
            draw(st.sampled_from(SPOTS)) + draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 7])), DATA_OFFSET - 1
        )
        kind = draw(st.sampled_from(["flip", "byte", "u32", "u64"]))
        if kind == "flip":
            value = 1 << draw(st.integers(0, 7))
            data[pos] ^= value
        elif kind == "byte":
            value = draw(st.integers(0, 255))
            data[pos] = value
        else:
            size = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(_BIG) | st.integers(0, 2**64 - 1)) % (1 << (8 * size))
            data[pos : pos + size] = value.to_bytes(size, "little")[: len(data) - pos]
        what.append(f"{kind} {value} at {pos}")
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(data)))
        data = data[:cut]
        what.append(f"cut at {cut}")
    out = Mutant(data)
    out.what = ", ".join(what)
    return out


@pytest.fixture(scope="module")
def mutant_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mutants") / "mutant.gguf"


OUTCOMES: dict[str, int] = {}


@settings(
    max_examples=3000,
    deadline=timedelta(seconds=10),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
@given(data=_mutants())
def test_every_mutant_loads_or_is_refused_cleanly(mutant_path: Path, data: Mutant) -> None:
    mutant_path.write_bytes(data)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    try:
        load_model(mutant_path, device="cpu")
        OUTCOMES["loaded"] = OUTCOMES.get("loaded", 0) + 1
    except LOAD_ERRORS as err:
        msg = str(err)
        assert msg and "\n" not in msg.strip(), msg
        OUTCOMES[type(err).__name__] = OUTCOMES.get(type(err).__name__, 0) + 1
    assert time.monotonic() - t0 < 10
    # the process's peak may not rise by 500 MB during one load (what a size read from the file would allocate)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 500, f"loading it raised the process's peak memory by {grown_mb:.0f} MB"


def test_the_mutants_reached_both_outcomes() -> None:
    """Runs after the fuzz test: the mutants were neither all refused nor all harmless."""
    if not OUTCOMES:
        pytest.skip("the fuzz test did not run in this session")
    print("mutant outcomes:", OUTCOMES)
    assert OUTCOMES.get("loaded", 0) > 0 and sum(OUTCOMES.values()) - OUTCOMES.get("loaded", 0) > 0, OUTCOMES
