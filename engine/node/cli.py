"""`strata-node`: the agent that lends this PC's GPUs to a PolyStrata main PC."""

import argparse
import json
import platform
import sys

from installer.version import __version__

PROG = "strata-node"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="PolyStrata node agent: lends this PC's GPUs to a main PC."
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    inv = sub.add_parser("inventory", help="print this PC and its GPUs as the agent reports them")
    inv.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def inventory() -> dict:
    import psutil

    from installer.gpus import probe

    result = probe()
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu_count": psutil.cpu_count(logical=True),
        "ram_total": psutil.virtual_memory().total,
        "gpu_status": result.message or result.kind,
        "gpus": [g.short for g in result.gpus],
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "inventory":
        info = inventory()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for k, v in info.items():
                print(f"{k}: {v}")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
