"""What a paired main may not do to a worker PC: the cases tried, each through the real control channel.

| case | request | expected |
|---|---|---|
| path traversal, absolute paths, folders | upload/delete/start with names like `../x`, `/etc/passwd`, `a/b`, `C:\\x` | refused by the name rule |
| hidden and bookkeeping names | `.bashrc`, `x.part`, `x.json` | refused |
| symlinks | NAME, NAME.part or NAME.part.json a link (to a file outside or inside) | refused, target untouched |
| hard links | NAME.part hard-linked to a file outside | refused, file untouched |
| oversize upload | size above free disk minus the reserve | refused before a byte is written |
| chunk past the declared size / out of order | upload_chunk | refused |
| wrong hash | upload_end after other bytes | refused, partial deleted |
| flags off the whitelist | `--model`, `--config`, `--debug`, `--stage-next`, shell text | refused |
| whitelisted flags with bad values | `--kv q4`, `--max-context -1`, `--prefill 0`, `--device /dev/sda` | refused |
| model outside the folder / missing | `../../etc/passwd`, absent name, a link in the folder | refused |
| bind / port | a foreign address, a port outside the worker range | refused |
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.node.agent import Agent
from engine.node.client import NodeError
from engine.node.keys import KeyPair
from engine.node.store import ModelStore, StoreError
from tests.engine.node.conftest import Paired, pair_with

SHA0 = "0" * 64

BAD_NAMES = [
    "../x.gguf",
    "../../etc/passwd",
    "/etc/passwd",
    "a/b.gguf",
    "a\\b.gguf",
    "C:\\x.gguf",
    "..",
    ".",
    "",
    ".bashrc",
    "x.gguf.part",
    "x.json",
    "x\x00y",
    "a" * 200,
    "-rf",
    "..gguf",
    "NUL.gguf",
    "com1",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:24] for n in BAD_NAMES])
def test_bad_names_are_refused_everywhere(paired: Paired, name: str, tmp_path: Path) -> None:
    c = paired.client
    before = sorted(p.name for p in paired.agent.store.root.iterdir())
    for cmd, args in (
        ("upload_begin", {"name": name, "size": 10, "sha256": SHA0}),
        ("upload_chunk", {"name": name, "offset": 0, "data": b"x"}),
        ("upload_end", {"name": name}),
        ("delete_file", {"name": name}),
        ("start_worker", {"model": name, "begin": 1}),
    ):
        with pytest.raises(NodeError) as err:
            c.call(cmd, args)
        assert err.value.code in ("bad_request", "refused"), (cmd, name)
    assert sorted(p.name for p in paired.agent.store.root.iterdir()) == before


def _outside(tmp_path: Path) -> Path:
    f = tmp_path / "outside.txt"
    f.write_bytes(b"precious")
    return f


@pytest.mark.parametrize("which", ["final", "part", "meta"])
def test_symlinks_in_the_folder_are_refused(paired: Paired, tmp_path: Path, which: str) -> None:
    target = _outside(tmp_path)
    root = paired.agent.store.root
    link = root / {"final": "m.gguf", "part": "m.gguf.part", "meta": "m.gguf.part.json"}[which]
    os.symlink(target, link)
    with pytest.raises(NodeError, match="link") as err:
        paired.client.call("upload_begin", {"name": "m.gguf", "size": 8, "sha256": SHA0})
    assert err.value.code == "refused"
    assert target.read_bytes() == b"precious"
    if which == "final":
        with pytest.raises(NodeError, match="link"):
            paired.client.start_worker(model="m.gguf", begin=1)


def test_hard_link_to_an_outside_file_is_refused(paired: Paired, tmp_path: Path) -> None:
    target = _outside(tmp_path)
    os.link(target, paired.agent.store.root / "m.gguf.part")
    with pytest.raises(NodeError, match="hard link"):
        paired.client.call("upload_begin", {"name": "m.gguf", "size": 8, "sha256": SHA0})
    assert target.read_bytes() == b"precious"


def test_symlinked_model_folder_is_refused(tmp_path: Path, make_agent: Callable[..., Agent]) -> None:

    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "linked")
    with pytest.raises(StoreError, match="real folder"):
        ModelStore(tmp_path / "linked")


def test_oversize_upload_is_refused_before_writing(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent(reserve_bytes=1 << 30)
    p = pair_with(agent)
    free = agent.store.free_bytes()
    with pytest.raises(NodeError, match="free") as err:
        p.client.call("upload_begin", {"name": "big.gguf", "size": free, "sha256": SHA0})
    assert err.value.code == "refused"
    assert not any(agent.store.root.iterdir())
    p.client.close()


def test_uploads_in_progress_keep_their_room_on_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three uploads that each fit the free disk alone must not all start: the later ones count the bytes the
    earlier ones still have to write (once they end, or go stale, the room is free again)."""
    store = ModelStore(tmp_path / "models", reserve_bytes=100)
    monkeypatch.setattr(store, "free_bytes", lambda: 100 + 1500)
    a, b = os.urandom(1000), os.urandom(1000)
    store.begin("a.gguf", 1000, hashlib.sha256(a).hexdigest())
    with pytest.raises(StoreError, match="promised to uploads in progress"):
        store.begin("b.gguf", 1000, hashlib.sha256(b).hexdigest())
    store.chunk("a.gguf", 0, a[:600])
    store.begin("b.gguf", 1000, hashlib.sha256(b).hexdigest())  # a still owes 400: 1000 + 400 fits 1500
    monkeypatch.setattr("engine.node.store.STALE_UPLOAD_S", 0.0)
    store.begin("c.gguf", 1400, SHA0)  # the others went stale: they promise nothing


