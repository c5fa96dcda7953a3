"""`strata-engine`: the inference engine's command line."""

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.link.worker import add_worker_args, cmd_worker
from engine.pipeline.split_args import add_split_args
from engine.serve.cli import add_serve_args, cmd_serve
from installer.version import __version__

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from engine.pipeline.generate import Runner
    from engine.pipeline.spec import SpecConfig

PROG = "strata-engine"


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "-m", help="GGUF file (any part of a multi-part file); default: the embedded Gemma 3 270M"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument(
        "--dtype", default="auto", help="compute type: auto (bf16 on CUDA, f32 on CPU), f32, bf16, f16"
    )
    p.add_argument(
        "--kv", default="auto", help="KV cache type: auto (the compute type), f32, f16, bf16, int8"
    )
    p.add_argument(
        "--max-context", type=int, default=4096, help="positions the KV cache holds (default 4096)"
    )
    p.add_argument("--prefill", default="auto", help="prompt chunk size in tokens, or auto (512)")
    p.add_argument(
        "--activations",
        choices=("int8", "float"),
        default=None,
        help="decode on CUDA: int8 (default) rounds the activations of the Q4_K/Q6_K matrix-vector kernels to 8 "
        "bits, as llama.cpp does (faster); float keeps the exact float product",
    )


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("verify windows (docs/speculative.md)")
    g.add_argument(
        "--spec",
        type=int,
        default=0,
        metavar="N",
        help="draft up to N tokens per step and verify them in one forward (default 0: off); greedy output is unchanged",
    )
    g.add_argument(
        "--suffix-draft",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: draft by copying earlier context, prompt and answer (default); 0: only the model's draft layer",
    )
    g.add_argument(
        "--mtp",
        nargs="?",
        const="1",
        default="auto",
        metavar="auto|1|0",
        help="draft with the model's own draft (MTP / nextn) layer: auto where the file has one (default), "
        "1 (or --mtp alone) to require it, 0 to leave it out",
    )
    g.add_argument(
        "--pipeline-windows",
        type=int,
        default=0,
        metavar="N",
        help="2: on a layer split, the first stages read the next (guessed) window while the last verifies (default 0)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="PolyStrata inference engine: runs GGUF models (Mixture-of-Experts and dense) on the CPU or CUDA.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text from a prompt or a chat message")
    _model_arg(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="raw prompt text (no chat template)")
    src.add_argument("--chat", "-c", help="a user message, formatted with the model's chat template")
    g.add_argument("--system", help="system prompt for --chat")
    _sampling_args(g)
    _spec_args(g)
    add_split_args(g)

    sv = sub.add_parser("serve", help="serve the OpenAI-compatible API, /metrics, /stats and /events")
    _model_arg(sv)
    add_serve_args(sv)
    _spec_args(sv)
    add_split_args(sv)

    lg = sub.add_parser("logits", help="write the logits of a token-id list to a .npy file")
    _model_arg(lg)
    lg.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 2,651,6037")
    lg.add_argument("--out", required=True, help="output .npy file")
    lg.add_argument(
        "--all", action="store_true", help="every position ([T, V]) instead of the last one ([V])"
    )
    add_split_args(lg)

    pr = sub.add_parser(
        "profile",
        help="record which experts a set of prompts uses (the usage profile that fills the expert caches)",
        description="Runs each line of --prompts as a user message (the model's chat template, then a few greedy "
        "tokens) and adds the experts each layer selected to the model file's usage profile.",
    )
    _model_arg(pr)
    pr.add_argument(
        "--prompts", required=True, metavar="FILE", help="a UTF-8 text file: one user message per line"
    )
    pr.add_argument(
        "--max-tokens", "-n", type=int, default=16, help="greedy tokens after each prompt (default 16)"
    )
    pr.add_argument(
        "--out",
        metavar="PATH",
        help="the profile file to add to (default: --profile, else the one the engine reads for this file)",
    )
    add_split_args(pr)

    wk = sub.add_parser("worker", help="run layers K onward of a model for a main process on another PC")
    _model_arg(wk)
    add_worker_args(wk)
    return parser


def _resolve_model(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from installer.default_model import default_model_path

    return default_model_path()


def _prefill(arg: str) -> int:
    if arg == "auto":
        return 512
    try:
        n = int(arg)
    except ValueError:
        raise SystemExit(
            f"{PROG}: error: --prefill must be auto or a number of tokens, not {arg!r}"
        ) from None
    if n < 1:
        raise SystemExit(f"{PROG}: error: --prefill must be at least 1")
    return n


def _load(args: argparse.Namespace) -> "LoadedModel":
    """The model on the card(s) the split flags name (one card or CPU: the plain model)."""
    from engine.pipeline.split import load_split_model
    from engine.pipeline.split_args import options_from_args

    return load_split_model(
        _resolve_model(args.model), options_from_args(args), args.max_context, args.kv, args.dtype
    )


def _runner(args: argparse.Namespace, lm: "LoadedModel", spec: "SpecConfig | None" = None) -> "Runner":
    """The generation loop over the loaded model with the --max-context, --kv and --prefill flags."""
    from engine.layers.kv_cache import resolve_kv_type
    from engine.pipeline.generate import Runner
    from engine.pipeline.split import prefill_chunk, prefill_span
    from engine.pipeline.split_args import options_from_args

    kv = resolve_kv_type(args.kv, lm.model.dtype)
    opts = options_from_args(args)
    if args.prefill == "auto":
        chunk = prefill_chunk(lm.model, "auto", max_ctx=args.max_context, kv_type=kv,
                              budget_mib=opts.vram_budget_mib, reserve_mib=opts.reserve_mib)  # fmt: skip
    else:
        chunk = _prefill(args.prefill)
    span = prefill_span(lm.model, chunk, args.max_context, kv, opts.vram_budget_mib, opts.reserve_mib)
    return Runner(lm.model, lm.tokenizer, args.max_context, kv, chunk, spec=spec, prefill_span=span)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.pipeline.generate import DoneEvent, GenerationRequest, TextEvent, TokenEvent
    from engine.pipeline.sampling import SamplingParams
    from engine.pipeline.spec import SpecConfig

    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    spec = SpecConfig.from_flags(args.spec, bool(args.suffix_draft), args.mtp, args.pipeline_windows)
    lm = _load(args)
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}
        ]
        text = lm.chat.render(messages, add_generation_prompt=True)
        ids = lm.tokenizer.encode(text, add_special=True, parse_special=True)
    else:
        ids = lm.tokenizer.encode(args.prompt, add_special=True, parse_special=False)
    runner = _runner(args, lm, spec)
    stops = [*args.stop, *lm.chat.stop_strings] if args.chat is not None else args.stop
    req = GenerationRequest(ids, max_tokens=args.max_tokens, sampling=sampling, stop=stops)
    if args.prompt is not None:
        sys.stdout.write(args.prompt)
    for ev in runner.generate(req):
        if isinstance(ev, TokenEvent | TextEvent):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, DoneEvent):
            t = ev.timings
            sys.stdout.write("\n")
            drafts = f", drafts kept {t.drafts_accepted} of {t.drafts_proposed}" if spec.n else ""
            print(
                f"[{t.prompt_tokens} prompt tokens at {t.prompt_per_second:.1f} tok/s, "
                f"{t.generated_tokens} generated at {t.generated_per_second:.1f} tok/s{drafts}, "
                f"finish: {ev.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from engine.layers.kv_cache import resolve_kv_type

    try:
        ids = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"{PROG}: error: --tokens must be comma-separated integers, e.g. 2,651,6037"
        ) from None
    if not ids:
        raise SystemExit(f"{PROG}: error: --tokens is empty")
    lm = _load(args)
    bad = [i for i in ids if not 0 <= i < lm.config.n_vocab]
    if bad:
        raise SystemExit(
            f"{PROG}: error: token ids {bad[:5]} are outside the vocabulary (0..{lm.config.n_vocab - 1})"
        )
    cache = lm.model.new_cache(max(len(ids), 1), resolve_kv_type(args.kv, lm.model.dtype))
    with torch.inference_mode():
        logits = lm.model.forward(torch.tensor(ids), cache, 0).float().cpu().numpy()  # [T, V]
    out = logits if args.all else logits[-1]
    np.save(args.out, out)
    print(f"wrote logits {tuple(out.shape)} to {args.out}", file=sys.stderr)
    return 0


