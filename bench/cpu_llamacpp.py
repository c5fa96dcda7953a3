"""Our engine and llama.cpp on the CPU, on the same GGUF files, in one run: prompt tokens/s (64 and 512 tokens),
decode tokens/s, our peak RSS, unloaded and with another process busy on one core.

    python bench/cpu_llamacpp.py [--model F ...] [--threads N] [--busy [--schedules]] [--float32-gemm]
                                 [--out F.json] [--llamacpp-src ../shared/bench/llamacpp-src.tgz] [--build DIR]

llama-bench is built for this CPU from the source archive the first time (cmake, ~10 minutes on 2 cores) into
--build (default ~/.cache/polystrata/llamacpp-cpu) and reused afterwards. Without --model the two embedded models
are measured (Gemma 3 270M and Qwen2.5-Coder-0.5B-Instruct, both Q4_K_M). Both engines get the same threads
(default: every core) and measure as llama-bench does: a prompt of N fixed token ids into an empty cache, and
decode from a one-token prompt, greedy; ours runs `strata-engine`'s model code in a child process (--child) with
the thread count in its environment and its default 8-bit activations. --schedules adds, on the busy machine, our
engine on every core under other thread schedules: OpenMP's passive wait (OMP_WAIT_POLICY=PASSIVE), Numba's
dynamic chunks (numba.set_parallel_chunksize) and shorter spins before a waiting thread sleeps (GOMP_SPINCOUNT), each
also unloaded. --float32-gemm adds our engine with prompt chunks through float32 tiles where the cores would
take bfloat16 ones (engine.kernels.cpu_blocks.bf16_gemm), measured right after the default.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def llama_bench(src: Path, build: Path) -> Path:
    """llama-bench for this CPU (built once). AVX2/AVX-512 chosen from /proc/cpuinfo rather than -march=native,
    which also enables AMX where the CPU lists it (an illegal instruction in VMs that do not grant it)."""
    exe = build / "llama.cpp" / "build" / "bin" / "llama-bench"
    if exe.exists():
        return exe
    if not src.exists():
        raise SystemExit(f"{src} not found: give --llamacpp-src (the llama.cpp source archive)")
    build.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src) as t:
        t.extractall(build, filter="data")
    f = _cpu_flags()
    on = lambda flag: "ON" if flag in f else "OFF"  # noqa: E731
    avx512 = "avx512f" in f and "avx512bw" in f
    opts = [
        "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release", f"-DGGML_AVX2={on('avx2')}",
        f"-DGGML_FMA={on('fma')}", f"-DGGML_F16C={on('f16c')}", f"-DGGML_AVX512={'ON' if avx512 else 'OFF'}",
        f"-DGGML_AVX512_VNNI={on('avx512_vnni')}", f"-DGGML_AVX512_BF16={on('avx512_bf16')}",
        f"-DGGML_AVX_VNNI={on('avx_vnni')}", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ]  # fmt: skip
    root = build / "llama.cpp"
    print(f"building llama-bench in {root} (first run only)", file=sys.stderr, flush=True)
    subprocess.run(["cmake", "-B", "build", *opts], cwd=root, check=True, capture_output=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", "build", "-j", jobs, "--target", "llama-bench"], cwd=root, check=True,
                   capture_output=True)  # fmt: skip
    return exe


def run_llamacpp(exe: Path, model: Path, threads: int) -> dict:
    out = subprocess.run(
        [str(exe), "-m", str(model), "-t", str(threads), "-p", "64,512", "-n", "64", "-r", "2", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    res = {}
    for r in rows:
        key = f"prompt_{r['n_prompt']}" if r["n_prompt"] else "decode"
        res[key] = round(r["avg_ts"], 2)
    return res


SCHEDULES = {
    "passive_wait": {"OMP_WAIT_POLICY": "PASSIVE"},
    "passive_wait_chunks_4": {"OMP_WAIT_POLICY": "PASSIVE", "BENCH_NUMBA_CHUNK": "4"},
    "chunks_4": {"BENCH_NUMBA_CHUNK": "4"},
    # GNU OpenMP spins this many times before it sleeps (its default: 300,000, or 1,000 past the cores)
    "spin_0": {"GOMP_SPINCOUNT": "0"},
    "spin_1000": {"GOMP_SPINCOUNT": "1000"},
    "spin_10000": {"GOMP_SPINCOUNT": "10000"},
}


def run_ours(model: Path, threads: int, extra: dict[str, str] | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads), **(extra or {})}
    env.pop("STRATA_ACTIVATIONS", None)  # the engine's default (8-bit activations)
    out = subprocess.run([sys.executable, __file__, "--child", str(model), "--threads", str(threads)],
                         capture_output=True, text=True, env=env, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(model: Path, threads: int) -> None:
    import torch

    from engine.pipeline.loader import load_model

    torch.set_num_threads(threads)
    if os.environ.get("BENCH_FLOAT32_GEMM") == "1":  # --float32-gemm
        from engine.kernels import cpu_blocks

        cpu_blocks.bf16_gemm = lambda: False
    if os.environ.get("BENCH_NUMBA_CHUNK"):  # --schedules: dynamic chunks of Numba's parallel loops
        import numba

        numba.set_parallel_chunksize(int(os.environ["BENCH_NUMBA_CHUNK"]))
    lm = load_model(model, device="cpu", dtype="f32")
    m = lm.model
    res: dict = {}
    for n in (64, 512):
        ids = torch.arange(100, 100 + n) % 1000 + 10
        best = 0.0
        # a 64-token prompt takes ~0.1 s: the best of three, as this host's neighbours come and go
        for _ in range(3):
            cache = m.new_cache(n + 8, "f32")
            t = time.perf_counter()
            m.forward(ids, cache, 0, last_only=True)  # the head for the last token only, as generate does
            best = max(best, n / (time.perf_counter() - t))
        res[f"prompt_{n}"] = round(best, 2)
    best = 0.0
    for _ in range(2):
        cache = m.new_cache(80, "f32")
        tok = torch.tensor([11])
        m.forward(tok, cache, 0)
        t = time.perf_counter()
        for pos in range(1, 65):
            logits = m.forward(tok, cache, pos)
            tok = logits.reshape(-1, logits.shape[-1])[-1].argmax().reshape(1)
        best = max(best, 64 / (time.perf_counter() - t))
    res["decode"] = round(best, 2)
    res["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(res))


def busy_core() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", type=Path, default=[])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--busy", action="store_true", help="also measure with another process busy on one core")
    ap.add_argument("--schedules", action="store_true", help="with --busy: other thread schedules too")
    ap.add_argument("--float32-gemm", action="store_true", help="ours with float32 prompt tiles too")
    ap.add_argument(
        "--llamacpp-src", type=Path, default=REPO.parent / "shared" / "bench" / "llamacpp-src.tgz"
    )
    ap.add_argument("--build", type=Path, default=Path.home() / ".cache" / "polystrata" / "llamacpp-cpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.threads)
        return
    from installer.default_model import default_model_path, smallest_model_path

    models = a.model or [smallest_model_path(), default_model_path()]
    exe = llama_bench(a.llamacpp_src, a.build)
    rows = []
    for model in models:
        row = {"model": model.name, "file_mib": round(model.stat().st_size / 2**20, 1)}
        row["llamacpp"] = run_llamacpp(exe, model, a.threads)
        row["ours"] = run_ours(model, a.threads)
        row["ours_over_llamacpp"] = {k: round(row["ours"][k] / v, 3) for k, v in row["llamacpp"].items() if v}
        if a.float32_gemm:
            from engine.kernels import cpu_blocks

            row["bf16_gemm_by_default"] = cpu_blocks.bf16_gemm()
            row["ours_float32_gemm"] = run_ours(model, a.threads, {"BENCH_FLOAT32_GEMM": "1"})
        if a.busy and a.schedules:
            row["unloaded_schedules"] = {k: run_ours(model, a.threads, e) for k, e in SCHEDULES.items()}
        if a.busy:
            hog = busy_core()
            try:
                row["busy_one_core"] = {
                    "llamacpp": run_llamacpp(exe, model, a.threads),
                    "ours": run_ours(model, a.threads),
                    "ours_one_thread": run_ours(model, 1),
                }
                if a.schedules:
                    row["busy_schedules"] = {k: run_ours(model, a.threads, e) for k, e in SCHEDULES.items()}
            finally:
                hog.kill()
            row["busy_decode_over_unloaded"] = round(
                max(row["busy_one_core"]["ours"]["decode"], row["busy_one_core"]["ours_one_thread"]["decode"])
                / row["ours"]["decode"],
                3,
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "what": "bench/cpu_llamacpp.py: llama-bench and our engine on the CPU, same files and threads, one run",
        "threads": a.threads,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "rows": rows,
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
