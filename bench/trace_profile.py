"""A usage profile made from a routing trace, for `strata-engine serve --profile P` while the server replays that
trace (STRATA_ROUTE_TRACE): the counts of the trace's second half, as engine_bench's --profile-from-trace fills its
cache (a profile recorded earlier on like text; the run replays from the trace's start).

    python bench/trace_profile.py --model M --trace T.npz --out profile.json
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.experts.profile import ModelIdentity, UsageProfile, save_profile
from engine.experts.trace import load_trace, usage_counts
from engine.gguf.digest import header_digest
from engine.gguf.reader import GGUFFile


def trace_profile(model: str | Path, trace: str | Path) -> UsageProfile:
    gf = GGUFFile.open(str(model))
    arch = gf.architecture
    n_layer, n_expert = int(gf.get(f"{arch}.block_count")), int(gf.get(f"{arch}.expert_count"))
    t = load_trace(trace)
    half = t.tokens // 2
    return UsageProfile(ModelIdentity(arch, n_layer, n_expert, header_digest(gf)), usage_counts(t, n_layer, half),
                        t.tokens - half)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.out).unlink(missing_ok=True)  # a new profile, not added to an older one (save_profile adds)
    prof = save_profile(a.out, trace_profile(a.model, a.trace))
    print(f"{a.out}: {prof.summary()}")


if __name__ == "__main__":
    main()
