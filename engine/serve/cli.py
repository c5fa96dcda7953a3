"""`strata-engine serve`: the OpenAI-compatible server. engine/cli.py imports this module only when `serve` runs
(`strata-engine --help` loads neither FastAPI, uvicorn nor torch); the model itself loads in the background once
the server answers."""

import ipaddress
import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from engine.link.keys import LinkKeyError, client_keys
from engine.pipeline.spec import SpecConfig, SpecError
from engine.pipeline.split_args import options_from_args
from engine.serve.app import create_app
from engine.serve.options import ServeOptions
from engine.serve.serving import EngineService
from installer.engine_options import AUTO_CONTEXT
from installer.placement import MAX_PARALLEL

if TYPE_CHECKING:
    from engine.pipeline.split import SplitOptions
    from installer.engine_options import EngineOptions

PROG = "strata-engine serve"
log = logging.getLogger("strata.serve")


class ServeError(RuntimeError):
    """A start that cannot go ahead; the message says why and what to do."""


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _prefill(arg: str) -> int | None:
    """--prefill as a chunk size; None for auto (chosen once the model is loaded: several pieces per chunk on a
    pipelined split, see engine.pipeline.split.prefill_chunk)."""
    if arg == "auto":
        return None
    if not arg.isdigit() or int(arg) < 1:
        raise ServeError(f"--prefill must be auto or a number of tokens >= 1, not {arg!r}")
    return int(arg)


def _split_options(args: "EngineOptions") -> "SplitOptions":
    """The split flags, checked as far as they can be without the model (the rest when it loads, on /health)."""
    try:
        split = options_from_args(args)
    except ValueError as e:  # PlacementError is one
        raise ServeError(str(e)) from None
    if split.remote:
        try:  # no key for the link: say so now rather than on /health
            client_keys(split.stage_key, split.remote_key)
        except LinkKeyError as e:
            raise ServeError(str(e)) from None
    return split


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (bound here so that --port 0 can be reported and a busy port said plainly)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host} is not an address of this PC: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    if sys.platform != "win32":  # on Windows SO_REUSEADDR would let two servers share the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {e.strerror}; stop the program using that port or pick another "
            "with --port"
        ) from None
    sock.listen(256)
    return sock


def cmd_serve(args: "EngineOptions") -> int:
    try:
        return _serve(args)
    except ServeError as e:
        print(f"strata-engine: error: {e}", file=sys.stderr)
        return 2


def _serve(args: "EngineOptions") -> int:
    api_key = args.api_key or None  # the flag, else $STRATA_API_KEY (installer.engine_options)
    if not is_loopback(args.host) and not api_key:
        raise ServeError(
            f"refusing to listen on {args.host} without an API key: anyone on the network could use the model; "
            "add --api-key KEY (or set STRATA_API_KEY), or listen on 127.0.0.1"
        )
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be 0..65535, not {args.port}")
    if args.max_context != AUTO_CONTEXT and args.max_context < 16:
        raise ServeError(f"--max-context must be at least 16 positions (or auto), not {args.max_context}")
    if args.max_queue < 1:
        raise ServeError(f"--max-queue must be at least 1, not {args.max_queue}")
    if args.batch_groups is not None and args.batch_groups < 1:
        raise ServeError(f"--batch-groups must be 1 or more (or left out: auto), not {args.batch_groups}")
    if args.parallel is not None and not 1 <= args.parallel <= MAX_PARALLEL:
        raise ServeError(
            f"--parallel must be 1..{MAX_PARALLEL} slots (or left out: auto), not {args.parallel}"
        )
    if args.prompt_cache_mib < 0:
        raise ServeError(f"--prompt-cache-mib must be 0 (off) or more, not {args.prompt_cache_mib}")
    if args.threads < 0:
        raise ServeError(f"--threads must be 0 (automatic) or more, not {args.threads}")
    if args.profile_every < 0:
        raise ServeError(
            f"--profile-every must be 0 (after every request) or more seconds, not {args.profile_every}"
        )
    if args.max_body_mib <= 0:
        raise ServeError(f"--max-body-mib must be more than 0, not {args.max_body_mib}")

    try:
        SpecConfig.from_flags(args.spec, bool(args.suffix_draft), args.mtp, args.pipeline_windows)
    except SpecError as e:
        raise ServeError(str(e)) from None
    model = Path(args.model) if args.model else None
    if model is not None and not model.is_file():
        raise ServeError(f'model file {model} does not exist: check --model (or the config\'s "model")')
    split = _split_options(args)

    opts = ServeOptions(
        model=model,
        device=args.device,
        dtype=args.dtype,
        kv=args.kv,
        max_context=args.max_context,
        prefill=_prefill(str(args.prefill)),
        prompt_cache_mib=args.prompt_cache_mib,
        max_queue=args.max_queue,
        parallel=args.parallel,
        batch_groups=args.batch_groups,
        aliases=tuple(args.alias),
        api_key=api_key,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        threads=args.threads,
        spec=args.spec,
        suffix_draft=bool(args.suffix_draft),
        mtp=args.mtp,
        pipeline_windows=args.pipeline_windows,
        split=split,
        profile_every_s=args.profile_every,
    )
    sock = bind(args.host, args.port)
    service = EngineService(opts)
    app = create_app(service, list(args.cors))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # The app and the tests read this line for the port (--port 0).
    print(
        f"strata-engine: listening on http://{shown}:{port} (OpenAI API at /v1)", file=sys.stderr, flush=True
    )
    if not is_loopback(args.host):
        log.warning("listening on %s: every request must carry the API key", args.host)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            service.stop_soon()  # end running and queued requests and event streams now, not after the grace
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        ws="none",
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    _Server(config).run(sockets=[sock])
    return 0
