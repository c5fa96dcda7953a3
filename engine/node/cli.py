"""`strata-node`: the agent that lends this PC's GPUs to a PolyStrata main PC, and the main PC's commands for them.

On a worker PC: `strata-node serve --host 192.168.1.20` (prints the key fingerprint and the pairing code).
On the main PC: `strata-node discover`, `pair HOST --code CODE --fingerprint FP`, `list`, `status`, `ship`,
`start-worker`, `logs`, `samples`, `clocks`, `tune`. Every command takes `--json` for the app, which runs them as subprocesses
(it never imports the engine): one JSON object on stdout, `{"ok": false, "error": ..., "code": ...}` on failure.
"""

import argparse
import json
import os
import platform
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from installer.version import __version__

PROG = "strata-node"


class CliError(RuntimeError):
    def __init__(self, message: str, code: str = "failed") -> None:
        super().__init__(message)
        self.code = code


def _hostport(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if port and not port.isdigit():
        raise CliError(f"{text!r} is not HOST or HOST:PORT (e.g. 192.168.1.20:7460)", "bad_address")
    p = int(port) if port else default_port
    if not host or not 0 < p < 65536:
        raise CliError(f"{text!r} is not HOST or HOST:PORT (e.g. 192.168.1.20:7460)", "bad_address")
    return host, p


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
    from engine.node.wire import DEFAULT_PORT

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

    from engine.node.tuner import add_tune_args

    add_tune_args(cmd("tune", "measure splits and prompt chunk sizes on the worker PCs; write the config"))
    return p


# ---------------------------------------------------------------------------------------------------------------


def _out(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"ok": True, **data}, default=str))
    else:
        print(text)


def _registry() -> Any:
    from engine.node.client import NodeRegistry

    return NodeRegistry()


def _client(ref: str, timeout: float = 10.0) -> Any:
    from engine.node.client import NodeClient

    return NodeClient.for_record(_registry().find(ref), timeout=timeout)


def cmd_inventory(args: argparse.Namespace) -> int:
    from engine.node.gpu import gpu_report, pc_report

    rep = gpu_report()
    info = {"pc": pc_report(), "gpu": rep}
    if not args.samples:
        for g in rep["gpus"]:
            g.pop("state", None)
    lines = [f"{k}: {v}" for k, v in info["pc"].items()]
    lines.append(f"gpus: {rep['message'] or rep['status']}")
    for g in rep["gpus"]:
        lines.append(
            f"  GPU {g['index']}: {g['name']}, {round(g['vram_total'] / 2**30)} GB, CC {g['compute_capability']}"
        )
    _out(args, info, "\n".join(lines))
    return 0