def test_a_failed_write_keeps_the_bytes_before_it_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ModelStore(tmp_path / "models", reserve_bytes=0)
    data = os.urandom(2000)
    store.begin("m.gguf", 2000, hashlib.sha256(data).hexdigest())
    store.chunk("m.gguf", 0, data[:1000])
    real_write = os.write

    def full(fd: int, view: object) -> int:
        real_write(fd, bytes(view)[:10])  # type: ignore[call-overload]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StoreError, match=r"No space left on device.*ship again to resume"):
        store.chunk("m.gguf", 1000, data[1000:])
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / "models" / "m.gguf.part").stat().st_size == 1000
    assert store.begin("m.gguf", 2000, hashlib.sha256(data).hexdigest())["offset"] == 1000


def test_chunks_must_fit_and_come_in_order_and_hash_must_match(paired: Paired) -> None:
    c, root = paired.client, paired.agent.store.root
    data = os.urandom(1000)
    good = hashlib.sha256(data).hexdigest()
    assert c.call("upload_begin", {"name": "m.gguf", "size": 1000, "sha256": good})["offset"] == 0
    with pytest.raises(NodeError, match="expected byte 0"):
        c.call("upload_chunk", {"name": "m.gguf", "offset": 10, "data": data[10:20]})
    with pytest.raises(NodeError, match="past its declared size"):
        c.call("upload_chunk", {"name": "m.gguf", "offset": 0, "data": data + b"x"})
    c.call("upload_chunk", {"name": "m.gguf", "offset": 0, "data": data[:500]})
    with pytest.raises(NodeError, match="send the rest"):
        c.call("upload_end", {"name": "m.gguf"})
    c.call("upload_chunk", {"name": "m.gguf", "offset": 500, "data": bytes(500)})  # wrong bytes
    with pytest.raises(NodeError, match="SHA-256") as err:
        c.call("upload_end", {"name": "m.gguf"})
    assert err.value.code == "refused"
    assert not (root / "m.gguf").exists() and not (root / "m.gguf.part").exists()
    # Done right, the file lands under its name with the hash the agent computed.
    c.call("upload_begin", {"name": "m.gguf", "size": 1000, "sha256": good})
    c.call("upload_chunk", {"name": "m.gguf", "offset": 0, "data": data})
    assert c.call("upload_end", {"name": "m.gguf"})["sha256"] == good
    assert (root / "m.gguf").read_bytes() == data
    assert c.call("upload_begin", {"name": "m.gguf", "size": 1000, "sha256": good}) == {
        "offset": 1000,
        "complete": True,
    }
    files = {f["name"]: f for f in c.files()["files"]}
    assert files["m.gguf"]["complete"] and files["m.gguf"]["size"] == 1000


# -- worker flags ----------------------------------------------------------------------------------------------

REFUSED_FLAGS = [
    (["--model", "/etc/passwd"], "not allowed"),
    (["--config", "x.json"], "not allowed"),
    (["--debug"], "not allowed"),
    (["--stage-next", "10.0.0.9:7000"], "not allowed"),
    (["--stage-bind", "0.0.0.0"], "not allowed"),
    (["; rm -rf /"], "not allowed"),
    (["--kv", "q4"], "refused"),
    (["--kv"], "needs a value"),
    (["--max-context", "-1"], "refused"),
    (["--max-context=1e9"], "refused"),
    (["--threads", "2"], "not allowed"),
    (["--prefill", "0"], "refused"),
    (["--max-context", "99999999999"], "refused"),
    (["--device", "/dev/sda"], "refused"),
    (["--device", "cuda:99"], "refused"),
    (["--dtype", "$(id)"], "refused"),
]


