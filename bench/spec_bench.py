"""Decode tok/s with and without verify windows (`--spec N`) on a code-edit prompt (a file sent back with a rename)
and on prose, with the drafts' acceptance rates; greedy, through `Runner` as the server runs it.

    python bench/spec_bench.py --model M.gguf [--device cuda] [--spec 4] [--max-tokens 256] [--rounds 2]
                               [--layer-split K [--pipeline-windows 2]] [--out bench/results/spec-....json]
    python bench/spec_bench.py --tiny qwen3moe --device cpu     # a tiny random model written on the fly
    python bench/spec_bench.py --tiny glm4moe --device cpu      # with a draft (nextn) layer

Arms, each per prompt and measured in interleaved rounds after a warm-up (CUDA graphs are captured there):
- `spec0`: one token per forward;
- `lookup`: `--spec N` with drafts copied from earlier context (prompt lookup) only;
- `mtp` and `auto` (models with a draft layer, e.g. glm4moe): drafts from the model's draft layer only
  (`--suffix-draft 0`), and from both sources (the default, what a user gets);
- `right`: `--spec N` with drafts that are always right (the spec0 answer): the ceiling of the window machinery;
- `wrong`: `--spec N` with drafts that are always wrong: what a window costs when nothing is kept.
On a model with random weights (the ../shared/bench writer, the tiny models) the answer is not a copy of the file,
so `lookup` accepts little; `right` and `wrong` bound what a real model's acceptance can give. Every arm's greedy
tokens are checked against spec0's. The JSON holds tok/s (best round), acceptance, windows and the ratios."""

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import emit
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.mtp import draft_layer_of
from engine.pipeline.sampling import GREEDY, Sampler
from engine.pipeline.spec import Draft, DraftSource, SpecConfig

_SOURCE = '''import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("inventory")


@dataclass
class Item:
    name: str
    count: int
    price: float

    def total(self) -> float:
        return self.count * self.price


def load_config(path: Path) -> dict:
    """Read the inventory settings; a missing file gives the defaults."""
    if not path.exists():
        log.warning("no config at %s, using defaults", path)
        return {"currency": "EUR", "warn_below": 3}
    with path.open() as f:
        return json.load(f)


def parse_items(rows: list[dict]) -> list[Item]:
    items = []
    for row in rows:
        items.append(Item(row["name"], int(row["count"]), float(row["price"])))
    return items


def low_stock(items: list[Item], config: dict) -> list[Item]:
    limit = config.get("warn_below", 3)
    return [item for item in items if item.count < limit]


def report(items: list[Item], config: dict) -> str:
    currency = config.get("currency", "EUR")
    lines = [f"{item.name}: {item.count} x {item.price:.2f} {currency}" for item in items]
    lines.append(f"total: {sum(item.total() for item in items):.2f} {currency}")
    for item in low_stock(items, config):
        lines.append(f"low stock: {item.name}")
    return "\\n".join(lines)


def main(path: Path, rows: list[dict]) -> None:
    config = load_config(path)
    print(report(parse_items(rows), config))
'''

PROMPTS = {
    "code_edit": (
        "Here is a Python file:\n```python\n" + _SOURCE + "```\n\n"
        "The same file, unchanged except that `load_config` is renamed to `read_settings` everywhere:\n"
        "```python\n"
    ),
    "prose": (
        "The lighthouse keeper had lived on the island for thirty years. Every evening she climbed the spiral "
        "stairs, trimmed the wick and watched the ships pass along the coast. One autumn night a storm came in "
        "from the west, stronger than any she remembered, and"
    ),
}