def _agent_dir() -> Path:
    from installer import paths

    return paths.data_dir() / "node"


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.node.agent import Agent, AgentError, AgentOptions, is_loopback

    def on_event(ev: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(ev), flush=True)
            return
        kind = ev["event"]
        if kind == "ready":
            print(
                f"{PROG}: listening on {ev['host']}:{ev['port']} (identity on port {ev['id_port']})",
                flush=True,
            )
            print(f"{PROG}: key fingerprint {ev['fingerprint']}", flush=True)
            if ev["paired"]:
                print(f"{PROG}: paired; it admits only its main PC's key", flush=True)
            else:
                print(f"{PROG}: pairing code {ev['pairing_code']}", flush=True)
        elif kind == "code":
            print(f"{PROG}: pairing code {ev['code']} (key fingerprint {ev['fingerprint']})", flush=True)
        elif kind == "paired":
            print(
                f"{PROG}: paired with main PC {ev['main_name']!r} (key {ev['main_fingerprint']})", flush=True
            )
        elif kind == "unpaired":
            print(f"{PROG}: unpaired; a new pairing code follows", flush=True)

    if args.port < 1 or args.port > 65534:
        raise CliError(f"--port must be 1..65534 (the agent also uses PORT+1), not {args.port}", "bad_port")
    if is_loopback(args.host):
        print(
            f"{PROG}: listening on {args.host} only: other PCs cannot reach this agent. Pass --host with this PC's "
            "LAN address (e.g. --host 192.168.1.20) to lend its GPUs",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"{PROG}: warning: listening on {args.host}, beyond this PC. The channel is encrypted (CURVE) and, once "
            "paired, admits only the paired main PC's key; workers it starts listen on the LAN too",
            file=sys.stderr,
            flush=True,
        )
    opts = AgentOptions(
        data_dir=_agent_dir(),
        host=args.host,
        port=args.port,
        name=args.name,
        worker_ports=args.worker_ports,
        model_dirs=tuple(Path(d) for d in args.model_dir),
        advertise=not args.no_mdns,
        on_event=on_event,
    )
    try:
        agent = Agent(opts)
        agent.bind()
    except AgentError as exc:
        raise CliError(str(exc), "bind_failed") from None
    stop = threading.Event()

    def _handler(signum: int, frame: object) -> None:
        agent.stop()
        stop.set()

    signal.signal(signal.SIGINT, _handler)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _handler)
    try:
        agent.serve_forever()
    finally:
        agent.close()
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from engine.node.keys import KeyPair, load_or_create_keypair, read_json

    d = _agent_dir()
    state = read_json(d / "agent.json") or {}
    running = False
    pid = state.get("pid")
    if isinstance(pid, int):
        import psutil

        running = psutil.pid_exists(pid)
    keys: KeyPair = load_or_create_keypair(d / "agent-key.json")
    paired = read_json(d / "paired.json")
    data = {
        "running": running,
        "fingerprint": keys.fingerprint,
        "pairing_code": state.get("pairing_code") if running else None,
        "host": state.get("host") if running else None,
        "port": state.get("port") if running else None,
        "paired": isinstance(paired, dict),
        "paired_main_name": paired.get("main_name") if isinstance(paired, dict) else None,
    }
    text = f"agent {'running' if running else 'not running'}; key fingerprint {keys.fingerprint}"
    if data["pairing_code"]:
        text += f"; pairing code {data['pairing_code']}"
    if data["paired"]:
        text += f"; paired with {data['paired_main_name'] or 'a main PC'}"
    _out(args, data, text)
    return 0


def cmd_unpair(args: argparse.Namespace) -> int:
    path = _agent_dir() / "paired.json"
    existed = path.exists()
    path.unlink(missing_ok=True)
    _out(
        args,
        {"unpaired": existed},
        "unpaired: a running agent shows a new pairing code" if existed else "this agent was not paired",
    )
    return 0


def cmd_identify(args: argparse.Namespace) -> int:
    from engine.node.client import identify
    from engine.node.wire import DEFAULT_PORT

    host, port = _hostport(args.address, DEFAULT_PORT)
    ident = identify(host, port)
    _out(
        args,
        ident.to_dict(),
        f"{ident.name} at {host}:{ident.port}: strata-node {ident.version}, key fingerprint {ident.fingerprint}",
    )
    return 0


def cmd_discover(args: argparse.Namespace) -> int:
    from engine.node.client import NodeError, identify
    from engine.node.discovery import discover

    found = discover(args.timeout, args.interface)
    paired = {n.public_key: n for n in _registry().load()}
    rows = []
    for f in found:
        row = f.to_dict()
        row["answers_fingerprint"] = None
        for addr in f.addresses:
            try:
                ident = identify(addr, f.port, 1.5, f.id_port)
            except NodeError:
                continue
            row.update(
                answers_fingerprint=ident.fingerprint,
                address=addr,
                advert_matches=ident.fingerprint == f.fingerprint,
                paired=ident.public_key in paired,
            )
            break
        rows.append(row)
    lines = []
    for r in rows:
        mark = ""
        if r["answers_fingerprint"] is None:
            mark = " (does not answer)"
        elif not r["advert_matches"]:
            mark = f" (WARNING: advertises {r['fingerprint']} but answers with {r['answers_fingerprint']})"
        elif r.get("paired"):
            mark = " (paired)"
        lines.append(
            f"{r['name']} {','.join(r['addresses'])}:{r['port']} key {r['fingerprint']} [{r['gpus']}]{mark}"
        )
    _out(args, {"agents": rows}, "\n".join(lines) or "no agent found (mDNS); add a PC by its address")
    return 0


