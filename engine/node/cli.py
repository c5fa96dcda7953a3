"""`strata-node`: the agent that lends this PC's GPUs to a PolyStrata main PC, and the main PC's commands for them.

On a worker PC: `strata-node serve --host 192.168.1.20` (prints the key fingerprint and the pairing code).
On the main PC: `strata-node discover`, `pair HOST --code CODE --fingerprint FP`, `list`, `status`, `ship`,
`start-worker`, `logs`, `samples`, `clocks`, `tune`. Every command takes `--json` for the app, which runs them as subprocesses
(it never imports the engine): one JSON object on stdout, `{"ok": false, "error": ..., "code": ...}` on failure.
"""

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable

from engine.node.errors import NodeCliError
from engine.node.tune_defaults import DEFAULT_ANSWER, DEFAULT_MIX
from engine.node.wire import DEFAULT_PORT
from installer.version import __version__

PROG = "strata-node"


def _range(text: str) -> range:
    a, sep, b = text.partition("-")
    if not sep or not a.isdigit() or not b.isdigit() or not 0 < int(a) <= int(b) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range like 7470-7489")
    return range(int(a), int(b) + 1)


def _pair_list(text: str) -> list[int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX in MHz (e.g. 1500,1905)")
    lo, hi = int(parts[0]), int(parts[1])
    if lo > hi:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must not be above MAX")
    return [lo, hi]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="PolyStrata node agent: lends this PC's GPUs to a main PC, and manages worker PCs.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--data-dir", help="data folder (default: PolyStrata's; also $STRATA_DATA_DIR)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def cmd(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", help="one JSON object on stdout (for the app)")
        return sp

    inv = cmd("inventory", "print this PC and its GPUs as the agent reports them")
    inv.add_argument(
        "--samples", action="store_true", help="include live clocks, P-state and clock-event reasons"
    )

    sv = cmd("serve", "run the agent on this PC (prints its key fingerprint and pairing code)")
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on: this PC's LAN address (e.g. 192.168.1.20), or 0.0.0.0 for all; default "
        "127.0.0.1 (this PC only)",
    )
    sv.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"control port (default {DEFAULT_PORT}; PORT+1 too)"
    )
    sv.add_argument("--name", default="", help="the name the main PC shows (default: the host name)")
    sv.add_argument(
        "--worker-ports", type=_range, help="ports for stage workers (default PORT+10 to PORT+29)"
    )
    sv.add_argument(
        "--model-dir", action="append", default=[], help="another folder with model files workers may use"
    )
    sv.add_argument("--no-mdns", action="store_true", help="do not advertise this agent on the LAN (mDNS)")

    cmd("local", "this PC's agent: fingerprint, pairing code, paired main")
    cmd("unpair", "on this (worker) PC: forget the paired main PC; the agent shows a new pairing code")

    idf = cmd("identify", "ask an agent for its name, version and key fingerprint (no pairing needed)")
    idf.add_argument("address", help="HOST or HOST:PORT")

    dc = cmd("discover", "list the agents that advertise themselves on the LAN (mDNS; a hint only)")
    dc.add_argument("--timeout", type=float, default=2.0, help="seconds to listen (default 2)")
    dc.add_argument("--interface", action="append", default=None, help="an address to listen on (repeatable)")

    pr = cmd("pair", "pair this main PC with an agent (code and fingerprint as the worker PC shows them)")
    pr.add_argument("address", help="HOST or HOST:PORT of the agent")
    pr.add_argument("--code", required=True, help="the pairing code the agent shows")
    pr.add_argument(
        "--fingerprint", help="the key fingerprint the agent shows (asked interactively when left out)"
    )
    pr.add_argument("--id-port", type=int, help="the agent's identity port (default PORT+1)")

    cmd("list", "the paired worker PCs (no network)")
    st = cmd("status", "health of the paired worker PCs: reachable, GPUs, workers, or what fails where")
    st.add_argument("node", nargs="?", help="one PC (name, HOST:PORT or fingerprint); default all")
    st.add_argument("--timeout", type=float, default=3.0)

    for name, what in (("include", "use"), ("exclude", "do not use")):
        x = cmd(name, f"{what} a paired PC in configs and the tuner")
        x.add_argument("node")
    fg = cmd("forget", "unpair a worker PC: it forgets this main, this main forgets it")
    fg.add_argument("node")
    fg.add_argument("--local-only", action="store_true", help="only forget it here (the PC is gone)")

    fl = cmd("files", "the model files on a worker PC")
    fl.add_argument("node")

    sh = cmd("ship", "send a worker PC the layers it needs of a model (resumes; verified by SHA-256)")
    sh.add_argument("node")
    sh.add_argument("--model", required=True, help="the GGUF file on this PC")
    sh.add_argument("--begin", type=int, required=True, help="first layer the worker runs")
    sh.add_argument("--end", type=int, help="layer after its last (default: the model's last + 1)")
    sh.add_argument("--name", help="file name on the worker (default: <model>.L<begin>-<end>.gguf)")

    sw = cmd("start-worker", "start a stage worker on a worker PC")
    sw.add_argument("node")
    sw.add_argument("--model", required=True, help="a file name on the worker PC (see `files`)")
    sw.add_argument("--begin", type=int, required=True)
    sw.add_argument("--end", type=int)
    sw.add_argument("--next", help="HOST:PORT of the next stage (relay)")
    sw.add_argument("--next-key", help="the next stage's worker key (relay); write --next-key=KEY")
    sw.add_argument("--port", type=int, default=0, help="0: the agent picks one of its worker ports")
    sw.add_argument("--bind", help="address the worker listens on (default: the agent's)")
    sw.add_argument("--gpu", type=int)
    sw.add_argument("--lock-clocks", action="store_true", help="lock this GPU's clocks while the worker runs")
    sw.add_argument("--timing", action="store_true", help="STRATA_REMOTE_TIMING=1 for the worker")
    sw.add_argument(
        "flags", nargs=argparse.REMAINDER, help="-- then whitelisted engine flags, e.g. -- --kv int8"
    )

    sc = cmd(
        "start-workers",
        "start the workers a config lists, in chain order; prints the main engine's key flags",
    )
    sc.add_argument("--config", required=True, help='a strata-<model>.json with "workers"')
    sc.add_argument("--lock-clocks", action="store_true", help="lock each worker GPU's clocks while it runs")
    sc.add_argument(
        "flags", nargs=argparse.REMAINDER, help="-- then whitelisted worker flags, e.g. -- --kv int8"
    )

    sp = cmd("stop-worker", "stop a stage worker")
    sp.add_argument("node")
    sp.add_argument("id")
    wk = cmd("workers", "the stage workers on a worker PC")
    wk.add_argument("node")
    lg = cmd("logs", "a worker's log lines")
    lg.add_argument("node")
    lg.add_argument("id")
    lg.add_argument("--since", type=int, default=0)
    lg.add_argument(
        "--follow", "-f", action="store_true", help="keep printing new lines until the worker ends"
    )

    sa = cmd("samples", "a worker PC's live GPU state (clocks, P-state, clock-event reasons, use, VRAM)")
    sa.add_argument("node")
    sa.add_argument(
        "--follow", "-f", action="store_true", help="keep printing each new batch (one JSON line per batch)"
    )

    ck = cmd(
        "clocks",
        "lock or reset the GPU clocks of a worker PC, or of this PC with --here (needs administrator / root there)",
    )
    ck.add_argument("node", nargs="?", help="the worker PC (name, HOST:PORT or fingerprint)")
    ck.add_argument("--here", action="store_true", help="this PC's GPU, through NVML in this process")
    ck.add_argument("--gpu", type=int, default=0)
    grp = ck.add_mutually_exclusive_group(required=True)
    grp.add_argument("--lock", action="store_true")
    grp.add_argument("--reset", action="store_true")
    ck.add_argument("--sm", type=_pair_list, help="SM clock MIN,MAX in MHz (default 80-100%% of the maximum)")
    ck.add_argument("--mem", type=_pair_list, help="memory clock MIN,MAX in MHz (default: its maximum)")

    add_tune_args(cmd("tune", "measure splits and prompt chunk sizes on the worker PCs; write the config"))
    return p


