"""The layer split on two real cards (issue 14): one card against two, each budgeted as a 16 GB card so that the
expert caches matter, the two hand-offs (pinned host memory, peer copy), greedy identity, and the later stage in a
worker process over loopback; decode and prompt tok/s in interleaved rounds, best of each arm.

    python bench/two_gpu.py measure --model M.gguf [--gpus 0,1] [--vram-budget-mib 16384] [--prompt 4096]
                                    [--decode 128] [--rounds 3] [--no-remote] [--out two-gpu-ours.json]
    python bench/two_gpu.py measure --device cpu --tiny          # a dry run of every path on a tiny model
    python bench/two_gpu.py assemble --ours X.json --llama-two L2.json --llama-one L1.json --out two-gpu.json

Arms (one process, loaded in this order so that each budget sees only its own allocations):
- `split16_host`, `split16_peer`: cards 0 and 1 at the auto split the engine's placement picks for two cards of
  `--vram-budget-mib` each, every card budgeted so; the hand-off through pinned host memory, or a peer copy.
- `one16`: card 0 alone with the same budget (it caches fewer experts than the two cards together).
- `split_full`: cards 0 and 1 at the engine's own auto split, no budget, the engine's default hand-off (auto).
- `one_full`: card 0 alone, no budget. With every expert in VRAM on both sides, `one_full` and `split_full` (either
  hand-off) run the same math: their greedy tokens must be equal.
- `remote`: layers 0 to K-1 and the head here on card 0, K onward in `strata-engine worker` on card 1 (ZeroMQ +
  CURVE over 127.0.0.1), K that of `split_full`; against `split_full`.

`--vram-budget-mib` is the engine's own flag: the expert cache of each card gets what is left of that many MiB once
its weights, KV, reserve (512 MiB) and workspace are counted. The engine's auto placement plans with the cards'
real free VRAM, so for the budgeted arms the placement is computed here with each card's free VRAM set to the budget
(`budget_cards`); the JSON has both plans' log lines. Prompt chunks are the engine's `--prefill auto` choice per arm
unless `--chunk N`. The caches never change during the run (nothing calls ExpertCache.adapt outside the server).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import secrets
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.testing.spawned import Spawned  # noqa: E402 (after the project root is on the path)

MIB = 1 << 20
ARMS = ("one16", "split16_host", "split16_peer", "one_full", "split_full", "remote")


# ---------------------------------------------------------------------------------------------------------------
# Pure parts: the placement's cards, llama-bench's records, the ratios


def budget_cards(cards: list[Any], budget_mib: int) -> list[Any]:
    """The cards as the placement would see cards of `budget_mib` MiB: free VRAM at most the budget."""
    return [replace(c, free_bytes=min(c.free_bytes, budget_mib * MIB)) for c in cards]


def modelled_cards(n: int, mib: int) -> list[Any]:
    """Cards for a CPU dry run (the placement is a pure function of the cards; nothing runs on them)."""
    from installer.placement import Card

    return [Card(i, f"modelled {mib} MiB card", mib * MIB, mib * MIB, (9, 0), 132, 1980) for i in range(n)]


def llama_tok_s(records: object, n_prompt: int, n_gen: int) -> dict[str, float] | str:
    """llama-bench's `-o json` records -> {"prompt": tok/s of the n_prompt test, "decode": of the n_gen test}."""
    if isinstance(records, str):  # the reader's reason (a missing or empty file)
        return records
    if not isinstance(records, list):
        return "not measured: no llama-bench records"
    out: dict[str, float] = {}
    for r in records:
        if not isinstance(r, dict):
            continue
        if r.get("n_prompt") == n_prompt and r.get("n_gen") == 0:
            out["prompt"] = float(r["avg_ts"])
        elif r.get("n_prompt") == 0 and r.get("n_gen") == n_gen:
            out["decode"] = float(r["avg_ts"])
    if set(out) != {"prompt", "decode"}:
        return f"not measured: llama-bench records lack pp{n_prompt} or tg{n_gen}"
    return out


