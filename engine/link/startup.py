"""What the main process runs, from the split options: the plain model on one card or the CPU, the stages of an
in-process layer split (engine.pipeline.split), or its own stages with the later layers behind the link on worker
PCs (`--remote-stage`). It sits in engine/link because it is the one place that joins the two."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import torch

from engine.experts.profile import startup_profile
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import resolve_kv_type
from engine.link.client import StageClient, StageError
from engine.link.keys import client_keys
from engine.link.remote import HeadStage, RemoteStage, data_digest, header_digest, stage_info
from engine.link.transport import parse_endpoint
from engine.models.decoder import DecoderLM
from engine.models.registry import file_config
from engine.pipeline.kv_check import check_q4_keys
from engine.pipeline.loader import LoadedModel, build, loaded, resolve_dtype
from engine.pipeline.split import (
    SplitOptions,
    StagePlan,
    _policies,
    build_model,
    geometry_from_gguf,
    plan_stages,
    visible_cards,
)
from engine.pipeline.stages import LocalStage, SplitModel
from engine.tokenizer import Tokenizer
from installer.engine_options import AUTO_CONTEXT
from installer.engine_options import D as OPTION_DEFAULTS
from installer.placement import (
    Card,
    Geometry,
    PlacementError,
    auto_context,
    auto_kv_resident,
    auto_parallel,
    context_floor,
)

log = logging.getLogger("strata.engine")


def load_split_model(
    path: str | Path,
    opts: SplitOptions,
    max_context: int = 4096,
    kv: str = "auto",
    dtype: str = "auto",
    profile: np.ndarray | None = None,
    parallel: int | None = 1,
) -> LoadedModel:
    """`engine.pipeline.loader.load_model` with the split options: the plan is checked before any weight is read (a bad
    split fails at once, saying how to fix it) and logged, then each stage loads only its own layers on its device.
    One stage gives the plain `DecoderLM`; several a `SplitModel` (both drive `Runner` alike).
    Without a `profile` given, that of the model file is read (`opts.profile`, else the data dir's; see
    engine.experts.profile) unless `opts.use_profile` is off. `parallel`: the sequences whose KV the memory plan
    keeps room for (serve's --parallel; None: installer.placement.auto_parallel); the result's `sequences`.
    `max_context` AUTO_CONTEXT: chosen from the card and the model (installer.placement.auto_context); the
    result's `context`."""
    gf = GGUFFile.open(path)
    tok = Tokenizer.from_metadata(gf.metadata)
    cfg = file_config(gf, tok.vocab_size)
    if opts.remote:
        check_remote_options(opts, cfg.n_layer)
    if profile is None and opts.use_profile and cfg.is_moe:
        used = startup_profile(gf, cfg, opts.profile)
        profile = used.counts if used is not None else None
    visible = visible_cards()
    cards = [v.card for v in visible]
    on_cuda = bool(cards) and opts.device.strip().lower() != "cpu"
    dt = resolve_dtype(dtype, torch.device("cuda" if on_cuda else "cpu"))
    kv_type = resolve_kv_type(kv, dt)
    geometry = geometry_from_gguf(gf, cfg, kv_type) if cards else None
    # With a remote stage this PC runs one stage: the plan places it (the rest is the worker's).
    plan_opts = replace(opts, layer_split=None) if opts.remote else opts
    kv_geometry = geometry if geometry is not None else geometry_from_gguf(gf, cfg, kv_type)
    auto = max_context == AUTO_CONTEXT
    if auto:  # the slots are chosen at the fixed default; the context then grows into the room they leave
        max_context = context_floor(cfg.n_ctx_train, OPTION_DEFAULTS.max_context)
    sequences = _sequences(parallel, opts, cards if on_cuda else [], kv_geometry, max_context)
    if auto:
        max_context = _context(opts, cards if on_cuda else [], kv_geometry, cfg.n_ctx_train, sequences)
    sp = plan_stages(plan_opts, cfg.n_layer, cards, geometry, max_context, profile, sequences)
    for line in sp.lines:
        log.info("%s", line)
    if opts.kv_resident is None and not opts.remote and len(sp.devices) == 1 and sp.devices[0] is not None:
        free = _free(replace(opts, gpu=sp.devices[0]), cards)
        if free is not None:
            resident, why = auto_kv_resident(
                kv_geometry, max_context, sequences, free, opts.reserve_mib << 20
            )
            if resident is not None:
                log.info("--kv-resident %d (auto: %s)", resident, why)
                opts = replace(opts, kv_resident=resident)
    if all(d is None for d in sp.devices):
        dt = resolve_dtype(dtype, torch.device("cpu"))
        kv_type = resolve_kv_type(kv, dt)
    ordinals = {v.card.index: v.ordinal for v in visible}
    if opts.remote:
        model: DecoderLM | SplitModel = build_remote_main(
            gf, cfg, sp, dt, ordinals, opts, max_context, kv_type, profile, sequences
        )
        held = min((c.slots for c in model.stages[1].chain), default=1)  # type: ignore[attr-defined]
        if held < sequences:
            log.info(
                "--parallel %d: the chain of workers holds %d sequence(s) (their --parallel): %d at once",
                sequences, held, held,
            )  # fmt: skip
            sequences = held
    else:
        model = build_model(gf, cfg, sp, dt, ordinals, opts, max_context, kv_type, profile, sequences)
    first = model.stages[0].device if isinstance(model, SplitModel) else model.device
    # the main card current (each stage makes its own current while it runs)
    if first.type == "cuda" and first.index is not None:
        torch.cuda.set_device(first)
    lm = loaded(path, gf, cfg, tok, model, opts.cpu_weights_mib, ", ".join(sp.labels), dt)
    if kv_type == "q4_0":
        check_q4_keys(model, tok)
    return replace(lm, sequences=sequences, context=max_context)


def _free(opts: SplitOptions, cards: list[Card]) -> int | None:
    """The free VRAM of the card the memory plan starts from (--vram-budget-mib caps it); None: no card."""
    card = next((c for c in cards if opts.gpu is None or c.index == opts.gpu), None)
    free = card.free_bytes if card is not None else None
    if (
        free is not None and opts.vram_budget_mib is not None
    ):  # the budget is the card as far as the plan goes
        free = min(free, opts.vram_budget_mib << 20)
    return free


def _context(opts: SplitOptions, cards: list[Card], geometry: Geometry, n_ctx_train: int, slots: int) -> int:
    """--max-context auto: installer.placement.auto_context on this PC's card; with a remote stage the fixed
    default (each worker allows its own --max-context, which the handshake checks)."""
    base = OPTION_DEFAULTS.max_context
    if opts.remote:
        n = context_floor(n_ctx_train, base)
        log.info("--max-context %d (auto: with --remote-stage, the workers' default; give both --max-context N "
                 "for more)", n)  # fmt: skip
        return n
    n, why = auto_context(geometry, n_ctx_train, _free(opts, cards), slots, base)
    log.info("--max-context %d (auto: %s)", n, why)
    return n


def _sequences(
    parallel: int | None, opts: SplitOptions, cards: list[Card], geometry: Geometry | None, context: int
) -> int:
    """Serve's --parallel: the slots asked for, or auto's (from this PC's card: each worker holds at most its own
    --parallel, and the handshake settles on the fewest)."""
    if parallel is not None:
        return parallel
    slot_kv = (
        sum(geometry.kv_bytes(i, context) for i in range(geometry.n_layer)) if geometry is not None else 0
    )
    free = _free(opts, cards)
    host = None if free is not None else int(psutil.virtual_memory().available)
    n, why = auto_parallel(slot_kv, free, host)
    log.info("--parallel %d (auto: %s)", n, why)
    return n


def check_remote_options(opts: SplitOptions, n_layer: int) -> None:
    """Refuse at start what cannot work with `--remote-stage`, saying why."""
    parse_endpoint(opts.remote or "", "--remote-stage")
    split = opts.layer_split
    if not isinstance(split, tuple) or len(split) != 1:
        raise PlacementError(
            "--remote-stage needs --layer-split K (one number: this PC runs layers 0 to K-1 and the head, the worker "
            f"K onward; more PCs chain through the workers' --stage-end and --stage-next), not {split or 'none'}"
        )
    if not 1 <= split[0] < n_layer:
        raise PlacementError(
            f"--layer-split {split[0]} with --remote-stage must lie between 1 and {n_layer - 1}"
        )
    if opts.gpus is not None and (opts.gpus == "all" or len(opts.gpus) > 1):
        raise PlacementError(
            "--remote-stage runs this PC's layers on one card: use --gpu N (several cards here and a remote stage "
            "together are not supported yet)"
        )
    if opts.split_device:
        raise PlacementError(
            "--split-device places in-process stages; with --remote-stage the worker runs K onward"
        )
    if opts.skip_if_fits:
        raise PlacementError(
            "--split-skip-if-fits decides an in-process split; it does not apply to --remote-stage"
        )


def build_remote_main(
    gf: GGUFFile,
    cfg: ModelConfig,
    sp: StagePlan,
    dtype: torch.dtype,
    ordinals: dict[int, int],
    opts: SplitOptions,
    context: int,
    kv_type: str,
    profile: np.ndarray | None,
    sequences: int = 1,
) -> SplitModel:
    """Layers [0, K) and the head here, [K, end) behind the link: connected and checked before it returns. The
    workers keep the KV of up to `sequences` sequences each (the chain's welcome says how many they hold)."""
    assert isinstance(opts.layer_split, tuple) and opts.remote
    k = opts.layer_split[0]
    d = sp.devices[0]
    dev = torch.device("cpu") if d is None else torch.device("cuda", ordinals.get(d, d))
    label = "CPU" if d is None else f"CUDA{d}"
    main_plan = StagePlan((range(0, k),), (d,))
    policy = _policies(main_plan, geometry_from_gguf(gf, cfg, kv_type), context, opts, profile, sequences)[0]
    main = build(gf, cfg, dev, dtype, layers=range(0, k), experts=policy)
    header = header_digest(gf)
    expect = stage_info(
        gf, cfg, k, cfg.n_layer, context, opts.pipe_chunk, kv_type, header=header, data=False, slots=sequences
    )
    held: list[int] = []  # the sequences the first session's chain holds: a later session must hold as many
    endpoint = parse_endpoint(opts.remote, "--remote-stage")
    digests: dict[tuple[int, int], str] = {}

    def verify(chain: list) -> None:  # type: ignore[type-arg]
        at = k
        for c in chain:
            if c.begin != at:
                raise StageError(
                    f"the chain behind {endpoint} runs layers {c.layers_text} where layer {at} was due"
                )
            key = (c.begin, c.end)
            if key not in digests:
                digests[key] = data_digest(gf, c.begin, c.end)
            if c.data != digests[key]:
                raise StageError(
                    f"model mismatch: layers {c.layers_text} at {c.address or endpoint} have weights fingerprint "
                    f"{c.data[:16]}, this PC's file {digests[key][:16]}: copy the same .gguf to both PCs",
                    "mismatch",
                )
            at = c.end
        if at != cfg.n_layer:
            raise StageError(
                f"the chain behind {endpoint} ends at layer {at - 1}; the model has {cfg.n_layer} layers: the last "
                "worker must run to the end (leave out its --stage-end)",
                "mismatch",
            )
        slots = min(c.slots for c in chain)
        if held and slots < held[0]:
            raise StageError(
                f"the chain behind {endpoint} now holds {slots} sequence(s), this process serves {held[0]} at once: "
                f"start the workers with --parallel {held[0]} or more (or restart this server)",
                "mismatch",
            )
        held[:] = [slots]

    client = StageClient(
        endpoint,
        client_keys(opts.stage_key, opts.remote_key),
        opts.pipe_chunk * cfg.n_embd * 4,
        label=f"the worker at {endpoint}",
        stall_s=opts.remote_stall_s,
    )
    sink = (lambda line: log.info("%s", line)) if opts.remote_timing else None
    remote = RemoteStage(client, expect, verify)
    stages = [LocalStage(main, label, head=False), remote, HeadStage(main, label)]
    model = SplitModel(
        cfg, stages, handoff=opts.handoff, pipeline=True, pipe_chunk=opts.pipe_chunk, timing_sink=sink
    )
    remote.connect()
    return model