def _worker_agent(make_agent: Callable[..., Agent], tmp_path: Path) -> Paired:
    """An agent whose 'engine' prints its command line, the key file's content and its key environment."""
    script = (
        "import json, os, sys\n"
        "argv = sys.argv[1:]\n"
        "key = open(argv[argv.index('--stage-key') + 1]).read() if '--stage-key' in argv else ''\n"
        "env = {k: os.environ.get(k) for k in ('STRATA_STAGE_SECRET_KEY', 'STRATA_STAGE_TOKEN', 'STRATA_REMOTE_TIMING')}\n"
        "print(json.dumps({'argv': argv, 'key': key, 'env': env}), flush=True)\n"
    )
    agent = make_agent(engine_command=[sys.executable, "-c", script])
    (agent.store.root / "m.gguf").write_bytes(b"GGUF")
    return pair_with(agent)


@pytest.mark.parametrize("flags,match", REFUSED_FLAGS, ids=[" ".join(f)[:30] for f, _ in REFUSED_FLAGS])
def test_non_whitelisted_flags_are_refused(
    make_agent: Callable[..., Agent], tmp_path: Path, flags: list[str], match: str
) -> None:
    p = _worker_agent(make_agent, tmp_path)
    with pytest.raises(NodeError, match=match) as err:
        p.client.start_worker(model="m.gguf", begin=1, flags=flags)
    assert err.value.code == "refused"
    assert p.client.workers() == []
    p.client.close()


@pytest.mark.parametrize(
    "args,match",
    [
        ({"model": "absent.gguf", "begin": 1}, "not on this PC"),
        ({"model": "m.gguf", "begin": 1, "bind": "203.0.113.9"}, "listens on 127.0.0.1 only"),
        # an agent on loopback used to start a worker on every address when asked
        ({"model": "m.gguf", "begin": 1, "bind": "0.0.0.0"}, "listens on 127.0.0.1 only"),
        ({"model": "m.gguf", "begin": 1, "bind": "localhost; id"}, "not an IP address"),
        ({"model": "m.gguf", "begin": 1, "port": 1}, "outside the agent's worker ports"),
        ({"model": "m.gguf", "begin": 4, "end": 4}, "must be after begin"),
        ({"model": "m.gguf", "begin": 1, "end": 3, "next": "10.0.0.2:7470"}, "both next"),
        ({"model": "m.gguf", "begin": 1, "sm": [100, 200]}, "lock_clocks is false"),
    ],
)
def test_bad_worker_requests_are_refused(
    make_agent: Callable[..., Agent], tmp_path: Path, args: dict, match: str
) -> None:
    p = _worker_agent(make_agent, tmp_path)
    with pytest.raises(NodeError, match=match):
        p.client.start_worker(**args)
    p.client.close()


