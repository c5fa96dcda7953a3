"""`strata-engine worker`: run layers [K, K2) of a model for a main process on another PC (seed 000).

    strata-engine worker --model F --stage-worker 7070 --stage-begin 24                  # the last stage
    strata-engine worker --model F --stage-worker 7070 --stage-begin 16 --stage-end 32 \\
                         --stage-next 192.168.1.21:7070                                   # a relay to the next PC

Keys: `STRATA_STAGE_TOKEN` (the same secret on every PC) for a worker started by hand, or `--stage-key FILE` and
`--stage-allow KEY` (the node agent's fresh key and the main's public key). engine/cli.py imports this module only
when the command runs.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import psutil
import torch

from engine.gguf.reader import GGUFFile
from engine.layers import cpu_weights
from engine.layers.kv_cache import resolve_kv_type
from engine.link.client import StageError
from engine.link.keys import LinkKeyError, client_keys, fingerprint, server_keys
from engine.link.protocol import MAX_SLOTS
from engine.link.remote import ModelCompute, stage_info
from engine.link.server import StageServer
from engine.link.transport import EndpointError, parse_endpoint
from engine.models.registry import file_config
from engine.pipeline.loader import build, resolve_dtype
from engine.pipeline.split import (
    SplitOptions,
    StagePlan,
    _policies,
    geometry_from_gguf,
    host_kv_line,
    kv_host,
    plan_stages,
    visible_cards,
)
from engine.tokenizer import Tokenizer
from installer.placement import Card, Geometry, PlacementError, auto_parallel

if TYPE_CHECKING:
    from installer.engine_options import EngineOptions

PROG = "strata-engine worker"
log = logging.getLogger("strata.link")


def cmd_worker(args: EngineOptions) -> int:
    try:
        server = _build(args)
    except (PlacementError, StageError, LinkKeyError, EndpointError, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: object) -> None:
        server.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    return 0


def _build(args: EngineOptions) -> object:
    if not args.model:
        raise PlacementError("--model is required: the same .gguf file as the main process")
    gf = GGUFFile.open(args.model)
    tok = Tokenizer.from_metadata(gf.metadata)
    cfg = file_config(gf, tok.vocab_size)
    n = cfg.n_layer
    begin, end = args.stage_begin, args.stage_end if args.stage_end is not None else n
    if not 1 <= begin < n:
        raise PlacementError(
            f"--stage-begin {begin}: a worker starts at a layer between 1 and {n - 1} (the main process always runs "
            "layer 0 and the head)"
        )
    if not begin < end <= n:
        raise PlacementError(f"--stage-end {end} must lie between --stage-begin + 1 ({begin + 1}) and {n}")
    if end < n and not args.stage_next:
        raise PlacementError(
            f"--stage-end {end} stops before the model's end ({n}): name the worker of layers {end} on with "
            "--stage-next HOST:PORT, or leave out --stage-end"
        )
    if args.stage_next and end == n:
        raise PlacementError(
            "--stage-next relays to a later worker: give --stage-end K2 (below the model's end) too"
        )
    if args.prefill != "auto" and (not str(args.prefill).isdigit() or int(args.prefill) < 1):
        raise PlacementError(f"--prefill must be auto or a number of tokens, not {args.prefill!r}")
    max_tokens = 4096 if args.prefill == "auto" else int(args.prefill)
    if args.max_context < 16:  # auto too: the worker holds what the main asks for, up to this
        raise PlacementError(
            f"--max-context {args.max_context or 'auto'}: give the worker the positions it may hold for the main "
            "(at least the main's --max-context, which its log says), e.g. --max-context 32768"
        )

    keys = server_keys(args.stage_key, args.stage_allow)
    next_endpoint = parse_endpoint(args.stage_next, "--stage-next") if args.stage_next else None
    next_keys = None
    if next_endpoint is not None:
        if args.stage_key and not args.stage_next_key:
            raise PlacementError(
                "--stage-next with --stage-key needs the next worker's public key: --stage-next-key"
            )
        next_keys = client_keys(args.stage_key, args.stage_next_key)

    visible = visible_cards()
    cards = [v.card for v in visible]
    sp = plan_stages(SplitOptions(device=args.device, gpu=args.gpu), n, cards)
    d = sp.devices[0]
    ordinals = {v.card.index: v.ordinal for v in visible}
    dev = torch.device("cpu") if d is None else torch.device("cuda", ordinals.get(d, d))
    dtype = resolve_dtype(args.dtype, dev)
    kv = resolve_kv_type(args.kv, dtype)
    geometry = geometry_from_gguf(gf, cfg, kv)
    slots = _slots(args.parallel, geometry, range(begin, end), args.max_context, cards, d)
    here = StagePlan((range(begin, end),), (d,))
    opts = SplitOptions(kv_resident=getattr(args, "kv_resident", None))
    policy = _policies(here, geometry, args.max_context, opts, None, slots)[0]
    host = kv_host(geometry, here, 0, args.max_context, opts)
    if host:
        log.info(
            "%s", host_kv_line(geometry, here.ranges[0], host, args.max_context, slots, sp.labels[0], opts)
        )
    model = build(gf, cfg, dev, dtype, layers=range(begin, end), embed=False, head=False, experts=policy,
                  kv_host_layers=host)  # fmt: skip
    cpu_weights.attach(model, getattr(args, "cpu_weights_mib", None))
    info = stage_info(gf, cfg, begin, end, args.max_context, max_tokens, kv, slots=slots)
    timing = (lambda line: log.info("%s", line)) if args.remote_timing else None
    server = StageServer(
        info, ModelCompute(model, sp.labels[0]), keys, args.stage_bind, args.stage_worker, next_endpoint, next_keys,
        timing=timing,
    )  # fmt: skip
    relay = f", relaying to {next_endpoint}" if next_endpoint else ""
    # The node agent and the tests read this line for the port (--stage-worker 0).
    print(
        f"{PROG}: layers {begin}-{end - 1} on {sp.labels[0]} ({slots} slot{'s' if slots > 1 else ''}), listening "
        f"on {args.stage_bind}:{server.port}{relay} "
        f"(key {fingerprint(keys.pair.public)}, clients from {keys.source})",
        file=sys.stderr,
        flush=True,
    )
    return server


def _slots(
    parallel: int | None, geometry: Geometry, layers: range, context: int, cards: list[Card], card: int | None
) -> int:
    """--parallel: the sequences whose KV this worker keeps (the main's slots), or auto's from the card's free
    VRAM (the RAM where it runs on the CPU), as serve decides for the whole model."""
    if parallel is not None:
        if not 1 <= parallel <= MAX_SLOTS:
            raise PlacementError(f"--parallel {parallel}: a worker keeps 1 to {MAX_SLOTS} sequences")
        return parallel
    slot_kv = sum(geometry.kv_bytes(i, context) for i in layers)
    free = next((c.free_bytes for c in cards if c.index == card), None) if card is not None else None
    host = None if free is not None else int(psutil.virtual_memory().available)
    n, why = auto_parallel(slot_kv, free, host)
    log.info("--parallel %d (auto: %s)", n, why)
    return n
