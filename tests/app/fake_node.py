"""A stand-in for `strata-node` in the worker-page tests, answering its `--json` commands.

FAKE_NODE_SERVE=1: it has a `serve` command that prints the agent's JSON lines (pairing code, then ready with address
and key fingerprint) and runs until stopped; without, only `inventory` and the worker-PC commands.
FAKE_NODE_STATE=FILE: a JSON file {"nodes": [...], "agents": [...]} that `status`, `discover`, `pair`, `include` and
`exclude` read and write, shaped as the real agent's answers.
FAKE_NODE_LOG=FILE: each command line is appended to it. `samples NODE --follow` fails as an unreachable PC does;
`clocks` answers as the real command does on a PC where the agent lacks administrator rights, or, with
FAKE_NODE_ADMIN=1, where it has them.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def _state() -> tuple[Path | None, dict]:
    path = os.environ.get("FAKE_NODE_STATE")
    if not path:
        return None, {"nodes": [], "agents": []}
    p = Path(path)
    return p, json.loads(p.read_text()) if p.exists() else {"nodes": [], "agents": []}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="strata-node")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("inventory")
    if os.environ.get("FAKE_NODE_SERVE") == "1":
        s = sub.add_parser("serve")
        s.add_argument("--json", action="store_true")
        s.add_argument("--host", default="127.0.0.1")
    for name in ("status", "discover"):
        c = sub.add_parser(name)
        c.add_argument("--json", action="store_true")
        c.add_argument("--timeout", default="2")
    pair = sub.add_parser("pair")
    pair.add_argument("address")
    pair.add_argument("--code", required=True)
    pair.add_argument("--fingerprint", required=True)
    pair.add_argument("--json", action="store_true")
    for name in ("include", "exclude"):
        c = sub.add_parser(name)
        c.add_argument("node")
        c.add_argument("--json", action="store_true")
    sa = sub.add_parser("samples")
    sa.add_argument("node")
    sa.add_argument("--follow", action="store_true")
    sa.add_argument("--json", action="store_true")
    ck = sub.add_parser("clocks")
    ck.add_argument("node", nargs="?")
    ck.add_argument("--here", action="store_true")
    ck.add_argument("--gpu", type=int, default=0)
    ck.add_argument("--lock", action="store_true")
    ck.add_argument("--reset", action="store_true")
    ck.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    log = os.environ.get("FAKE_NODE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(" ".join(argv) + "\n")
    path, state = _state()
    if args.command == "samples":
        error = (
            f"{args.node} (192.168.1.30:7460) does not answer: tcp://192.168.1.30:7460 timed out after 10 s"
        )
        print(json.dumps({"ok": False, "error": error, "code": "unreachable"}))
        return 1
    if args.command == "clocks":
        where = "this PC" if args.here else args.node
        if os.environ.get("FAKE_NODE_ADMIN") == "1":
            res = {"gpu": args.gpu, "locked": True, "detail": "locked: SM 1680-2100 MHz, memory 9501 MHz"}
            print(json.dumps({"ok": True, "clocks": res}))
            return 0
        error = (
            f"GPU {args.gpu} of {where}: NOT locked: no permission to change clocks; run the agent as administrator "
            f"(Windows) or as root (Linux; `sudo strata-node serve`), or run `nvidia-smi -i {args.gpu} -lgc "
            "1680,2100` yourself in an administrator / root shell"
        )
        print(json.dumps({"ok": False, "error": error, "code": "not_locked"}))
        return 1
    if args.command == "serve":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        fp = "3F2A-91C0-7B1E-55D0"
        print(json.dumps({"event": "code", "code": "482-913", "fingerprint": fp}), flush=True)
        print("strata-node: advertising on the LAN (mDNS)", file=sys.stderr, flush=True)
        ready = {
            "event": "ready",
            "host": args.host,
            "port": 7460,
            "fingerprint": fp,
            "pairing_code": "482-913",
        }
        print(json.dumps(ready), flush=True)
        while True:
            time.sleep(0.2)
    if args.command == "status":
        print(json.dumps({"ok": True, "nodes": state["nodes"]}))
    elif args.command == "discover":
        print(json.dumps({"ok": True, "agents": state["agents"]}))
    elif args.command == "pair":
        if args.code != "482-913":
            print(json.dumps({"ok": False, "error": f"the agent at {args.address} refused code {args.code}"}))
            return 1
        node = {
            "name": "pc-b",
            "address": args.address,
            "fingerprint": args.fingerprint,
            "included": True,
            "reachable": True,
            "problem": "",
            "gpu": {"gpus": [{"name": "NVIDIA GeForce RTX 3070"}]},
        }
        state["nodes"].append(node)
        state["agents"] = [a for a in state["agents"] if a.get("fingerprint") != args.fingerprint]
        if path is not None:
            path.write_text(json.dumps(state))
        print(json.dumps({"ok": True, "node": node}))
    elif args.command in ("include", "exclude"):
        for n in state["nodes"]:
            if args.node in (n["fingerprint"], n["name"]):
                n["included"] = args.command == "include"
        if path is not None:
            path.write_text(json.dumps(state))
        print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
