"""What `strata-engine generate`, `logits` and `profile` do (engine/cli.py parses the command line and calls them;
this module loads torch, which --help does without)."""

import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

from engine.experts.profile import (
    UsageProfile,
    model_counts,
    profile_location,
    save_profile,
    tokens_from_counts,
)
from engine.experts.replay import recorded
from engine.experts.trace import save_trace
from engine.layers.kv_cache import resolve_kv_type
from engine.link.startup import load_split_model
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner, TextEvent, TokenEvent
from engine.pipeline.loader import LoadedModel
from engine.pipeline.sampling import SamplingParams
from engine.pipeline.spec import SpecConfig
from engine.pipeline.split import prefill_chunk, prefill_span
from engine.pipeline.split_args import options_from_args
from installer.default_model import default_model_path
from installer.engine_options import EngineOptions

PROG = "strata-engine"


def _resolve_model(arg: str | None) -> Path:
    if arg:
        return Path(arg)

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


def _load(args: EngineOptions) -> "LoadedModel":
    """The model on the card(s) the split flags name (one card or CPU: the plain model)."""
    return load_split_model(
        _resolve_model(args.model), options_from_args(args), args.max_context, args.kv, args.dtype
    )


def _runner(args: EngineOptions, lm: "LoadedModel", spec: "SpecConfig | None" = None) -> "Runner":
    """The generation loop over the loaded model with the --max-context, --kv and --prefill flags."""
    kv = resolve_kv_type(args.kv, lm.model.dtype)
    opts = options_from_args(args)
    ctx = lm.context  # --max-context, auto resolved at load
    if args.prefill == "auto":
        chunk = prefill_chunk(lm.model, "auto", max_ctx=ctx, kv_type=kv,
                              budget_mib=opts.vram_budget_mib, reserve_mib=opts.reserve_mib)  # fmt: skip
    else:
        chunk = _prefill(args.prefill)
    span = prefill_span(lm.model, chunk, ctx, kv, opts.vram_budget_mib, opts.reserve_mib)
    return Runner(lm.model, lm.tokenizer, ctx, kv, chunk, spec=spec, prefill_span=span)


def cmd_generate(args: EngineOptions) -> int:
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
    stops = [*args.stop, *lm.chat.stop_strings] if args.chat is not None else list(args.stop)
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


def cmd_logits(args: EngineOptions) -> int:

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


def cmd_profile(args: EngineOptions) -> int:

    if args.max_tokens < 0:
        raise SystemExit(f"{PROG}: error: --max-tokens must be 0 or more, not {args.max_tokens}")
    if args.no_profile:
        raise SystemExit(
            f"{PROG}: error: --no-profile does not go with profile, which writes one: leave it out"
        )
    prompts = read_prompts(Path(args.prompts))
    if args.trace:
        # room for every prompt's tokens and its greedy ones, read before the model loads: the recorder is made
        # with the model, before its CUDA graphs (a prompt's chat template and tokens cost a few more)
        room = sum(len(p.encode()) + 256 + args.max_tokens for p in prompts)
        os.environ["STRATA_ROUTE_RECORD"] = str(min(room, (args.max_context or room) * len(prompts)))
    try:
        lm = _load(args)
    finally:
        os.environ.pop("STRATA_ROUTE_RECORD", None)
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
        if len(ids) >= lm.context:
            log.warning(
                "prompt %d of %s has %d tokens, --max-context is %d: skipped", n, args.prompts, len(ids),
                lm.context,
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
    if args.trace:
        local = getattr(lm.model, "local_models", None)
        trace = recorded(local() if local is not None else [lm.model])
        if trace is None:
            raise SystemExit(f"{PROG}: error: no routing was recorded ({lm.config.arch} routes another way)")
        trace.meta["model"] = lm.name
        save_trace(args.trace, trace)
        print(
            f"routing trace {args.trace}: {trace.tokens} tokens x {len(trace.layers)} MoE layers x {trace.k}"
        )
    return 0