def _ratio(a: object, b: object) -> dict[str, float] | str:
    """a / b per measure, where both were measured."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return "not measured"
    keys = [k for k in ("decode", "prompt") if a.get(k) and b.get(k)]
    if not keys:
        return "not measured"
    return {k: a[k] / b[k] for k in keys}


def best_tok_s(tok_s: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {arm: {m: max(v) for m, v in d.items() if v} for arm, d in tok_s.items()}


def assemble(ours: dict[str, Any] | None, llama_two: object, llama_one: object) -> dict[str, Any]:
    """The figures of issue 14 in one object: ours, llama.cpp's (`-sm layer` on two cards, and one card), and the
    ratios between them. Anything missing is said so, not left out."""
    ours = ours or {}
    n_prompt = int(ours.get("prompt_tokens", 4096))
    n_gen = int(ours.get("decode_tokens", 128))
    best = ours.get("best_tok_s", {})
    l2, l1 = llama_tok_s(llama_two, n_prompt, n_gen), llama_tok_s(llama_one, n_prompt, n_gen)
    b = {a: best.get(a) for a in ARMS}
    split16 = [b[a] for a in ("split16_host", "split16_peer") if isinstance(b[a], dict)]
    best16 = {
        m: max(s[m] for s in split16 if m in s) for m in ("decode", "prompt") if any(m in s for s in split16)
    }
    greedy = ours.get("greedy", {})
    return {
        "what": "issue 14: the layer split on two cards against one, the remote stage, llama.cpp -sm layer",
        "budget_mib_per_card": ours.get("vram_budget_mib"),
        "prompt_tokens": n_prompt,
        "decode_tokens": n_gen,
        "ours_best_tok_s": best,
        "llamacpp_tok_s": {"two_gpus_sm_layer": l2, "one_gpu": l1},
        "ratios": {
            "two_16g_cards_over_one_16g_card_host": _ratio(b["split16_host"], b["one16"]),
            "two_16g_cards_over_one_16g_card_peer": _ratio(b["split16_peer"], b["one16"]),
            "peer_over_host_16g": _ratio(b["split16_peer"], b["split16_host"]),
            "two_cards_over_one_card_full_caches": _ratio(b["split_full"], b["one_full"]),
            "remote_over_in_process_split": _ratio(b["remote"], b["split_full"]),
            "llamacpp_two_over_one": _ratio(l2, l1),
            # llama.cpp holds the whole model on both cards: the fair match is our two 16 GB cards (each holds all
            # of its layers' experts) and our unbudgeted ones; one16 (a part of the experts in host RAM) has none.
            "ours_over_llamacpp_two_cards_16g_best_handoff": _ratio(best16 or None, l2),
            "ours_over_llamacpp_two_cards_full_caches": _ratio(b["split_full"], l2),
            "ours_over_llamacpp_one_card_full_caches": _ratio(b["one_full"], l1),
        },
        "greedy_identical": greedy.get("identical", "not measured"),
        "greedy_identity_verdict": greedy.get("verdict", "not measured"),
        "placement": ours.get("placement", "not measured"),
        "arms": {a: {k: v for k, v in d.items() if k != "log"} for a, d in ours.get("arms", {}).items()},
        "errors": {a: d["error"] for a, d in ours.get("arms", {}).items() if d.get("error")},
    }


# ---------------------------------------------------------------------------------------------------------------
# Measuring


class LogTap(logging.Handler):
    """Keeps the engine's log lines (placement, caches, chunks) while an arm loads."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @contextlib.contextmanager
    def catch(self) -> Iterator[list[str]]:
        self.lines = []
        root = logging.getLogger("strata")
        root.addHandler(self)
        try:
            yield self.lines
        finally:
            root.removeHandler(self)


def _sync(devices: list[Any]) -> None:
    import torch

    for d in {(d.type, d.index) for d in devices}:
        if d[0] == "cuda":
            torch.cuda.synchronize(d[1])


