"""What a quantized KV cache costs in accuracy deep into a context: logits against a bf16 cache's, as JSON.

    python bench/kv_quality.py --model M.gguf [--depth 32768] [--kv-types int8,q4_0] [--steps 16]
        [--device cuda|cpu] [--text docs/*.md] [--out bench/results/kv-quality.json]

One model on the GPU (or the CPU); for the reference type (bf16 on a card, f32 on the CPU) and each KV type a cache is
filled with the same `depth` prompt tokens (chunks of --prefill auto's size on a card, as the server reads them),
then `steps` greedy steps follow the reference's tokens (so every type sees the same inputs). The prompt: fixed
token ids, or with --text the files' text through the model's tokenizer (repeated to `depth`; a real model's
attention on real text is what a KV type's rounding must survive), and every type then follows the text itself,
scoring a perplexity over the `steps` tokens after `depth`. Reported per type: the cosine of each step's logits with
the reference's (min, mean), the mean KL divergence from the reference's, how often its top token is the
reference's, the perplexity (with --text), and the KV bytes a position costs."""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_bench import prompt_ids, read_prompt
from bench.report import emit
from engine.experts.policy import ExpertPolicy
from engine.layers.kv_cache import kv_bytes_per_token
from engine.pipeline.loader import load_model
from engine.pipeline.prefill import device_chunk


def run(model, kv: str, ids: torch.Tensor, chunk: int, follow: list[int] | None, steps: int) -> tuple:
    """Fill a `kv` cache with ids, then `steps` steps (feeding `follow`'s tokens, or its own greedy ones) -> the
    steps' logits [steps, V] on the host, and the tokens fed."""
    depth = int(ids.shape[0])
    cache = model.new_cache(depth + steps + 8, kv)
    with torch.inference_mode():
        read_prompt(model, ids[:-1], cache, chunk)
    tok, p, out, fed = ids[-1:], depth - 1, [], []
    for i in range(steps):
        with torch.inference_mode():
            logits = model.forward(tok, cache, p)[-1].float()
        out.append(logits.cpu())
        fed.append(int(tok))
        nxt = follow[i + 1] if follow is not None and i + 1 < len(follow) else int(logits.argmax())
        tok, p = torch.tensor([nxt]), p + 1
    del cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return torch.stack(out), fed


def perplexity(logits: torch.Tensor, follow: list[int]) -> float:
    """exp of the mean negative log-likelihood of follow[1:] under the steps' logits (step i predicts follow[i+1])."""
    n = min(logits.shape[0], len(follow) - 1)
    nll = -logits[:n].double().log_softmax(1)[torch.arange(n), torch.tensor(follow[1 : n + 1])]
    return round(float(nll.mean().exp()), 4)


def text_ids(tokenizer, files: list[str], n: int) -> torch.Tensor:
    """The files' text as token ids, repeated to n."""
    ids: list[int] = []
    for f in files:
        ids += tokenizer.encode(Path(f).read_text(encoding="utf-8"))
    if not ids:
        raise SystemExit(f"--text {' '.join(files)}: no text")
    return torch.tensor((ids * (n // len(ids) + 1))[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=32768)
    ap.add_argument("--kv-types", default="int8,q4_0")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--text", nargs="+", help="text files read as the prompt (default: fixed token ids)")
    ap.add_argument("--chunk", type=int, default=512, help="prompt chunk on the CPU")
    ap.add_argument("--out")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    lm = load_model(a.model, device=a.device, dtype="bf16" if cuda else "f32")
    m = lm.model
    ref_kv = "bf16" if cuda else "f32"
    chunk = (
        device_chunk(m, a.depth + a.steps + 8, ref_kv, None, ExpertPolicy.reserve_mib) if cuda else a.chunk
    )
    ids = text_ids(lm.tokenizer, a.text, a.depth + a.steps) if a.text else prompt_ids(a.depth)
    # on text every type follows the text itself (teacher forcing), whose next tokens score a perplexity
    follow = ids[a.depth - 1 :].tolist() if a.text else None
    ids = ids[: a.depth]
    res: dict = {
        "model": Path(a.model).name,
        "device": a.device,
        "depth": a.depth,
        "steps": a.steps,
        "prompt": "text: " + " ".join(Path(f).name for f in a.text) if a.text else "fixed token ids",
        "reference": ref_kv,
        "types": {},
    }
    t = time.perf_counter()
    ref, fed = run(m, ref_kv, ids, chunk, follow, a.steps)
    res[f"{ref_kv}_s"] = round(time.perf_counter() - t, 1)
    if follow is not None:
        res[f"{ref_kv}_perplexity"] = perplexity(ref, follow)
    for kv in a.kv_types.split(","):
        t = time.perf_counter()
        got, _ = run(m, kv, ids, chunk, follow or fed, a.steps)
        cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=1)
        lp, lq = ref.double().log_softmax(1), got.double().log_softmax(1)
        res["types"][kv] = {
            "kl_mean": round((lp.exp() * (lp - lq)).sum(1).mean().item(), 6),
            **({"perplexity": perplexity(got, follow)} if follow is not None else {}),
            "cosine_min": round(cos.min().item(), 6),
            "cosine_mean": round(cos.mean().item(), 6),
            "top1_agree": round((got.argmax(1) == ref.argmax(1)).float().mean().item(), 4),
            "kv_bytes_per_position": kv_bytes_per_token(lm.config, kv) * lm.config.n_layer,
            "ref_bytes_per_position": kv_bytes_per_token(lm.config, ref_kv) * lm.config.n_layer,
            "s": round(time.perf_counter() - t, 1),
        }
    emit(res, a.out)


if __name__ == "__main__":
    main()