class _Scripted:
    """Drafts read off a known answer: all right, or all wrong (each token + 1)."""

    def __init__(self, truth: Sequence[int], vocab: int, wrong: bool) -> None:
        self.truth, self.vocab, self.wrong, self.committed = list(truth), vocab, wrong, 0

    def reset(self, tokens: Sequence[int]) -> None:
        self.committed = len(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        self.committed += len(tokens)

    def propose(self, pending: Sequence[int], n: int) -> Draft:
        s = self.committed + len(pending)
        out = self.truth[s : s + n]
        return Draft([(t + 1) % self.vocab for t in out] if self.wrong else out)


def _load(a: argparse.Namespace) -> object:
    from engine.link.startup import load_split_model
    from engine.pipeline.split import SplitOptions

    path = a.model
    if a.tiny:
        from engine.testing.tiny_families import FAMILIES, write_tiny_family
        from engine.testing.tiny_models import write_tiny_model

        out = Path(tempfile.mkdtemp()) / f"{a.tiny}.gguf"
        if a.tiny in FAMILIES:
            path = write_tiny_family(out, a.tiny, qtype="Q8_0", num_hidden_layers=4)
        else:
            path = write_tiny_model(out, a.tiny, qtype="Q8_0", n_layer=4)
    split = (int(a.layer_split),) if a.layer_split else None
    opts = SplitOptions(
        device=a.device,
        layer_split=split,
        split_device=tuple(a.split_device.split(",")) if a.split_device else (),
    )
    return load_split_model(path, opts, a.max_context, a.kv, a.dtype)


_RUNNERS: dict[str, Runner] = {}


def _run(
    lm: object, prompt: list[int], a: argparse.Namespace, spec: SpecConfig,
    drafts: Callable[[Sampler], DraftSource | None] | None, arm: str = "spec0",
) -> DoneEvent:  # fmt: skip
    """One generation with the arm's own Runner, kept across the warm-up and the rounds: its KV cache, and so the
    CUDA graphs captured for it, live on (a new Runner per run would capture them again inside the timing)."""
    runner = _RUNNERS.get(arm)
    if runner is None:
        runner = Runner(lm.model, lm.tokenizer, a.max_context, a.kv_resolved, 512, spec=spec, drafts=drafts)  # type: ignore[attr-defined]
        _RUNNERS[arm] = runner
    elif drafts is not None:
        runner.drafts = drafts  # the scripted arms know this prompt's answer
    req = GenerationRequest(
        prompt, max_tokens=a.max_tokens, sampling=GREEDY, ignore_eos=True, cache_prompt=False
    )
    done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)]
    return done[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="GGUF file")
    src.add_argument(
        "--tiny", help="write a tiny random model of this architecture (e.g. qwen3moe) and use it"
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv", default="auto")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--spec", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layer-split", help="K: a 2-stage split (layers 0..K-1, K..)")
    ap.add_argument("--split-device", help="the later stage's device (card number or cpu)")
    ap.add_argument("--pipeline-windows", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    ap.add_argument("--prompts", default=",".join(PROMPTS), help=f"some of {', '.join(PROMPTS)}")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from engine.layers.kv_cache import resolve_kv_type

    t0 = time.perf_counter()
    lm = _load(a)
    a.kv_resolved = resolve_kv_type(a.kv, lm.model.dtype)  # type: ignore[attr-defined]
    vocab = int(lm.config.n_vocab)  # type: ignore[attr-defined]
    res: dict = {
        "model": f"tiny-{a.tiny}" if a.tiny else Path(a.model).name,
        "device": str(lm.model.device),  # type: ignore[attr-defined]
        "dtype": str(lm.model.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
        "stages": len(getattr(lm.model, "stages", [None])),  # type: ignore[attr-defined]
        "layer_split": a.layer_split,
        "pipeline_windows": a.pipeline_windows,
        "spec": a.spec,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "torch_threads": torch.get_num_threads(),
        "load_s": round(time.perf_counter() - t0, 2),
        "prompts": {},
    }
    if torch.cuda.is_available() and lm.model.device.type == "cuda":  # type: ignore[attr-defined]
        res["gpu"] = torch.cuda.get_device_name(lm.model.device)  # type: ignore[attr-defined]
    spec = SpecConfig(n=a.spec, pipeline_windows=a.pipeline_windows)
    has_layer = draft_layer_of(lm.model) is not None  # type: ignore[attr-defined]
    res["draft_layer"] = has_layer
    for name in [p for p in a.prompts.split(",") if p]:
        ids = lm.tokenizer.encode(PROMPTS[name], add_special=True, parse_special=False)  # type: ignore[attr-defined]
        ref = _run(lm, ids, a, SpecConfig(), None)  # warm-up, and the answer the scripted drafts know
        truth = ids + ref.tokens
        arms: dict[str, tuple[SpecConfig, Callable[[Sampler], DraftSource | None] | None]] = {
            "spec0": (SpecConfig(), None),
            "lookup": (replace(spec, draft_layer=False), None),
            "right": (spec, lambda s, t=truth: _Scripted(t, vocab, False)),
            "wrong": (spec, lambda s, t=truth: _Scripted(t, vocab, True)),
        }
        if has_layer:
            arms["mtp"] = (replace(spec, suffix=False), None)
            arms["auto"] = (spec, None)
        for arm, (cfg, drafts) in arms.items():  # warm-up: windows of every size met once (graph captures)
            _run(lm, ids, a, cfg, drafts, arm)
        best: dict[str, dict] = {}
        for _ in range(a.rounds):
            for arm, (cfg, drafts) in arms.items():
                done = _run(lm, ids, a, cfg, drafts, arm)
                t = done.timings
                row = {
                    "decode_tok_s": round(t.generated_per_second, 3),
                    "generated": t.generated_tokens,
                    "windows": t.decode_windows,
                    "drafts_proposed": t.drafts_proposed,
                    "drafts_accepted": t.drafts_accepted,
                    "acceptance": round(t.draft_acceptance, 4),
                    "tokens_per_window": round(t.generated_tokens / max(1, t.decode_windows + 1), 3),
                    "guessed_windows": t.guessed_windows,
                    "guessed_kept": t.guessed_kept,
                    "same_tokens_as_spec0": done.tokens == ref.tokens,
                }
                if arm not in best or row["decode_tok_s"] > best[arm]["decode_tok_s"]:
                    best[arm] = row
        base = best["spec0"]["decode_tok_s"]
        for arm in [k for k in arms if k != "spec0"]:
            best[arm]["ratio_to_spec0"] = round(best[arm]["decode_tok_s"] / base, 3) if base else None
        res["prompts"][name] = {"prompt_tokens": len(ids), **best}
        arms_text = ", ".join(
            f"{arm} {best[arm]['decode_tok_s']:.1f} ({best[arm]['acceptance']:.0%})"
            for arm in arms
            if arm != "spec0"
        )
        print(f"{name}: spec0 {base:.1f} tok/s; --spec {a.spec} (acceptance): {arms_text}", file=sys.stderr)
    emit(res, a.out)


if __name__ == "__main__":
    main()