def _devices(model: object) -> list[Any]:
    devs = getattr(model, "devices", None)
    return list(devs) if devs is not None else [model.device]  # type: ignore[attr-defined]


def _ids(n: int, vocab: int, seed: int) -> Any:
    import torch

    lo, hi = min(100, vocab // 4), min(10000, vocab)
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed))


def prompt_tok_s(model: Any, n: int, chunk: int, kv: str, vocab: int) -> float:
    """n prompt tokens read in chunks as the Runner reads them (`last_only` where the model takes it)."""
    import torch

    ids = _ids(n, vocab, n)
    kw = {"last_only": True} if "last_only" in inspect.signature(model.forward).parameters else {}
    cache = model.new_cache(n + 8, kv)
    devs = _devices(model)
    _sync(devs)
    t = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, n, chunk):
            model.forward(ids[s : s + chunk], cache, s, **kw)
    _sync(devs)
    return n / (time.perf_counter() - t)


def decode_tok_s(model: Any, n: int, kv: str) -> float:
    """n greedy steps, each waiting for its token as a real step does; the first steps (graph captures) untimed."""
    import torch

    cache = model.new_cache(n + 64, kv)
    devs = _devices(model)
    with torch.inference_mode():
        model.forward(torch.arange(1, 17), cache, 0)
        tok = torch.tensor([42])
        for p in range(16, 20):
            tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()
        _sync(devs)
        t = time.perf_counter()
        for p in range(20, 20 + n):
            tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()
        _sync(devs)
    return n / (time.perf_counter() - t)


def greedy_tokens(model: Any, prompt: Any, n: int, kv: str) -> list[int]:
    """The prompt in one forward (shorter than a pipeline piece: no pieces), then n greedy tokens."""
    import torch

    cache = model.new_cache(int(prompt.shape[0]) + n + 8, kv)
    with torch.inference_mode():
        tok = model.forward(prompt, cache, 0)[-1].argmax().view(1).cpu()
        out = [int(tok)]
        for p in range(int(prompt.shape[0]), int(prompt.shape[0]) + n - 1):
            tok = model.forward(tok, cache, p)[-1].argmax().view(1).cpu()
            out.append(int(tok))
    return out


def stage_facts(model: Any) -> list[dict[str, Any]]:
    """Per local stage: device, layers and the experts its cache holds."""
    from engine.pipeline.stages import LocalStage, SplitModel

    parts = []
    if isinstance(model, SplitModel):
        for s in model.stages:
            if isinstance(s, LocalStage) and len(s.layers):
                parts.append((s.model, s.layers, s.label))
            elif not isinstance(s, LocalStage) and len(s.layers):
                parts.append((None, s.layers, s.label))
    else:
        parts.append((model, model.layer_range, str(model.device)))
    out = []
    for m, layers, label in parts:
        d: dict[str, Any] = {"where": label, "layers": f"{layers.start}-{layers.stop - 1}"}
        cache = getattr(m, "expert_cache", None) if m is not None else None
        if cache is not None:
            st = cache.stats()
            d.update(experts_in_vram=st.experts_in_vram, experts_total=st.experts_total,
                     expert_vram_gib=round(st.vram_bytes / 2**30, 2), hits=st.hits, misses=st.misses)  # fmt: skip
        out.append(d)
    return out


def start_worker(
    model: str, begin: int, ctx: int, device: str, uuid: str | None, gpu: int | None, env: dict[str, str]
) -> Spawned:
    """`strata-engine worker` for layers `begin`.. in a subprocess (its port from its log line). On CUDA the worker
    sees only its card (CUDA_VISIBLE_DEVICES=GPU-<uuid>), as on a PC of its own: its card is then also the
    process's current device, which the engine's Triton kernels launch on."""
    cmd = [sys.executable, "-m", "engine.cli", "worker", "--model", model, "--stage-worker", "0",
           "--stage-begin", str(begin), "--stage-bind", "127.0.0.1", "--max-context", str(ctx)]  # fmt: skip
    if device == "cpu":
        cmd += ["--device", "cpu", "--dtype", "f32", "--kv", "f32"]
    elif uuid:
        env = dict(env, CUDA_VISIBLE_DEVICES=f"GPU-{uuid}")
        cmd += ["--device", "cuda", "--dtype", "bf16", "--kv", "bf16"]
    else:
        cmd += ["--gpu", str(gpu), "--dtype", "bf16", "--kv", "bf16"]
    return Spawned(cmd, env, r"listening on 127\.0\.0\.1:(\d+)", ROOT)


