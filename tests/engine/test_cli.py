"""`strata-engine` from the outside: help, version, generate, logits, and one-line errors for bad files."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.pipeline.loader import load_model
from engine.testing.tiny_models import write_tiny_model
from installer.version import __version__


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", "qwen3moe", qtype="Q8_0", seed=1)


def test_help_and_version() -> None:
    assert run("--version").stdout.strip() == f"strata-engine {__version__}"
    out = run("--help").stdout
    assert "generate" in out and "logits" in out


def test_generate_prints_text_and_a_timing_line(tiny: Path) -> None:
    r = run("generate", "--model", str(tiny), "--chat", "hello", "-n", "8", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "generated at" in r.stderr and "tok/s" in r.stderr


def test_logits_writes_what_the_model_computes(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.npy"
    r = run(
        "logits", "--model", str(tiny), "--tokens", "1,2,3,40", "--out", str(out), "--all", "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    lm = load_model(tiny, device="cpu")
    ref = lm.model.forward(torch.tensor([1, 2, 3, 40]), lm.model.new_cache(8, "f32"), 0).numpy()
    np.testing.assert_array_equal(np.load(out), ref)
    last = tmp_path / "last.npy"
    assert (
        run(
            "logits", "--model", str(tiny), "--tokens", "1,2,3,40", "--out", str(last), "--device", "cpu"
        ).returncode
        == 0
    )
    np.testing.assert_array_equal(np.load(last), ref[-1])


def _truncated(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return dst


def _wrong_magic(src: Path, dst: Path) -> Path:
    dst.write_bytes(b"GGML" + src.read_bytes()[4:])
    return dst


def _missing_tensor(src: Path, dst: Path) -> Path:
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="qwen3moe")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name != "blk.1.attn_k.weight":
            w.add_tensor(t.name, t.data, raw_shape=None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _unknown_arch(src: Path, dst: Path) -> Path:
    data = bytearray(src.read_bytes())
    i = data.find(b"qwen3moe")
    data[i : i + 8] = (
        b"qwen9moe"  # the architecture value comes first in the file; keys follow with the old prefix
    )
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (_truncated, "beyond the end of the file"),
        (_wrong_magic, "not a gguf file"),
        (_missing_tensor, "blk.1.attn_k.weight"),
        (_unknown_arch, "qwen9moe"),
    ],
)
def test_bad_files_get_one_line_errors(tiny: Path, tmp_path: Path, make, expect: str) -> None:
    bad = make(tiny, tmp_path / "bad.gguf")
    r = run("generate", "--model", str(bad), "--prompt", "hi", "-n", "2", "--device", "cpu")
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("strata-engine: error:")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert expect in lines[0].lower() or expect in lines[0], lines[0]


def test_missing_file_and_bad_tokens(tiny: Path, tmp_path: Path) -> None:
    r = run("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "hi")
    assert r.returncode == 1 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr
    r = run("logits", "--model", str(tiny), "--tokens", "1,x", "--out", str(tmp_path / "o.npy"))
    assert r.returncode != 0 and "comma-separated" in r.stderr
    r = run(
        "logits",
        "--model",
        str(tiny),
        "--tokens",
        "99999999",
        "--out",
        str(tmp_path / "o.npy"),
        "--device",
        "cpu",
    )
    assert r.returncode != 0 and "outside the vocabulary" in r.stderr


def test_one_thread_count_for_every_pool_from_the_flag_or_the_free_cores(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.cli as cli
    import installer.engine_options as eo

    # another program keeps core 1 busy: the default is one thread, and the log says why
    monkeypatch.setattr(eo.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    monkeypatch.setattr(eo.psutil, "cpu_percent", lambda interval, percpu: [3.0, 97.0])
    assert eo.free_cores() == (1, 2)
    monkeypatch.setattr(eo.psutil, "cpu_percent", lambda interval, percpu: [99.0, 97.0])
    assert eo.free_cores() == (1, 2)  # never fewer than one

    class BusyParent:  # the app that started the engine, drawing its window meanwhile: not counted
        def __init__(self, pid: int) -> None:
            pass

        def cpu_percent(self, interval: float | None) -> float:
            return 100.0

    monkeypatch.setattr(eo.psutil, "Process", BusyParent)
    assert eo.free_cores() == (1, 2)  # one core the parent's, the other busy with another program
    monkeypatch.setattr(eo.psutil, "cpu_percent", lambda interval, percpu: [2.0, 99.0])
    assert eo.free_cores() == (2, 2)  # the busy core is the parent's own
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
        # recorded first, so that what _thread_policy writes is undone after the test (delenv of a variable that
        # is not set records nothing, and a later Numba compile in this process would see the test's value)
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    monkeypatch.delitem(sys.modules, "numba", raising=False)  # as in a fresh engine process
    cli._thread_policy(3)
    assert {os.environ[v] for v in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")} == {"3"}
    # where Numba has loaded (its pool is fixed), a second command in the process leaves its variable alone
    monkeypatch.setitem(sys.modules, "numba", object())
    cli._thread_policy(2)
    assert [os.environ[v] for v in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")] == [
        "2",
        "3",
        "2",
    ]
    # the child process gets them: generate with --threads 1 reports torch running one thread
    r = run(
        "generate", "--model", str(tiny), "--prompt", "hi", "-n", "2", "--device", "cpu", "--threads", "1"
    )
    assert r.returncode == 0, r.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv[1:] = ['x']; import engine.cli as c; c._thread_policy(1); "
         "import torch, numba; print(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.stdout.split() == ["1", "1"], probe.stderr
