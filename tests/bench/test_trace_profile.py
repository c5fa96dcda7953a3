"""bench/trace_profile.py: a generated trace's second half becomes a usage profile the engine reads for its model
file (the profile `serve --profile` fills the cache from while it replays that trace); a second run replaces the
file instead of adding to it."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from engine.experts.profile import load_profile, profile_location
from engine.experts.trace import save_trace, usage_counts
from engine.experts.trace_gen import generate, preset
from engine.gguf.reader import GGUFFile
from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_a_traces_second_half_becomes_the_models_profile(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf", "qwen3moe")
    trace = generate(64, 2, 8, 2, preset("realistic"), seed=1)
    save_trace(tmp_path / "t.npz", trace)
    out = tmp_path / "p.json"
    cmd = [sys.executable, str(ROOT / "bench" / "trace_profile.py"), "--model", str(model), "--trace",
           str(tmp_path / "t.npz"), "--out", str(out)]  # fmt: skip
    for _ in range(2):  # the second run replaces the first's file
        subprocess.run(cmd, check=True, capture_output=True)
    lm = load_model(model, device="cpu", dtype="f32")
    path, ident = profile_location(GGUFFile.open(str(model)), lm.model.cfg, out)
    prof = load_profile(path, ident)
    assert prof is not None and prof.tokens == 32
    assert np.array_equal(prof.counts, usage_counts(trace, 2, 32))