def read_prompts(path: Path) -> list[str]:
    """`--prompts`: one user message per line; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SystemExit(f"{PROG}: error: --prompts {path} does not exist") from None
    except UnicodeDecodeError:
        raise SystemExit(f"{PROG}: error: --prompts {path} is not UTF-8 text (one prompt per line)") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{PROG}: error: --prompts {path} has no prompt: write one user message per line")
    return prompts


def cmd_profile(args: argparse.Namespace) -> int:
    from engine.experts.profile import (
        UsageProfile,
        model_counts,
        profile_location,
        save_profile,
        tokens_from_counts,
    )
    from engine.pipeline.generate import GenerationRequest
    from engine.pipeline.sampling import SamplingParams

    if args.max_tokens < 0:
        raise SystemExit(f"{PROG}: error: --max-tokens must be 0 or more, not {args.max_tokens}")
    if args.no_profile:
        raise SystemExit(
            f"{PROG}: error: --no-profile does not go with profile, which writes one: leave it out"
        )
    prompts = read_prompts(Path(args.prompts))
    lm = _load(args)
    before = model_counts(lm.model)
    if before is None:
        raise SystemExit(
            f"{PROG}: error: {lm.name} is a dense {lm.config.arch} model: it has no experts to profile"
        )
    runner = _runner(args, lm)
    greedy = SamplingParams(temperature=0.0)
    log = logging.getLogger("strata.engine")
    done = 0
    for n, text in enumerate(prompts, 1):
        rendered = lm.chat.render([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = lm.tokenizer.encode(rendered, add_special=True, parse_special=True)
        if len(ids) >= args.max_context:
            log.warning(
                "prompt %d of %s has %d tokens, --max-context is %d: skipped", n, args.prompts, len(ids),
                args.max_context,
            )  # fmt: skip
            continue
        # Each prompt is read whole (no prefix reuse): the profile counts every token of it.
        req = GenerationRequest(ids, max_tokens=args.max_tokens, sampling=greedy, cache_prompt=False)
        for _ in runner.generate(req):
            pass
        done += 1
    after = model_counts(lm.model)
    assert after is not None
    counts = after - before  # [L, E]
    path, ident = profile_location(lm.gguf, lm.config, args.out or args.profile)
    added = UsageProfile(ident, counts, tokens_from_counts(counts, lm.config.n_expert_used))
    total = save_profile(path, added)
    print(
        f"expert profile {path}: {done} prompts, {added.summary()}"
        + (f"; the file now holds {total.tokens} tokens" if total.tokens != added.tokens else "")
    )
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "logits": cmd_logits,
    "profile": cmd_profile,
    "serve": cmd_serve,
    "worker": cmd_worker,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "activations", None):  # read by the kernels (engine.kernels.gemv); children inherit it
        os.environ["STRATA_ACTIVATIONS"] = args.activations
    t0 = time.perf_counter()
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a user never sees a traceback; --debug shows it
        if args.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    finally:
        logging.getLogger("strata.engine").debug("%s took %.2f s", args.command, time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
