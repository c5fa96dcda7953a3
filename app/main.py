"""`strata`: the PolyStrata desktop app."""

import argparse
import sys

from installer import qt_libs
from installer.version import __version__

PROG = "strata"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="PolyStrata desktop app: finds your GPUs, runs the engine, serves the API from the tray, chat.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument(
        "--model", help="GGUF file to serve (default: the configured model, else the embedded one)"
    )
    p.add_argument(
        "--headless",
        action="store_true",
        help="no window: run `strata-engine serve` with the remaining arguments",
    )
    p.add_argument(
        "--check-system",
        action="store_true",
        help="check that the window can open here (a display, Qt's system libraries) and exit",
    )
    p.add_argument(
        "--quit-after", type=float, default=0.0, help=argparse.SUPPRESS
    )  # seconds; for smoke tests
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.headless:
        from app.engine_process import run_headless

        return run_headless(([f"--model={args.model}"] if args.model else []) + rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    code, message = qt_libs.report()  # before Qt: it would abort on a missing library, naming only one
    if code:
        print(f"{PROG}: {message}", file=sys.stderr)
        return code
    if args.check_system:
        return 0
    from app.application import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
