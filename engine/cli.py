"""`strata-engine`: the inference engine's command line. Standard library only at import (--help stays fast): each
command's module loads when the command runs."""

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable

from installer.config import ConfigError
from installer.engine_options import EngineOptions, OptionsError, build_parser, free_cores, resolve, typed

PROG = "strata-engine"
__all__ = ["build_parser", "main"]

# Each command's function, as "module:function": imported when that command runs (torch, uvicorn and pyzmq load
# then, not for --help or a usage error).
COMMANDS = {
    "generate": "engine.commands:cmd_generate",
    "logits": "engine.commands:cmd_logits",
    "profile": "engine.commands:cmd_profile",
    "serve": "engine.serve.cli:cmd_serve",
    "worker": "engine.link.worker:cmd_worker",
}


def command(name: str) -> Callable[[EngineOptions], int]:
    module, _, func = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), func)  # type: ignore[no-any-return]


def _thread_policy(threads: int) -> None:
    """One thread count for every pool of the process (torch's OpenMP, Numba's), set before either loads: two pools
    each sized to every core, or threads on cores other programs keep busy, stall each parallel step."""
    log = logging.getLogger("strata.engine")
    if threads <= 0:
        threads, usable = free_cores()
        if threads < usable:
            log.info("CPU: %d of %d cores are busy with other programs: %d threads (--threads sets them)",
                     usable - threads, usable, threads)  # fmt: skip
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
        if var == "NUMBA_NUM_THREADS" and "numba" in sys.modules:
            # Numba fixes its pool when it first loads, and refuses to compile once the variable says another
            # size: a second command run in the same process (the tests') leaves it as it is
            continue
        os.environ[var] = str(threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    given = typed(argv)  # a malformed command line exits here with argparse's usage message
    logging.basicConfig(
        level=logging.DEBUG if given.get("debug") else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    if not given.get("command"):
        build_parser().print_help()
        return 0
    try:
        args = resolve(argv, logger=logging.getLogger("strata.engine"))
    except (OptionsError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "activations", None):  # read by the kernels (engine.kernels.gemv); children inherit it
        os.environ["STRATA_ACTIVATIONS"] = args.activations
    _thread_policy(getattr(args, "threads", 0) or 0)
    t0 = time.perf_counter()
    try:
        return command(args.command)(args)
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
