"""The `strata-node` commands of the main PC about its paired worker PCs: find and pair them, ship layers, start and
stop workers, read their logs. engine/node/cli.py loads this module when one of them runs."""

import argparse
import json
import platform
import sys
from pathlib import Path

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
from engine.node.cli_common import CliError, client, hostport, out, registry
from engine.node.client import NodeClient, NodeError, identify, node_status, pair
from engine.node.discovery import discover
from engine.node.shipper import ship
from engine.node.wire import DEFAULT_PORT
from installer.config import read_config


def cmd_identify(args: argparse.Namespace) -> int:

    host, port = hostport(args.address, DEFAULT_PORT)
    ident = identify(host, port)
    out(
        args,
        ident.to_dict(),
        f"{ident.name} at {host}:{ident.port}: strata-node {ident.version}, key fingerprint {ident.fingerprint}",
    )
    return 0


def cmd_discover(args: argparse.Namespace) -> int:
    found = discover(args.timeout, args.interface)
    paired = {n.public_key: n for n in registry().load()}
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
    out(args, {"agents": rows}, "\n".join(lines) or "no agent found (mDNS); add a PC by its address")
    return 0


def cmd_pair(args: argparse.Namespace) -> int:
    host, port = hostport(args.address, DEFAULT_PORT)
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
    out(args, {"node": rec.to_dict()}, f"paired with {rec.name} at {rec.address} (key {rec.fingerprint})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    nodes = registry().load()
    lines = [f"{n.name} {n.address} key {n.fingerprint}{'' if n.included else ' (excluded)'}" for n in nodes]
    out(args, {"nodes": [n.to_dict() for n in nodes]}, "\n".join(lines) or "no worker PC is paired")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    reg = registry()
    nodes = [reg.find(args.node)] if args.node else reg.load()
    rows = [node_status(n, timeout=args.timeout) for n in nodes]
    lines = []
    for r in rows:
        if r["reachable"]:
            gpus = ", ".join(g["name"] for g in (r.get("gpu") or {}).get("gpus", [])) or "no NVIDIA GPU"
            lines.append(f"{r['name']} {r['address']}: ok, {gpus}, {len(r.get('workers') or [])} worker(s)")
        else:
            lines.append(f"{r['name']} {r['address']}: {r['problem']}")
    out(args, {"nodes": rows}, "\n".join(lines) or "no worker PC is paired")
    return 0


def cmd_include(args: argparse.Namespace, included: bool) -> int:
    reg = registry()
    rec = reg.set_included(reg.find(args.node), included)
    out(args, {"node": rec.to_dict()}, f"{rec.name} {'included' if included else 'excluded'}")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    reg = registry()
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
    out(args, {"node": rec.to_dict(), "agent_told": told}, f"forgot {rec.name} ({rec.address})")
    return 0


def cmd_files(args: argparse.Namespace) -> int:
    with client(args.node) as c:
        res = c.files()
    lines = [f"{f['name']} {f['size']} bytes{'' if f['complete'] else ' (partial)'}" for f in res["files"]]
    out(args, res, "\n".join(lines) or "no model file on that PC")
    return 0


def cmd_ship(args: argparse.Namespace) -> int:
    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if args.json and pct != last[0]:
            # a JSON line per percent, before the answer (the app's progress bar)
            last[0] = pct
            print(json.dumps({"ok": True, "progress": {"done": done, "total": total}}), flush=True)
        elif not args.json and pct != last[0] and (pct % 5 == 0 or done == total):
            last[0] = pct
            print(
                f"\r{done / 2**20:.1f} of {total / 2**20:.1f} MiB ({pct}%)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    with client(args.node, timeout=30.0) as c:
        res = ship(c, args.model, args.begin, args.end, args.name, progress)
    if not args.json:
        print(file=sys.stderr)
    how = "already there" if res.already_there else f"sent {res.sent} bytes (resumed at {res.resumed_from})"
    out(args, {"ship": res.to_dict()}, f"{res.name}: {res.size} bytes, sha256 {res.sha256}: {how}")
    return 0


def cmd_start_worker(args: argparse.Namespace) -> int:
    flags = list(args.flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    with client(args.node, timeout=30.0) as c:
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
    out(args, {"worker": w}, text)
    return 0


def cmd_start_workers(args: argparse.Namespace) -> int:
    cfg = read_config(Path(args.config))
    if not cfg.workers:
        raise CliError(f'{Path(args.config).name} lists no "workers": nothing to start', "no_workers")
    flags = list(args.flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    reg = registry()
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
    out(args, data, text)
    return 0


def cmd_stop_worker(args: argparse.Namespace) -> int:
    with client(args.node, timeout=30.0) as c:
        w = c.stop_worker(args.id)
    out(args, {"worker": w}, f"worker {w['id']}: {w['state']} (exit code {w['exit_code']})")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with client(args.node) as c:
        ws = c.workers()
    lines = [f"{w['id']} {w['state']} layers {w['begin']}-{w['end']} on {w['bind']}:{w['port']}" for w in ws]
    out(args, {"workers": ws}, "\n".join(lines) or "no worker")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    since = args.since
    with client(args.node) as c:
        while True:
            res = c.logs(args.id, since, 10_000 if args.follow else 0)
            if args.json and not args.follow:
                out(args, res, "")
                return 0
            for line in res["lines"]:
                print(json.dumps({"line": line}) if args.json else line, flush=True)
            since = res["next"]
            if not args.follow or (res["state"] in ("exited", "stopped") and not res["lines"]):
                return 0
