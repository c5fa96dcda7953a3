"""The `strata-node` commands about this PC: its GPUs (inventory, samples, clocks), and its agent (serve, local,
unpair). engine/node/cli.py loads this module when one of them runs."""

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from engine.node import gpu as gpu_mod
from engine.node.agent import Agent, AgentError, AgentOptions, is_loopback
from engine.node.cli_common import PROG, CliError, client, out, registry
from engine.node.gpu import gpu_report, pc_report
from engine.node.keys import KeyPair, load_or_create_keypair, read_json
from installer import paths


def cmd_inventory(args: argparse.Namespace) -> int:

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
    out(args, info, "\n".join(lines))
    return 0


def _agent_dir() -> Path:
    return paths.data_dir() / "node"


def cmd_serve(args: argparse.Namespace) -> int:
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
    d = _agent_dir()
    state = read_json(d / "agent.json") or {}
    running = False
    pid = state.get("pid")
    if isinstance(pid, int):
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
    out(args, data, text)
    return 0


def cmd_unpair(args: argparse.Namespace) -> int:
    path = _agent_dir() / "paired.json"
    existed = path.exists()
    path.unlink(missing_ok=True)
    out(
        args,
        {"unpaired": existed},
        "unpaired: a running agent shows a new pairing code" if existed else "this agent was not paired",
    )
    return 0


def _gpu_facts(info: dict[str, Any]) -> list[dict[str, Any]]:
    """What does not change between samples: each card's name, top SM clock and VRAM."""
    keep = ("index", "name", "max_sm_mhz", "vram_total")
    return [{k: g.get(k) for k in keep} for g in (info.get("gpu") or {}).get("gpus", [])]


def cmd_samples(args: argparse.Namespace) -> int:
    """The agent's GPU samples: first the cards (and why there are none), then batches as the agent takes them
    (a long poll: each batch comes as soon as the agent has one). An agent that restarted counts again from 0."""
    rec = registry().find(args.node)
    with client(args.node, timeout=10.0) as c:
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
    out(args, {**head, **res}, "\n".join(lines))
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
        rec = registry().find(args.node)
        with client(args.node, timeout=30.0) as c:
            res = c.lock_clocks(args.gpu, args.sm, args.mem) if args.lock else c.reset_clocks(args.gpu)
        where = f"{rec.name} ({rec.address})"
    if res["locked"] != bool(args.lock):
        raise CliError(
            f"GPU {res['gpu']} of {where}: {res['detail']}", "not_locked" if args.lock else "not_reset"
        )
    out(args, {"clocks": res}, f"GPU {res['gpu']}: {res['detail']}")
    return 0