def _err(e: BaseException) -> str:
    """The error and where it was raised (one line for the JSON)."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def measure(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.gguf.reader import GGUFFile
    from engine.link.startup import load_split_model
    from engine.models.registry import file_config
    from engine.pipeline.handoff import Handoff
    from engine.pipeline.split import (
        SplitOptions,
        geometry_from_gguf,
        plan_stages,
        prefill_chunk,
        visible_cards,
    )
    from engine.tokenizer import Tokenizer

    cpu = a.device == "cpu"
    if not cpu and torch.cuda.device_count() < 2:
        raise SystemExit(
            f"two_gpu.py: this machine shows {torch.cuda.device_count()} CUDA device(s); it needs 2"
        )
    if a.tiny:
        from engine.testing.tiny_models import write_tiny_model

        a.model = str(write_tiny_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "qwen3moe", qtype="Q8_0", seed=1,
                                       n_layer=6))  # fmt: skip
    gpus = tuple(int(g) for g in a.gpus.split(","))
    dtype, kv = ("f32", "f32") if cpu else ("bf16", "bf16")
    ctx = max(a.prompt + 8, a.greedy_prompt + a.greedy_tokens + 8, a.decode + 64) + 64
    gf = GGUFFile.open(a.model)
    cfg = file_config(gf, Tokenizer.from_metadata(gf.metadata).vocab_size)
    geometry = geometry_from_gguf(gf, cfg, kv)
    visible = [] if cpu else visible_cards()
    cards = modelled_cards(2, 139 * 1024) if cpu else [v.card for v in visible if v.card.index in gpus]
    if len(cards) < 2:
        raise SystemExit(f"two_gpu.py: --gpus {a.gpus} names cards this process cannot see: {visible}")
    if (
        not cpu
    ):  # the main card is the current device: the engine's Triton kernels launch on the current device
        torch.cuda.set_device(_ordinal(visible, gpus[0]))
    auto = SplitOptions(gpus=gpus, layer_split="auto", reserve_mib=a.reserve_mib)
    plan16 = plan_stages(auto, cfg.n_layer, budget_cards(cards, a.vram_budget_mib), geometry, ctx)
    plan_full = plan_stages(auto, cfg.n_layer, cards, geometry, ctx)

    def plan_json(sp: Any, what: str) -> dict[str, Any]:
        return {"what": what, "starts": [r.start for r in sp.ranges[1:]], "cards": list(sp.devices),
                "lines": list(sp.lines)}  # fmt: skip

    res: dict[str, Any] = {
        "model": Path(a.model).name,
        "file_bytes": sum(p.stat().st_size for p in gf.paths),
        "device": "cpu (dry run: modelled cards, no expert caches)" if cpu else [
            torch.cuda.get_device_name(v.ordinal) for v in visible if v.card.index in gpus],
        "torch": torch.__version__,
        "peer_access": None if cpu else torch.cuda.can_device_access_peer(
            _ordinal(visible, gpus[0]), _ordinal(visible, gpus[1])),
        "gpus": list(gpus),
        "vram_budget_mib": a.vram_budget_mib,
        "reserve_mib": a.reserve_mib,
        "prompt_tokens": a.prompt,
        "decode_tokens": a.decode,
        "rounds": a.rounds,
        "max_context": ctx,
        "placement": {
            "budgeted": plan_json(plan16, f"the engine's auto placement for two cards of {a.vram_budget_mib} MiB "
                                  "(used by split16_*)"),
            "full": plan_json(plan_full, "the engine's auto placement on these cards as they are (used by "
                              "split_full and remote; also what --gpus with --vram-budget-mib places today)"),
        },
        "arms": {},
    }  # fmt: skip
    out = Path(a.out) if a.out else None

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(res, indent=1) + "\n")

    save()
    tap = LogTap()
    models: dict[str, Any] = {}  # arm -> model
    handoffs: dict[str, Any] = {}  # arm -> the hand-off it runs with (split arms)
    chunks: dict[str, int] = {}
    base = SplitOptions(device="cpu" if cpu else "cuda", reserve_mib=a.reserve_mib, pipe_chunk=a.pipe_chunk,
                        use_profile=False)  # fmt: skip

    def chunk_for(m: Any, budget: int | None) -> int:
        if a.chunk != "auto":
            return int(a.chunk)
        return prefill_chunk(m, "auto", max_ctx=ctx, kv_type=kv, budget_mib=budget, reserve_mib=a.reserve_mib)

    def load(arm: str, opts: Any, what: str, budget: int | None) -> Any:
        info: dict[str, Any] = {"what": what}
        res["arms"][arm] = info
        try:
            with tap.catch() as lines:
                t0 = time.perf_counter()
                m = load_split_model(a.model, opts, ctx, kv, dtype).model
                info["load_s"] = round(time.perf_counter() - t0, 2)
                info["prompt_chunk"] = chunks[arm] = chunk_for(m, budget)
            info["log"] = list(lines)
            info["stages"] = stage_facts(m)
            info["vram_budget_mib_given"] = budget
            models[arm] = m
            return m
        except Exception as e:
            info["error"] = _err(e)
            print(f"[{arm}] failed to load: {info['error']}", file=sys.stderr)
            return None
        finally:
            save()

    def split_opts(sp: Any, budget: int | None) -> Any:
        starts = tuple(r.start for r in sp.ranges[1:])
        if cpu:
            return replace(base, layer_split=starts, vram_budget_mib=budget)
        return replace(
            base, device="auto", gpus=tuple(sp.devices), layer_split=starts, vram_budget_mib=budget
        )

    def add_handoffs(m: Any, arms: dict[str, str]) -> None:
        """Arms that share a split model and differ in its hand-off (the loaded one is the engine's `auto`)."""
        for arm, mode in arms.items():
            info = res["arms"].setdefault(arm, {})
            try:
                handoffs[arm] = m.handoffs[0] if mode == "auto" else Handoff(m.devices[0], m.devices[1], mode)
                models[arm] = m
                info["handoff"] = handoffs[arm].mode
            except Exception as e:
                info["error"] = _err(e)

    strata_log = logging.getLogger("strata")
    level, token = strata_log.level, os.environ.get("STRATA_STAGE_TOKEN")
    strata_log.setLevel(logging.INFO)  # the placement and cache lines go into the JSON
    # The remote stage's worker starts first: it loads while this process does.
    k_full = plan_full.ranges[1].start
    worker: Spawned | None = None
    if not a.no_remote:
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401

            os.environ["STRATA_STAGE_TOKEN"] = secrets.token_urlsafe(24)  # both sides' keys come from it
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            g1 = plan_full.devices[1] if not cpu else None
            uuid = None if g1 is None else _uuid(_ordinal(visible, g1))
            worker = start_worker(a.model, k_full, ctx, a.device, uuid, g1, env)
            res["remote_worker_cuda_visible_devices"] = f"GPU-{uuid}" if uuid else None
        except ImportError as e:
            res["arms"]["remote"] = {"error": f"not measured: {e} (the link needs pyzmq and msgpack)"}

    try:
        # Budgeted arms first, while nothing else is on the cards: a budget counts all this process holds there.
        sm16 = load("split16_host", split_opts(plan16, a.vram_budget_mib),
                    f"cards {list(plan16.devices)} at the auto split for two {a.vram_budget_mib} MiB cards, each "
                    "budgeted so", a.vram_budget_mib)  # fmt: skip
        if sm16 is not None:
            res["arms"]["split16_peer"] = {k: v for k, v in res["arms"]["split16_host"].items() if k != "log"}
            res["arms"]["split16_peer"]["what"] = "split16 with the peer-copy hand-off"
            chunks["split16_peer"] = chunks["split16_host"]
            add_handoffs(sm16, {"split16_host": "host", "split16_peer": "peer"})
        budget_one = None
        if not cpu:  # what this process already holds on the card is not this arm's
            torch.cuda.empty_cache()  # so that the prompt chunk's estimate (reserved memory) sees the same
            held = torch.cuda.memory_allocated(torch.device("cuda", _ordinal(visible, gpus[0])))
            budget_one = a.vram_budget_mib + round(held / MIB)
        load(
            "one16",
            replace(base, gpu=None if cpu else gpus[0], vram_budget_mib=budget_one),
            f"card {gpus[0]} alone, {a.vram_budget_mib} MiB budget",
            budget_one,
        )
        smf = load(
            "split_full",
            split_opts(plan_full, None),
            f"cards {list(plan_full.devices)} at the engine's auto split, no budget",
            None,
        )
        if smf is not None:
            for extra in ("split_full_host", "split_full_peer"):
                res["arms"][extra] = {"what": f"split_full with the {extra.rsplit('_', 1)[1]} hand-off"}
            add_handoffs(smf, {"split_full": "auto", "split_full_host": "host", "split_full_peer": "peer"})
        load(
            "one_full", replace(base, gpu=None if cpu else gpus[0]), f"card {gpus[0]} alone, no budget", None
        )
        if worker is not None:
            try:
                port = worker.wait_port(a.worker_timeout)
                load("remote", replace(base, gpu=None if cpu else plan_full.devices[0], layer_split=(k_full,),
                                       remote=f"127.0.0.1:{port}"),
                     f"layers 0-{k_full - 1} and the head here, {k_full}-end in a worker process on card "
                     f"{plan_full.devices[1]} over loopback", None)  # fmt: skip
            except Exception as e:
                res["arms"]["remote"] = {"error": _err(e)}
            res["arms"].setdefault("remote", {})["worker_log"] = worker.log[-12:]
        save()

        # Greedy tokens: every arm from the same short prompt.
        prompt = _ids(a.greedy_prompt, cfg.n_vocab, 7)
        tokens: dict[str, list[int]] = {}
        for arm in (*ARMS[:5], "split_full_host", "split_full_peer", "remote"):
            if arm not in models:
                continue
            try:
                if arm in handoffs:
                    models[arm].handoffs[0] = handoffs[arm]
                tokens[arm] = greedy_tokens(models[arm], prompt, a.greedy_tokens, kv)
            except Exception as e:
                res["arms"][arm]["error"] = _err(e)
        ref = tokens.get("one_full")
        same = {arm: t == ref for arm, t in tokens.items() if arm != "one_full"} if ref is not None else {}
        pair = {k: same[k] for k in ("split_full_host", "split_full_peer") if k in same}
        verdict = "not measured" if not pair else "identical" if all(pair.values()) else "DIFFERENT"
        verdict = f"one card vs two cards, full caches ({', '.join(pair) or 'no split arm'}): {verdict}"
        res["greedy"] = {"prompt_tokens": a.greedy_prompt, "tokens_compared": a.greedy_tokens,
                         "reference": "one_full", "tokens": tokens, "identical": same,
                         "verdict": verdict}  # fmt: skip
        save()

        # Interleaved rounds.
        timed = [arm for arm in ARMS if arm in models]
        res["tok_s"] = {arm: {"decode": [], "prompt": []} for arm in timed}
        for r in range(a.rounds):
            for arm in timed:
                m = models[arm]
                try:
                    if arm in handoffs:
                        m.handoffs[0] = handoffs[arm]
                    res["tok_s"][arm]["decode"].append(decode_tok_s(m, a.decode, kv))
                    res["tok_s"][arm]["prompt"].append(
                        prompt_tok_s(m, a.prompt, chunks[arm], kv, cfg.n_vocab)
                    )
                except Exception as e:
                    res["arms"][arm]["error"] = _err(e)
            res["best_tok_s"] = best_tok_s(res["tok_s"])
            res["rounds_done"] = r + 1
            print(f"round {r + 1}: {json.dumps(res['best_tok_s'])}", file=sys.stderr)
            save()
        for arm in timed:  # hit counts after the rounds
            res["arms"][arm]["stages"] = stage_facts(models[arm])
        res["summary"] = {k: v for k, v in assemble(res, None, None)["ratios"].items() if "llamacpp" not in k}
        save()
    finally:
        remote = models.get("remote")
        if remote is not None:
            remote.close()
        if worker is not None:
            worker.stop()
        strata_log.setLevel(level)
        if token is None:
            os.environ.pop("STRATA_STAGE_TOKEN", None)
        else:
            os.environ["STRATA_STAGE_TOKEN"] = token
    return res


def _uuid(ordinal: int) -> str | None:
    """The card's UUID as CUDA_VISIBLE_DEVICES takes it after "GPU-" (None where torch does not give it)."""
    import torch

    u = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    return str(u).lower().removeprefix("gpu-") if u is not None else None


def _ordinal(visible: list[Any], card: int) -> int:
    for v in visible:
        if v.card.index == card:
            return int(v.ordinal)
    raise SystemExit(f"two_gpu.py: card {card} is not visible to this process")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="load the arms and measure them")
    m.add_argument("--model", help="the GGUF file (or --tiny)")
    m.add_argument("--tiny", action="store_true", help="a tiny qwen3moe written here (the CPU dry run)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    m.add_argument("--gpus", default="0,1", help="the two cards, as nvidia-smi numbers them")
    m.add_argument("--vram-budget-mib", type=int, default=16384, help="each card behaves as one of this size")
    m.add_argument("--reserve-mib", type=int, default=512, help="the engine's --vram-reserve-mib")
    m.add_argument("--prompt", type=int, default=4096)
    m.add_argument("--decode", type=int, default=128)
    m.add_argument(
        "--chunk", default="auto", help="prompt tokens per forward: auto (the engine's choice) or N"
    )
    m.add_argument("--pipe-chunk", type=int, default=512, help="the split's prompt pieces")
    m.add_argument("--greedy-prompt", type=int, default=32)
    m.add_argument("--greedy-tokens", type=int, default=32)
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--no-remote", action="store_true")
    m.add_argument("--worker-timeout", type=float, default=120.0)
    m.add_argument("--out")
    s = sub.add_parser("assemble", help="ours and llama-bench's JSON -> the issue's figures with ratios")
    s.add_argument("--ours")
    s.add_argument("--llama-two", help="llama-bench -sm layer on both cards, -o json")
    s.add_argument("--llama-one", help="llama-bench on one card, -o json")
    s.add_argument("--out", required=True)
    return ap


def main() -> None:
    ap = build_parser()
    a = ap.parse_args()
    if a.cmd == "assemble":

        def read(p: str | None) -> Any:
            try:
                return json.loads(Path(p).read_text()) if p else None
            except (OSError, ValueError) as e:
                return f"not measured: {p}: {e}"

        ours = read(a.ours)
        res = assemble(ours if isinstance(ours, dict) else None, read(a.llama_two), read(a.llama_one))
        if not isinstance(ours, dict):
            res["errors"]["ours"] = ours or "no --ours file"
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({"ratios": res["ratios"], "greedy": res["greedy_identity_verdict"]}, indent=1))
        return
    if not a.model and not a.tiny:
        ap.error("measure needs --model M.gguf (or --tiny for a dry run)")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    res = measure(a)
    print(json.dumps({"best_tok_s": res.get("best_tok_s"), "greedy": res.get("greedy", {}).get("verdict"),
                      "summary": res.get("summary")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