def cmd_pair(args: argparse.Namespace) -> int:
    from engine.node.client import identify, pair
    from engine.node.wire import DEFAULT_PORT

    host, port = _hostport(args.address, DEFAULT_PORT)
    fp = args.fingerprint
    if not fp:
        if args.json or not sys.stdin.isatty():
            raise CliError(
                "--fingerprint is needed: the key fingerprint the worker PC shows", "fingerprint_needed"
            )
        ident = identify(host, port, 5.0, args.id_port)
        answer = input(
            f"{ident.name} at {host}:{ident.port} has key fingerprint {ident.fingerprint}.\n"
            "Is this the fingerprint the worker PC shows? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            raise CliError("pairing cancelled: the fingerprint was not confirmed", "cancelled")
        fp = ident.fingerprint
    rec = pair(host, port, args.code, fp, main_name=platform.node(), id_port=args.id_port)
    _out(args, {"node": rec.to_dict()}, f"paired with {rec.name} at {rec.address} (key {rec.fingerprint})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    nodes = _registry().load()
    lines = [f"{n.name} {n.address} key {n.fingerprint}{'' if n.included else ' (excluded)'}" for n in nodes]
    _out(args, {"nodes": [n.to_dict() for n in nodes]}, "\n".join(lines) or "no worker PC is paired")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from engine.node.client import node_status

    reg = _registry()
    nodes = [reg.find(args.node)] if args.node else reg.load()
    rows = [node_status(n, timeout=args.timeout) for n in nodes]
    lines = []
    for r in rows:
        if r["reachable"]:
            gpus = ", ".join(g["name"] for g in (r.get("gpu") or {}).get("gpus", [])) or "no NVIDIA GPU"
            lines.append(f"{r['name']} {r['address']}: ok, {gpus}, {len(r.get('workers') or [])} worker(s)")
        else:
            lines.append(f"{r['name']} {r['address']}: {r['problem']}")
    _out(args, {"nodes": rows}, "\n".join(lines) or "no worker PC is paired")
    return 0


def cmd_include(args: argparse.Namespace, included: bool) -> int:
    reg = _registry()
    rec = reg.set_included(reg.find(args.node), included)
    _out(args, {"node": rec.to_dict()}, f"{rec.name} {'included' if included else 'excluded'}")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from engine.node.client import NodeClient, NodeError

    reg = _registry()
    rec = reg.find(args.node)
    told = False
    if not args.local_only:
        try:
            with NodeClient.for_record(rec, timeout=5.0) as c:
                c.unpair()
                told = True
        except NodeError as exc:
            raise CliError(
                f"{exc}. Use --local-only to forget it here anyway (then run `strata-node unpair` on that PC)",
                exc.code,
            ) from None
    reg.remove(rec)
    _out(args, {"node": rec.to_dict(), "agent_told": told}, f"forgot {rec.name} ({rec.address})")
    return 0


def cmd_files(args: argparse.Namespace) -> int:
    with _client(args.node) as c:
        res = c.files()
    lines = [f"{f['name']} {f['size']} bytes{'' if f['complete'] else ' (partial)'}" for f in res["files"]]
    _out(args, res, "\n".join(lines) or "no model file on that PC")
    return 0


def cmd_ship(args: argparse.Namespace) -> int:
    from engine.node.shipper import ship

    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if not args.json and pct != last[0] and (pct % 5 == 0 or done == total):
            last[0] = pct
            print(
                f"\r{done / 2**20:.1f} of {total / 2**20:.1f} MiB ({pct}%)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    with _client(args.node, timeout=30.0) as c:
        res = ship(c, args.model, args.begin, args.end, args.name, progress)
    if not args.json:
        print(file=sys.stderr)
    how = "already there" if res.already_there else f"sent {res.sent} bytes (resumed at {res.resumed_from})"
    _out(args, {"ship": res.to_dict()}, f"{res.name}: {res.size} bytes, sha256 {res.sha256}: {how}")
    return 0


def cmd_start_worker(args: argparse.Namespace) -> int:
    flags = list(args.flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    with _client(args.node, timeout=30.0) as c:
        w = c.start_worker(
            model=args.model,
            begin=args.begin,
            end=args.end,
            next=args.next,
            next_key=args.next_key,
            port=args.port,
            bind=args.bind,
            gpu=args.gpu,
            lock_clocks=args.lock_clocks or None,
            timing=args.timing or None,
            flags=flags,
        )
    clocks = (w.get("clocks") or {}).get("detail")
    text = f"worker {w['id']} ({w['state']}) on {w['bind']}:{w['port']}, key {w['public_key']}"
    if clocks:
        text += f"; clocks {clocks}"
    _out(args, {"worker": w}, text)
    return 0


def cmd_start_workers(args: argparse.Namespace) -> int:
    from engine.node.chain import (
        ChainError,
        Link,
        engine_flags,
        node_for_worker,
        pick_model,
        start_chain,
        stop_chain,
        wait_listening,
    )
    from engine.node.client import NodeClient
    from installer.config import read_config

    cfg = read_config(Path(args.config))
    if not cfg.workers:
        raise CliError(f'{Path(args.config).name} lists no "workers": nothing to start', "no_workers")
    flags = list(args.flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    reg = _registry()
    model = Path(cfg.model)
    links: list[Link] = []
    try:
        for w in cfg.workers:
            rec = node_for_worker(reg.load(), w.host, w.port)
            if not rec.included:
                raise CliError(
                    f"{rec.name} ({rec.address}) is excluded: include it or change the config", "excluded"
                )
            client = NodeClient.for_record(rec, timeout=30.0)
            links.append(Link(rec, client, "", port=w.port))
            info = client.info()
            links[-1].windows = str((info.get("pc") or {}).get("os", "")).lower().startswith("windows")
            name = pick_model(client.files()["files"], model, w.begin, w.end)
            if name is None:
                raise CliError(
                    f"{rec.name} has no file with layers {w.begin}-{w.end - 1} of {model.name}: ship them first "
                    f"(strata-node ship {rec.name} --model {model} --begin {w.begin} --end {w.end})",
                    "not_shipped",
                )
            links[-1].model = name
        split = tuple(w.begin for w in cfg.workers)
        warnings = start_chain(links, split, flags, args.lock_clocks)
        try:
            for link in links:
                wait_listening(link)
        except ChainError:
            stop_chain(links)
            raise
        rows = [
            {
                "node": link.rec.name,
                "address": link.rec.address,
                "model": link.model,
                "begin": w.begin,
                "end": w.end,
                **{k: (link.worker or {}).get(k) for k in ("id", "port", "public_key", "clocks")},
            }
            for link, w in zip(links, cfg.workers, strict=True)
        ]
        data = {"workers": rows, "engine_flags": engine_flags(links), "warnings": warnings}
    except ChainError as exc:
        raise CliError(str(exc), "worker_failed") from None
    finally:
        for link in links:
            link.client.close()
    text = "\n".join(f"{r['node']}: worker {r['id']} on port {r['port']} ({r['model']})" for r in rows)
    text += "\nmain engine flags: " + " ".join(data["engine_flags"])
    for w in warnings:
        text += "\n" + w
    _out(args, data, text)
    return 0


def cmd_stop_worker(args: argparse.Namespace) -> int:
    with _client(args.node, timeout=30.0) as c:
        w = c.stop_worker(args.id)
    _out(args, {"worker": w}, f"worker {w['id']}: {w['state']} (exit code {w['exit_code']})")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with _client(args.node) as c:
        ws = c.workers()
    lines = [f"{w['id']} {w['state']} layers {w['begin']}-{w['end']} on {w['bind']}:{w['port']}" for w in ws]
    _out(args, {"workers": ws}, "\n".join(lines) or "no worker")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    since = args.since
    with _client(args.node) as c:
        while True:
            res = c.logs(args.id, since, 10_000 if args.follow else 0)
            if args.json and not args.follow:
                _out(args, res, "")
                return 0
            for line in res["lines"]:
                print(json.dumps({"line": line}) if args.json else line, flush=True)
            since = res["next"]
            if not args.follow or (res["state"] in ("exited", "stopped") and not res["lines"]):
                return 0


def _gpu_facts(info: dict[str, Any]) -> list[dict[str, Any]]:
    """What does not change between samples: each card's name, top SM clock and VRAM."""
    keep = ("index", "name", "max_sm_mhz", "vram_total")
    return [{k: g.get(k) for k in keep} for g in (info.get("gpu") or {}).get("gpus", [])]


def cmd_samples(args: argparse.Namespace) -> int:
    """The agent's GPU samples: first the cards (and why there are none), then batches as the agent takes them
    (a long poll: each batch comes as soon as the agent has one). An agent that restarted counts again from 0."""
    rec = _registry().find(args.node)
    with _client(args.node, timeout=10.0) as c:
        info = c.info()
        gpu = info.get("gpu") or {}
        head = {"node": rec.name, "address": rec.address, "gpus": _gpu_facts(info)}
        head["message"] = gpu.get("message") or ""
        lines = [f"{rec.name} ({rec.address}): {len(head['gpus'])} GPU(s) {head['message']}".rstrip()]
        if args.follow:
            print(json.dumps({"ok": True, **head}) if args.json else lines[0], flush=True)
        since = 0
        while True:
            res = c.gpu_samples(since, 2000 if args.follow else 0)
            if res["next"] < since:  # the agent restarted: its numbering did too
                since = 0
                continue
            since = res["next"]
            if not args.follow:
                break
            if res["samples"]:
                if args.json:
                    print(json.dumps({"ok": True, "samples": res["samples"], "next": since}), flush=True)
                else:
                    for x in res["samples"]:
                        print(_sample_line(x), flush=True)
    lines += [_sample_line(x) for x in res["samples"]]
    _out(args, {**head, **res}, "\n".join(lines))
    return 0


def _sample_line(x: dict[str, Any]) -> str:
    p = f"P{x['pstate']}" if x.get("pstate") is not None else "P?"
    reasons = ", ".join(x.get("reasons") or []) or "none"
    return (
        f"GPU {x.get('index')}: {p}, SM {x.get('sm_mhz')} MHz, memory {x.get('mem_mhz')} MHz, busy "
        f"{x.get('util_gpu')}%, VRAM used {x.get('vram_used')} bytes, clock-event reasons: {reasons}"
    )


def cmd_clocks(args: argparse.Namespace) -> int:
    """Lock or reset; a refusal (no rights, no driver, a card that cannot) is an error with what to do."""
    if args.here == bool(args.node):
        raise CliError("name a worker PC, or give --here for this PC's GPU (one of the two)", "bad_arguments")
    if args.here:
        from engine.node import gpu as gpu_mod

        try:
            session = gpu_mod.Nvml()
        except gpu_mod.NvmlUnavailable as exc:
            raise CliError(f"GPU {args.gpu} of this PC: {exc}", "no_nvml") from None
        try:
            session.handle(args.gpu)
            if args.lock:
                sm = tuple(args.sm) if args.sm else None
                mem = tuple(args.mem) if args.mem else None
                res = session.lock(args.gpu, sm, mem).to_dict()  # type: ignore[arg-type]
            else:
                res = session.reset(args.gpu).to_dict()
        finally:
            session.close()
        where = "this PC"
    else:
        rec = _registry().find(args.node)
        with _client(args.node, timeout=30.0) as c:
            res = c.lock_clocks(args.gpu, args.sm, args.mem) if args.lock else c.reset_clocks(args.gpu)
        where = f"{rec.name} ({rec.address})"
    if res["locked"] != bool(args.lock):
        raise CliError(
            f"GPU {res['gpu']} of {where}: {res['detail']}", "not_locked" if args.lock else "not_reset"
        )
    _out(args, {"clocks": res}, f"GPU {res['gpu']}: {res['detail']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data_dir:
        os.environ["STRATA_DATA_DIR"] = args.data_dir
    if not args.command:
        parser.print_help()
        return 0
    from engine.node.client import NodeError
    from engine.node.keys import KeyFileError
    from engine.node.tuner import TuneError, cmd_tune

    table = {
        "inventory": cmd_inventory,
        "serve": cmd_serve,
        "local": cmd_local,
        "unpair": cmd_unpair,
        "identify": cmd_identify,
        "discover": cmd_discover,
        "pair": cmd_pair,
        "list": cmd_list,
        "status": cmd_status,
        "include": lambda a: cmd_include(a, True),
        "exclude": lambda a: cmd_include(a, False),
        "forget": cmd_forget,
        "files": cmd_files,
        "ship": cmd_ship,
        "start-worker": cmd_start_worker,
        "start-workers": cmd_start_workers,
        "stop-worker": cmd_stop_worker,
        "workers": cmd_workers,
        "logs": cmd_logs,
        "samples": cmd_samples,
        "clocks": cmd_clocks,
        "tune": cmd_tune,
    }
    try:
        return table[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (
        CliError,
        NodeError,
        KeyFileError,
        TuneError,
        OSError,
        ValueError,
    ) as exc:  # ShardError: a ValueError
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