def test_worker_gets_whitelisted_argv_and_a_fresh_key_file(
    make_agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import time

    import zmq.auth

    monkeypatch.setenv("STRATA_STAGE_TOKEN", "the agent's own token must not leak")
    p = _worker_agent(make_agent, tmp_path)
    nxt = KeyPair.generate().public  # stands for the next stage's worker key
    w = p.client.start_worker(
        model="m.gguf",
        begin=2,
        end=4,
        next="127.0.0.1:7999",
        next_key=nxt,
        timing=True,
        flags=["--kv", "int8", "--max-context=4096"],
    )
    res = p.client.logs(w["id"], 0, wait_ms=10_000)
    out = json.loads(res["lines"][0])
    argv, env = out["argv"], out["env"]
    key_file = Path(argv[argv.index("--stage-key") + 1])
    assert argv[:2] == ["worker", "--model"] and Path(argv[2]) == p.agent.store.root / "m.gguf"
    assert key_file.parent == p.agent.dir / "worker-keys"
    joined = " ".join(argv)
    assert (
        f"--stage-worker {w['port']} --stage-begin 2 --stage-bind 127.0.0.1 --stage-key {key_file}" in joined
    )
    assert f"--stage-allow={p.keys.public} --stage-end 4" in joined  # the paired main's key by default
    assert f"--stage-next 127.0.0.1:7999 --stage-next-key={nxt}" in joined
    assert argv[-4:] == ["--kv", "int8", "--max-context", "4096"]
    assert f'public-key = "{w["public_key"]}"' in out["key"]
    secret = out["key"].split('secret-key = "')[1][:40]
    assert secret not in joined and zmq.curve_public(secret.encode()).decode() == w["public_key"]
    assert env == {"STRATA_STAGE_SECRET_KEY": None, "STRATA_STAGE_TOKEN": None, "STRATA_REMOTE_TIMING": "1"}
    deadline = time.monotonic() + 10
    while key_file.exists() and time.monotonic() < deadline:  # deleted when the worker ends
        time.sleep(0.05)
    assert not key_file.exists() and p.client.workers()[0]["state"] == "exited"
    w2 = p.client.start_worker(model="m.gguf", begin=2)
    assert w2["public_key"] != w["public_key"]  # a fresh key per worker
    p.client.close()


def test_every_whitelisted_flag_is_a_worker_option() -> None:
    from engine.node.workers import FLAG_WHITELIST
    from installer.engine_options import resolve

    sample = {"--kv": "int8", "--dtype": "f32", "--max-context": "64", "--prefill": "128", "--device": "cpu",
              "--activations": "float", "--kv-resident": "2048"}  # fmt: skip
    assert set(sample) == set(FLAG_WHITELIST)
    argv = ["worker", "--stage-worker", "1", "--stage-begin", "1"]
    for flag, value in sample.items():
        argv += [flag, FLAG_WHITELIST[flag](value)]
    args = resolve(argv, env={})
    assert args.kv_resident == 2048
    assert (args.kv, args.dtype, args.max_context, args.prefill, args.device, args.activations) == (
        "int8",
        "f32",
        64,
        "128",
        "cpu",
        "float",
    )


def test_keys_that_begin_with_a_dash_reach_the_worker_intact(
    make_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """Z85 keys may begin with "-": the agent writes --flag=KEY, and the worker's own parser reads them back."""
    import json

    from installer.engine_options import resolve

    dashed = next(k for k in iter(KeyPair.generate, None) if k.public.startswith("-"))
    p = _worker_agent(make_agent, tmp_path)
    w = p.client.start_worker(
        model="m.gguf",
        begin=2,
        end=3,
        next="127.0.0.1:7999",
        next_key=dashed.public,
        allow_keys=[dashed.public],
    )
    argv = json.loads(p.client.logs(w["id"], 0, wait_ms=10_000)["lines"][0])["argv"]
    args = resolve(argv, env={})
    assert args.stage_next_key == dashed.public and args.stage_allow == (dashed.public,)
    assert (args.stage_begin, args.stage_end, args.stage_worker) == (2, 3, w["port"])
    p.client.close()


def test_a_worker_binds_only_where_its_agent_listens() -> None:
    from engine.node.workers import WorkerError, WorkerManager

    wm = object.__new__(WorkerManager)  # only the bind rule, no store or ports
    wm.bind_host = "0.0.0.0"  # an agent on every address: its workers may take any address of this PC
    assert wm._check_bind("127.0.0.1") == "127.0.0.1"
    with pytest.raises(WorkerError, match="not an address of this PC"):
        wm._check_bind("203.0.113.9")
    wm.bind_host = "127.0.0.1"
    assert wm._check_bind(None) == "127.0.0.1" and wm._check_bind("127.0.0.1") == "127.0.0.1"
    with pytest.raises(WorkerError, match=r"listens on 127\.0\.0\.1 only"):
        wm._check_bind("0.0.0.0")


def test_an_identity_flood_leaves_the_paired_main_its_calls(make_agent: Callable[..., Agent]) -> None:
    """50 peers sending identity requests as fast as they can, without reading the answers: the paired main's
    calls keep a median under 50 ms and a p99 under 250 ms (the agent answers each socket a bounded number of
    messages per turn; unbounded, the flood's backlog holds a call for seconds). The p99's bound leaves room for
    the flood thread, which shares this process's interpreter, on a loaded 2-core machine: 56 ms was seen there."""
    import threading
    import time

    import zmq

    from engine.node import wire

    agent = make_agent()
    p = pair_with(agent)
    stop = threading.Event()
    ctx = zmq.Context()

    def flood() -> None:
        socks = [ctx.socket(zmq.DEALER) for _ in range(50)]
        for s in socks:
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{agent.id_port}")
        msg = wire.pack({"cmd": "identify"})
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(msg, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        for s in socks:
            s.close(0)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            p.client.call("hello")
            times.append(time.perf_counter() - t0)
        times.sort()
        p99, med = times[int(len(times) * 0.99) - 1], times[len(times) // 2]
        assert med < 0.05 and p99 < 0.25, f"p99 {p99 * 1e3:.1f} ms, median {med * 1e3:.1f}"
    finally:
        stop.set()
        t.join(10)
        ctx.term()
        p.client.close()
