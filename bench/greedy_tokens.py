"""Greedy tokens of every tiny test model (engine.testing's architectures and families, several block types,
float32 and bf16) on the CPU, as JSON, to compare two trees of the engine token for token:

    python bench/greedy_tokens.py --write DIR                   # the models, written once by this tree
    python bench/greedy_tokens.py --models DIR --out new.json   # run from each tree's root (an older tree too)
"""

import argparse
import glob
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")  # the tree whose engine runs is the working directory's

PROMPT = [1, 17, 42, 99, 150, 7, 300, 12, 5, 64, 128, 256, 33, 71, 200, 11, 90, 45, 13, 180]


def write(folder: Path) -> None:
    from engine.testing.tiny_families import FAMILIES, write_tiny_family
    from engine.testing.tiny_models import ARCHITECTURES, write_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    for arch in ARCHITECTURES:
        for qtype in ("F32", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
            write_tiny_model(folder / f"{arch}-{qtype}.gguf", arch, qtype=qtype, seed=3)
    for family in FAMILIES:
        for qtype in ("Q8_0", "Q4_K"):
            write_tiny_family(folder / f"{family}-{qtype}.gguf", family, qtype=qtype, seed=3)


def run(folder: Path, n: int) -> dict[str, list[int]]:
    try:
        from engine.pipeline.loader import load_model
    except ImportError:  # trees before engine/pipeline/loader.py
        from engine.loader import load_model  # type: ignore[no-redef]
    from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
    from engine.pipeline.sampling import GREEDY

    out = {}
    for path in sorted(glob.glob(str(folder / "*.gguf"))):
        for dtype in ("f32", "bf16"):
            lm = load_model(path, device="cpu", dtype=dtype)
            runner = Runner(lm.model, lm.tokenizer, 256, dtype)
            req = GenerationRequest(PROMPT, max_tokens=n, sampling=GREEDY, ignore_eos=True)
            done = next(e for e in runner.generate(req) if isinstance(e, DoneEvent))
            out[f"{Path(path).name}:{dtype}"] = done.tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, help="write the tiny models into this folder")
    ap.add_argument("--models", type=Path, help="run every model in this folder")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.write:
        write(a.write)
    if a.models:
        tokens = run(a.models, a.tokens)
        text = json.dumps(tokens)
        if a.out:
            a.out.write_text(text)
        print(f"{len(tokens)} runs")


if __name__ == "__main__":
    main()