# ---------------------------------------------------------------------------------------------------------------


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the GGUF model file on this (main) PC")
    p.add_argument(
        "--node",
        action="append",
        default=[],
        help="a paired worker PC, in stage order (default: all included)",
    )
    p.add_argument(
        "--split",
        action="append",
        default=[],
        help="a split to try, e.g. 24 or 24,40 (repeatable; default: 5 around the even split)",
    )
    p.add_argument(
        "--chunk", action="append", type=int, default=[], help="a prompt chunk size to try (repeatable)"
    )
    p.add_argument(
        "--mix",
        default=",".join(f"{n}:{w}" for n, w in DEFAULT_MIX),
        help="workload: TOKENS:WEIGHT,... (default 8192:0.3,32768:0.5,102400:0.2, scaled to the context)",
    )
    p.add_argument("--answer-tokens", type=int, default=DEFAULT_ANSWER)
    p.add_argument(
        "--max-context", type=int, help="the main engine's context (default: the model's, at most 131072)"
    )
    p.add_argument("--lock-clocks", action="store_true", help="lock each worker GPU's clocks while measuring")
    p.add_argument(
        "--config", help="config file to write (default: strata-<model>.json in the config folder)"
    )
    p.add_argument("--report", help="report file (Markdown; a .json beside it)")
    p.add_argument("--device", default="auto", help="the main stage's device here: auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="compute type: auto, f32, bf16, f16")
    p.add_argument(
        "worker_flags",
        nargs=argparse.REMAINDER,
        help="-- then whitelisted worker flags for every worker, e.g. -- --kv int8",
    )


# Each command's function, as "module:function": imported when that command runs (pyzmq, NVML, torch load then, not
# for --help).
COMMANDS = {
    **dict.fromkeys(("inventory", "serve", "local", "unpair", "samples", "clocks"), "engine.node.cli_local"),
    **dict.fromkeys(
        (
            "identify",
            "discover",
            "pair",
            "list",
            "status",
            "include",
            "exclude",
            "forget",
            "files",
            "ship",
            "start-worker",
            "start-workers",
            "stop-worker",
            "workers",
            "logs",
        ),
        "engine.node.cli_remote",
    ),
    "tune": "engine.node.tuner",
}


def command(name: str) -> Callable[[argparse.Namespace], int]:
    module = importlib.import_module(COMMANDS[name])
    if name in ("include", "exclude"):
        return lambda a: module.cmd_include(a, name == "include")  # type: ignore[no-any-return]
    return getattr(module, "cmd_" + name.replace("-", "_"))  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ["STRATA_DATA_DIR"] = args.data_dir
    if not args.command:
        parser.print_help()
        return 0
    try:
        return command(args.command)(args)
    except KeyboardInterrupt:
        return 130
    except (NodeCliError, OSError, ValueError) as exc:  # ShardError and KeyFileError: ValueErrors
        code = getattr(exc, "code", "failed")
        if getattr(args, "json", False):
            print(
                json.dumps(
                    {"ok": False, "error": str(exc), "code": code if isinstance(code, str) else "failed"}
                )
            )
        else:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
