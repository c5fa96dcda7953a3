"""The engine's options: every flag of `strata-engine`, its default (written here once), the config keys and the
environment variables behind it, and the one rule that merges them:

    defaults < config file (its keys, then its "args") < environment variables < flags the user typed

Standard library only: `strata-engine` (serve, generate, logits, profile, worker), `strata-node tune`, the
text-mode setup and the app's config writer all read it (installer/ is the package both sides may import).

The parsers are built with `argparse.SUPPRESS` as every default, so a parsed command line holds exactly the flags
that were typed; the defaults come from `EngineOptions` alone.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from installer.config import StrataConfig

PROG = "strata-engine"
COMMANDS = ("generate", "serve", "logits", "profile", "worker")
log = logging.getLogger("strata.options")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that names no sampling field gets (the server, the app's chat settings, the engine's own
    `SamplingParams`)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64


SAMPLING = SamplingDefaults()


@dataclass(frozen=True)
class EngineOptions:
    """Every option of `strata-engine`, one field per flag (the flag's name with "-" as "_"). A command reads
    the fields it has flags for; the others keep their defaults."""

    command: str | None = None
    debug: bool = False
    config: str | None = None
    # The model and how it runs
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv: str = "auto"
    max_context: int = 4096  # AUTO_CONTEXT (0): chosen at load (serve's default, COMMAND_DEFAULTS)
    kv_resident: int | None = None  # None: auto (placement.auto_kv_resident)
    prefill: str = "auto"
    activations: str | None = None  # None: int8 (engine.kernels.int8_activations)
    threads: int = 0
    # generate / logits / profile
    prompt: str | None = None
    chat: str | None = None
    system: str | None = None
    max_tokens: int = 128
    temperature: float = SAMPLING.temperature
    top_k: int = SAMPLING.top_k
    top_p: float = SAMPLING.top_p
    min_p: float = SAMPLING.min_p
    repeat_penalty: float = SAMPLING.repeat_penalty
    presence_penalty: float = SAMPLING.presence_penalty
    frequency_penalty: float = SAMPLING.frequency_penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tokens: str | None = None
    out: str | None = None
    all: bool = False
    prompts: str | None = None
    # serve
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_key_file: str | None = None
    alias: tuple[str, ...] = ()
    max_queue: int = 64
    parallel: int | None = None  # None: auto (installer.placement.auto_parallel)
    batch_groups: int | None = None  # None: auto (2 with a remote stage, else 1)
    prompt_cache_mib: int = 2048
    max_body_mib: float = 16.0
    cors: tuple[str, ...] = ()
    profile_every: float = 300.0
    # verify windows
    spec: int = 0
    suffix_draft: int = 1
    mtp: str = "auto"
    pipeline_windows: int = 0
    # layer split, experts, CPU, remote stage
    gpus: str | None = None
    gpu: int | None = None
    layer_split: str | None = None
    split_device: str | None = None
    gpu_order: str = "auto"
    vram_reserve_mib: int = 512
    vram_reserve_later_mib: int | None = None
    split_skip_if_fits: bool = False
    expert_cache: int | None = None
    vram_budget_mib: int | None = None
    expert_misses: str = "copy"
    expert_policy: str = "profile"
    expert_prefetch: str = "off"
    cpu_experts: float | None = None
    cpu_ratio: float | None = None
    profile: str | None = None
    no_profile: bool = False
    trace: str | None = None  # profile --trace FILE
    cpu_weights_mib: int | None = None
    remote_stage: str | None = None
    remote_stage_key: str | None = None
    stage_key: str | None = None
    remote_timing: bool = False
    # worker
    stage_worker: int | None = None
    stage_begin: int | None = None
    stage_end: int | None = None
    stage_next: str | None = None
    stage_bind: str = "0.0.0.0"
    stage_allow: tuple[str, ...] = ()
    stage_next_key: str | None = None
    # Where each non-default value came from: field -> "config", "environment" or "command line".
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")


D = EngineOptions()

# Defaults that differ by command, written here once: generate is greedy so that its output is the same each run,
# and profile reads a few tokens after each prompt.
AUTO_CONTEXT = 0  # --max-context auto
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "generate": {"temperature": 0.0},
    "profile": {"max_tokens": 16},
    "serve": {"max_context": AUTO_CONTEXT},
}


def kv_resident_flag(value: str) -> int | None:
    """--kv-resident: positions of each sequence's KV kept in VRAM, or auto (None)."""
    if value.strip().lower() == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a count of positions (0 or more) nor auto (e.g. --kv-resident 32768)"
        )
    return n


def context_flag(value: str) -> int:
    """--max-context: positions, or auto (AUTO_CONTEXT: the engine chooses from the card and the model)."""
    if value.strip().lower() == "auto":
        return AUTO_CONTEXT
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a count of positions nor auto (e.g. --max-context 32768)"
        ) from None


def _env_flag(value: str) -> bool:
    return value == "1"


def _env_activations(value: str) -> str:
    if value not in ("int8", "float"):
        raise OptionsError(f"STRATA_ACTIVATIONS is {value!r}: set it to int8 or float, or unset it")
    return value


# The documented environment variables behind options (docs/api.md). Others (the link's keys, the data folders)
# are read where their package reads its own settings, not here.
ENV: dict[str, tuple[str, Any]] = {
    "STRATA_API_KEY": ("api_key", str),
    "STRATA_ACTIVATIONS": ("activations", _env_activations),
    "STRATA_REMOTE_TIMING": ("remote_timing", _env_flag),
}


class OptionsError(ValueError):
    """Options that cannot be used together or read; the message says what and how to fix it."""


# Every STRATA_* environment variable, with where it is read. Options (ENV above) are read here; the switches of
# the model, layer and kernel code are read here too (`runtime_switches`), so that code reads no environment of its
# own; the link's secrets and the folders are read by the package they belong to.
ENVIRONMENT: dict[str, str] = {
    "STRATA_API_KEY": "--api-key (serve)",
    "STRATA_ACTIVATIONS": "--activations: int8 or float (runtime_switches)",
    "STRATA_REMOTE_TIMING": "1: each stage's timing per chunk and step (serve, worker)",
    "STRATA_NORM_ROUTE": "0: the decode step's norm and router as separate launches (runtime_switches)",
    "STRATA_PROMPT_GRAPHS": "0: prompt chunks run eagerly, not from CUDA graphs (runtime_switches)",
    "STRATA_GEMV_TUNED": "another GEMV tuning file (runtime_switches)",
    "STRATA_ROWS_GEMM": "1: steps of 2-16 rows multiply dense weights with rows_gemm, not the GEMV (runtime_switches)",
    "STRATA_ROUTE_TRACE": "a routing trace file replayed in place of the routers' choice: benchmarks, tests (runtime_switches)",
    "STRATA_FLASH_PREFILL": "0: prompt chunks attend through torch, not the flash kernel (runtime_switches)",
    "STRATA_BATCHED_GEMV": "0: each decode row of a step gets its own GEMV launches, not the batched ones (runtime_switches)",
    "STRATA_STEP_OVERLAP": "0: --parallel reads each step's tokens before the next step starts (runtime_switches)",
    "STRATA_PDL": "0: the decode kernels launch one after another, not early (sm_90+; runtime_switches)",
    "STRATA_CPU_STEP_SERVE": "0: the CPU answers a decode step's expert requests one by one from Python, not in one "
    "call without the GIL (runtime_switches)",
    "STRATA_PREFETCH_TRACE": "ACC: with --expert-prefetch router and a replayed trace, predict the next layer's "
    "experts from the trace, each right with probability ACC (benchmarks; runtime_switches)",
    "STRATA_ROUTE_RECORD": "N: record the first N tokens' routing (profile --trace sets it; runtime_switches)",
    "STRATA_STAGE_TOKEN": "the shared secret of a hand-started stage link (engine/link/keys.py)",
    "STRATA_STAGE_SECRET_KEY": "a worker's own key, from its node agent (engine/link/keys.py)",
    "STRATA_STAGE_ALLOW": "the keys a worker admits, from its node agent (engine/link/keys.py)",
    "STRATA_CONFIG_DIR": "the folder of configs and app settings (installer/paths.py)",
    "STRATA_DATA_DIR": "the folder of models, keys and node data (installer/paths.py)",
    "STRATA_PROFILE_DIR": "the folder of expert usage profiles (engine/experts/profile.py)",
    "STRATA_CI": "fixed hypothesis examples in the test suite (tests/conftest.py)",
}


@dataclass(frozen=True)
class RuntimeSwitches:
    """Process-wide switches of the kernels and the model code, from the environment (children inherit them)."""

    activations: str = "int8"
    norm_route: bool = True
    prompt_graphs: bool = True
    gemv_tuned: str | None = None
    rows_gemm: bool = False  # measured slower than the GEMV at 2-16 rows on an H200 (bench/results/rows-gemm-vs-gemv-h200.json)
    route_trace: str | None = None  # engine/experts/replay.py
    route_record: int = 0
    flash_prefill: bool = True  # engine/kernels/prefill_attention.py; 0: torch's attention (comparisons)
    batched_gemv: bool = True  # engine/kernels/gemv.py rows_config; 0: each row of a step its own programs
    step_overlap: bool = True  # engine/pipeline/batch.py: a step's tokens read while the next step runs (GPU)
    pdl: bool = True  # engine/kernels/launch.py: kernels launched early (sm_90 and later); 0: one by one
    # engine/experts/cpu_misses.py: a step's CPU requests in one call without the GIL; 0: one by one from Python
    cpu_step_serve: bool = True
    # engine/experts/prefetch.py: with a replayed trace, predictions of this accuracy in place of the router's
    prefetch_trace: float | None = None


# --cpu-weights-mib's automatic budget: a quarter of the RAM, at most 8 GiB (a small default model fits whole; a big
# one partly). The engine keeps its float copies within it; the fit estimate (installer.recommend) counts it.
CPU_FLOAT_FRACTION, CPU_FLOAT_CAP = 0.25, 8 << 30


def cpu_float_budget(ram_bytes: int) -> int:
    """The automatic --cpu-weights-mib, in bytes, on a PC with this much RAM."""
    return int(min(CPU_FLOAT_CAP, ram_bytes * CPU_FLOAT_FRACTION))


def int8_activations(env: Mapping[str, str] | None = None) -> bool:
    """STRATA_ACTIVATIONS alone (read once per MoE block and GEMV launch choice: one lookup)."""
    return (os.environ if env is None else env).get("STRATA_ACTIVATIONS") != "float"


def runtime_switches(env: Mapping[str, str] | None = None) -> RuntimeSwitches:
    """STRATA_ACTIVATIONS, STRATA_NORM_ROUTE, STRATA_PROMPT_GRAPHS, STRATA_GEMV_TUNED, STRATA_ROWS_GEMM,
    STRATA_FLASH_PREFILL, STRATA_BATCHED_GEMV, STRATA_STEP_OVERLAP, STRATA_PDL, STRATA_CPU_STEP_SERVE, STRATA_PREFETCH_TRACE
    and the routing trace's two, read now (a switch set while the process runs takes effect at the next read)."""
    e = os.environ if env is None else env
    return RuntimeSwitches(
        activations="int8" if int8_activations(e) else "float",
        norm_route=e.get("STRATA_NORM_ROUTE", "1") != "0",
        prompt_graphs=e.get("STRATA_PROMPT_GRAPHS", "1") != "0",
        gemv_tuned=e.get("STRATA_GEMV_TUNED") or None,
        rows_gemm=e.get("STRATA_ROWS_GEMM", "0") == "1",
        route_trace=e.get("STRATA_ROUTE_TRACE") or None,
        route_record=_env_count("STRATA_ROUTE_RECORD", e.get("STRATA_ROUTE_RECORD", "0")),
        flash_prefill=e.get("STRATA_FLASH_PREFILL", "1") != "0",
        batched_gemv=e.get("STRATA_BATCHED_GEMV", "1") != "0",
        step_overlap=e.get("STRATA_STEP_OVERLAP", "1") != "0",
        pdl=e.get("STRATA_PDL", "1") != "0",
        cpu_step_serve=e.get("STRATA_CPU_STEP_SERVE", "1") != "0",
        prefetch_trace=_env_fraction("STRATA_PREFETCH_TRACE", e.get("STRATA_PREFETCH_TRACE", "")),
    )


def _env_fraction(name: str, value: str) -> float | None:
    if not value:
        return None
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise OptionsError(f"{name} is {value!r}: set it to a fraction between 0 and 1, or unset it")
    return f


def _env_count(name: str, value: str) -> int:
    try:
        n = int(value or "0")
    except ValueError:
        n = -1
    if n < 0:
        raise OptionsError(f"{name} is {value!r}: set it to a count of tokens, or unset it")
    return n


# ---------------------------------------------------------------------------------------------------------------
# The flags


def add_model_args(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument(
        "--model",
        "-m",
        help="GGUF file (any part of a multi-part file); default: the embedded Qwen2.5-Coder-0.5B-Instruct",
    )
    p.add_argument("--device", help=f"cpu, cuda or cuda:N (default {D.device}: cuda when available)")
    p.add_argument("--dtype", help="compute type: auto (bf16 on CUDA, f32 on CPU), f32, bf16, f16")
    p.add_argument("--kv", help="KV cache type: auto (the compute type), f32, f16, bf16, int8, q4_0")
    p.add_argument(
        "--max-context",
        type=context_flag,
        help=f"positions the KV cache holds per sequence, or auto: from {D.max_context} up to the length the model "
        "was trained for while every slot's KV stays within an eighth of the card's free VRAM (serve's default; "
        f"on the CPU and with --remote-stage {D.max_context}); other commands' default {D.max_context}",
    )
    p.add_argument(
        "--kv-resident",
        type=kv_resident_flag,
        metavar="N",
        help="positions of each sequence's KV kept in VRAM; the KV of the other layers lives in page-locked host RAM "
        "and is read across PCIe at every step (slower decode deep into the context, but a context larger than the "
        "card runs). auto (default): all of it in VRAM where it fits beside the dense weights on one card, else the "
        "positions that fit (said in the log)",
    )
    p.add_argument("--prefill", help="prompt chunk size in tokens, or auto (512)")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for the model's math, shared by every thread pool of the process (default 0: the cores "
        "not busy with other programs when the engine starts)",
    )
    p.add_argument(
        "--activations",
        choices=("int8", "float"),
        help="int8 (default) rounds the activations of the matrix-vector kernels (CUDA's, and the CPU's, which then "
        "read the weights' blocks in place) to 8 bits, as llama.cpp does (faster); float keeps the exact float "
        "product (the CPU then keeps float copies of weights, --cpu-weights-mib); also $STRATA_ACTIVATIONS",
    )


def add_sampling_args(p: argparse.ArgumentParser, command: str) -> None:
    d = replace(D, **COMMAND_DEFAULTS.get(command, {}))
    p.add_argument("--max-tokens", "-n", type=int, help=f"tokens to generate (default {d.max_tokens})")
    p.add_argument("--temperature", "--temp", type=float, help=f"0 = greedy (default {d.temperature:g})")
    p.add_argument("--top-k", type=int, help=f"default {d.top_k}; 0 = off")
    p.add_argument("--top-p", type=float, help=f"default {d.top_p:g}")
    p.add_argument("--min-p", type=float, help=f"default {d.min_p:g}")
    p.add_argument("--repeat-penalty", type=float, help=f"default {d.repeat_penalty:g} (off)")
    p.add_argument("--presence-penalty", type=float, help=f"default {d.presence_penalty:g}")
    p.add_argument("--frequency-penalty", type=float, help=f"default {d.frequency_penalty:g}")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("verify windows (docs/speculative.md)")
    g.add_argument(
        "--spec",
        type=int,
        metavar="N",
        help="draft up to N tokens per step and verify them in one forward (default 0: off); greedy output is "
        "unchanged",
    )
    g.add_argument(
        "--suffix-draft",
        type=int,
        choices=(0, 1),
        help="1: draft by copying earlier context, prompt and answer (default); 0: only the model's draft layer",
    )
    g.add_argument(
        "--mtp",
        nargs="?",
        const="1",
        metavar="auto|1|0",
        help="draft with the model's own draft (MTP / nextn) layer: auto where the file has one (default), "
        "1 (or --mtp alone) to require it, 0 to leave it out",
    )
    g.add_argument(
        "--pipeline-windows",
        type=int,
        metavar="N",
        help="2: on a layer split, the first stages read the next (guessed) window while the last verifies "
        "(default 0)",
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="a strata-<model>.json config (its model, cards and args); flags typed here win over it",
    )
    p.add_argument("--host", help=f"address to listen on (default {D.host}, this PC only)")
    p.add_argument("--port", type=int, help=f"TCP port (default {D.port}; 0 = any free port)")
    p.add_argument(
        "--api-key",
        help="require this key (Authorization: Bearer KEY); needed off 127.0.0.1; also read from $STRATA_API_KEY "
        "or --api-key-file, which keep it out of the process list",
    )
    p.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    p.add_argument("--alias", action="append", help="another model name to answer to (repeatable)")
    p.add_argument(
        "--max-queue", type=int, help=f"requests that may wait for the model (default {D.max_queue})"
    )
    p.add_argument(
        "--parallel",
        type=int,
        help="slots: requests decoded together in shared steps, each with its own KV cache of --max-context "
        "positions (default auto: up to 16, their KV within an eighth of the VRAM left; on the CPU up to 4, within an "
        "eighth of the RAM)",
    )
    p.add_argument(
        "--batch-groups",
        type=int,
        help="with a remote stage: the slots take turns in this many groups, one group's step going out while the "
        "worker computes another's, so that both PCs work at once (default auto: 2 with a remote stage and 2 slots "
        "or more, else 1)",
    )
    p.add_argument(
        "--prompt-cache-mib",
        type=int,
        help=f"host memory for the KV of recent conversations (default {D.prompt_cache_mib} MiB; 0 = off)",
    )
    p.add_argument(
        "--max-body-mib", type=float, help=f"largest request body (default {D.max_body_mib:g} MiB)"
    )
    p.add_argument("--cors", action="append", help="a web origin allowed to call the API (repeatable)")
    p.add_argument(
        "--profile-every",
        type=float,
        metavar="S",
        help="save the experts used into the usage profile every S seconds of serving (checked after each "
        f"request; 0: after every request) and at shutdown (default {D.profile_every:g}); --no-profile turns it "
        "off",
    )


def add_split_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several cards (layer split)")
    g.add_argument(
        "--gpus",
        help="cards that run the model together, as nvidia-smi numbers them (e.g. 0,2), or all; the first is the "
        "main one",
    )
    g.add_argument("--gpu", type=int, help="run on this one card (nvidia-smi's number)")
    g.add_argument(
        "--layer-split",
        help="auto (default with --gpus) or the first layer of each later card, e.g. 24 or 16,32",
    )
    g.add_argument(
        "--split-device",
        help="the later stages' cards with --layer-split K (default: the next cards); 0 runs them on card 0 too "
        "(the check of the hand-off, not a speed mode); cpu for the CPU",
    )
    g.add_argument(
        "--gpu-order",
        choices=("auto", "as_given"),
        help="auto: under --layer-split auto the faster card goes last (default); as_given keeps your order",
    )
    g.add_argument(
        "--vram-reserve-mib",
        type=int,
        help=f"VRAM left free on the first card for the desktop and other programs (default {D.vram_reserve_mib})",
    )
    g.add_argument(
        "--vram-reserve-later-mib",
        type=int,
        help="the same for the later cards (default: --vram-reserve-mib)",
    )
    g.add_argument(
        "--split-skip-if-fits",
        action="store_true",
        help="with --layer-split auto: run on the first card alone when it holds everything",
    )
    e = p.add_argument_group("experts in VRAM (CUDA)")
    e.add_argument(
        "--expert-cache",
        type=int,
        metavar="N",
        help="keep N routed experts in VRAM on each card (the most used first); default: as many as fit",
    )
    e.add_argument(
        "--vram-budget-mib",
        type=int,
        metavar="MIB",
        help="use at most this much of each card, as if it were that small (a shared card, or tests)",
    )
    e.add_argument(
        "--expert-misses",
        choices=("copy", "direct"),
        help="how a decode step reads experts that are in host RAM: copy (first copied into VRAM with wide loads, "
        "one kernel a layer; the faster, default) or direct (the expert kernels read them over PCIe)",
    )
    e.add_argument(
        "--expert-policy",
        choices=("profile", "lru", "lfu"),
        help="which experts a card keeps in VRAM as a conversation goes: profile (the usage profile's hottest, "
        "filled at start and kept; the default), lru (each miss of a decode step takes the slot used "
        "least recently, on the card, inside the step) or lfu (the slot with the lowest use count, decaying each "
        "step)",
    )
    e.add_argument(
        "--expert-prefetch",
        choices=("off", "router"),
        help="router: while a layer computes, the next MoE layer's router predicts its experts from this layer's "
        "input and the predicted ones left in host RAM are copied into VRAM early, on a side stream (two staging "
        "areas of VRAM come out of the experts' budget); off: each layer copies its own misses when it reaches "
        "them (the default)",
    )
    e.add_argument(
        "--cpu-experts",
        type=float,
        metavar="F",
        help="of each layer's experts in host RAM, the fraction (0-1) the CPU may compute, beside the GPU's copies "
        "of the others, when a decode step misses them. Default: all of them where the CPU reads the blocks in "
        "place (Q4_K experts, AVX2), none elsewhere (other block types are repacked: more host RAM and load "
        "time, so give F to have them); 0: off",
    )
    e.add_argument(
        "--cpu-ratio",
        type=float,
        metavar="R",
        help="fixes the share (0-1) of a decode step's missed experts the CPU computes (default: tuned while "
        "serving, from 0.5; bench/engine_bench.py --cpu-ratio measures fixed ones)",
    )
    e.add_argument(
        "--profile",
        metavar="PATH",
        help="the usage profile that fills the caches and weighs --layer-split auto (default: the one saved for "
        "this file in the data dir)",
    )
    e.add_argument(
        "--no-profile",
        action="store_true",
        help="neither read nor save a usage profile (caches filled in expert order)",
    )
    c = p.add_argument_group("CPU")
    _cpu_weights_arg(c)
    r = p.add_argument_group("several PCs (remote stage)")
    r.add_argument(
        "--remote-stage",
        metavar="HOST:PORT",
        help="layers K onward run on the worker there (with --layer-split K); keys from STRATA_STAGE_TOKEN",
    )
    r.add_argument(
        "--remote-stage-key", metavar="KEY", help="the worker's public key (Z85 or a certificate file)"
    )
    r.add_argument(
        "--stage-key", metavar="FILE", help="this side's key file (its public key on the worker's allow-list)"
    )


def _cpu_weights_arg(g: Any) -> None:
    g.add_argument(
        "--cpu-weights-mib",
        type=int,
        metavar="MIB",
        help="RAM for float copies of the weights of layers on the CPU, made at first use (a CPU spends most of a "
        "token dequantizing blocks otherwise); 0: keep every weight in blocks; default: a quarter of the RAM, "
        "at most 8 GiB",
    )


def add_worker_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("stage worker")
    g.add_argument(
        "--stage-worker", type=int, required=required, metavar="PORT", help="TCP port to listen on (0: any)"
    )
    g.add_argument(
        "--stage-begin", type=int, required=required, metavar="K", help="first layer this worker runs"
    )
    g.add_argument(
        "--stage-end", type=int, metavar="K2", help="one past its last layer (default: the model's end)"
    )
    g.add_argument(
        "--stage-next", metavar="HOST:PORT", help="the worker of the layers from K2 on (with --stage-end)"
    )
    g.add_argument("--stage-bind", metavar="ADDR", help=f"address to listen on (default {D.stage_bind}: all)")
    g.add_argument(
        "--stage-key", metavar="FILE", help="this worker's key (a ZeroMQ certificate with its secret)"
    )
    g.add_argument(
        "--stage-allow",
        action="append",
        metavar="KEY",
        help="a client public key (Z85 or a certificate file) this worker admits; repeatable",
    )
    g.add_argument("--stage-next-key", metavar="KEY", help="the next worker's public key (with --stage-key)")
    g.add_argument("--gpu", type=int, help="the card to run on (nvidia-smi's number)")
    g.add_argument(
        "--parallel",
        type=int,
        help="sequences whose KV this worker keeps for the main's slots, each of --max-context positions (default "
        "auto, as serve's: up to 16 within an eighth of the VRAM left; the main serves as many at once as the "
        "fewest any worker of its chain keeps)",
    )
    _cpu_weights_arg(g)


def build_parser(
    required: bool = True, parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """The whole `strata-engine` command line. Every default is SUPPRESS: what parses is what was typed.
    `required=False` parses a config's "args", where the command's required flags need not appear."""
    from installer.version import __version__

    s = argparse.SUPPRESS
    parser = parser_class(
        prog=PROG,
        description="PolyStrata inference engine: runs GGUF models (Mixture-of-Experts and dense) on the CPU or "
        "CUDA.",
        argument_default=s,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=parser_class)

    g = sub.add_parser("generate", help="generate text from a prompt or a chat message", argument_default=s)
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", "-p", help="raw prompt text (no chat template)")
    src.add_argument("--chat", "-c", help="a user message, formatted with the model's chat template")
    g.add_argument("--system", help="system prompt for --chat")
    add_sampling_args(g, "generate")
    add_spec_args(g)
    add_split_args(g)

    sv = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API, /metrics, /stats and /events", argument_default=s
    )
    add_model_args(sv)
    add_serve_args(sv)
    add_spec_args(sv)
    add_split_args(sv)

    lg = sub.add_parser(
        "logits", help="write the logits of a token-id list to a .npy file", argument_default=s
    )
    add_model_args(lg)
    lg.add_argument("--tokens", required=required, help="comma-separated token ids, e.g. 2,651,6037")
    lg.add_argument("--out", required=required, help="output .npy file")
    lg.add_argument(
        "--all", action="store_true", help="every position ([T, V]) instead of the last one ([V])"
    )
    add_split_args(lg)

    pr = sub.add_parser(
        "profile",
        help="record which experts a set of prompts uses (the usage profile that fills the expert caches)",
        description="Runs each line of --prompts as a user message (the model's chat template, then a few greedy "
        "tokens) and adds the experts each layer selected to the model file's usage profile.",
        argument_default=s,
    )
    add_model_args(pr)
    pr.add_argument(
        "--prompts", required=required, metavar="FILE", help="a UTF-8 text file: one user message per line"
    )
    pr.add_argument(
        "--max-tokens",
        "-n",
        type=int,
        help=f"greedy tokens after each prompt (default {COMMAND_DEFAULTS['profile']['max_tokens']})",
    )
    pr.add_argument(
        "--out",
        metavar="PATH",
        help="the profile file to add to (default: --profile, else the one the engine reads for this file)",
    )
    pr.add_argument(
        "--trace",
        metavar="FILE",
        help="also write the routing trace of every token read (.npz: each layer's chosen experts and weights; "
        "STRATA_ROUTE_TRACE=FILE replays it, docs/performance.md)",
    )
    add_split_args(pr)

    wk = sub.add_parser(
        "worker", help="run layers K onward of a model for a main process on another PC", argument_default=s
    )
    add_model_args(wk)
    add_worker_args(wk, required=required)
    return parser


# ---------------------------------------------------------------------------------------------------------------
# Merging


def _field_names() -> set[str]:
    return {f.name for f in fields(EngineOptions)} - {"sources"}


def _normalise(values: Mapping[str, Any]) -> dict[str, Any]:
    """Lists from repeatable flags as tuples (the options object is frozen and hashable field by field)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def typed(argv: Sequence[str]) -> dict[str, Any]:
    """The options a command line (its command first) names, and nothing else. Exits with argparse's usage
    message on a malformed one."""
    return _normalise(vars(build_parser().parse_args(list(argv))))


class _ConfigArgsError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a config's bad "args" are reported, not a usage exit
        raise _ConfigArgsError(message)


def config_args(cfg: StrataConfig) -> list[str]:
    """The config's keys as the flags above, before its "args" (which win): one card -> --gpu N; several -> --gpus
    and --layer-split; "workers" -> --remote-stage and --layer-split; "max_context", "kv" as themselves."""
    out: list[str] = []
    if len(cfg.gpu) == 1:
        out += ["--gpu", str(cfg.gpu[0])]
    elif len(cfg.gpu) > 1:
        out += ["--gpus", ",".join(str(g) for g in cfg.gpu)]
        split: Any = cfg.layer_split
        out += ["--layer-split", split if split == "auto" else ",".join(str(k) for k in split)]
    if cfg.gpu_order != "auto":
        out += ["--gpu-order", cfg.gpu_order]
    if getattr(cfg, "split_skip_if_fits", False):
        out.append("--split-skip-if-fits")
    if (
        cfg.workers
    ):  # the main talks to the first worker; the others are chained by --stage-next on the workers
        w = cfg.workers[0]
        host = f"[{w.host}]" if ":" in w.host else w.host
        out += ["--remote-stage", f"{host}:{w.port}", "--layer-split", str(w.begin)]
    if cfg.max_context is not None:
        out += ["--max-context", str(cfg.max_context)]
    if cfg.kv is not None:
        out += ["--kv", cfg.kv]
    return out


def from_config(
    cfg: StrataConfig, command: str, source: str = "the config"
) -> tuple[dict[str, Any], list[str]]:
    """(the options a config sets for `command`, its "args" that are not options of that command). A malformed
    value in "args" raises OptionsError naming the file."""
    parser = build_parser(required=False, parser_class=_RaisingParser)  # a bad value names the config
    try:
        ns, unknown = parser.parse_known_args([command, *config_args(cfg), *cfg.args])
    except _ConfigArgsError as e:
        raise OptionsError(f'"args" in {source}: {e}') from None
    values = _normalise(vars(ns))
    values.pop("command", None)
    if cfg.model:
        values["model"] = cfg.model
    return values, list(unknown)


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (key, convert) in ENV.items():
        raw = env.get(name)
        if raw:
            out[key] = convert(raw)
    return out


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def merge(
    command: str | None,
    given: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    env: Mapping[str, Any] | None = None,
    config_name: str = "the config",
) -> tuple[EngineOptions, list[str]]:
    """defaults < config < environment < given, as an EngineOptions, and one line for each option that two of
    them set to different values, saying which won. Pure: no files, no environment of its own."""
    known = _field_names()
    layers = [("config", config or {}), ("environment", env or {}), ("command line", given)]
    values: dict[str, Any] = dict(COMMAND_DEFAULTS.get(command or "", {}))
    sources: dict[str, str] = {}  # key -> the layer its value in `values` came from
    notes: list[str] = []
    for where, layer in layers:
        for key, value in layer.items():
            if key == "command" or key not in known:
                continue
            if key in sources and values[key] != value:
                was = config_name if sources[key] == "config" else f"the {sources[key]}"
                notes.append(
                    f"{flag_name(key)} {_show(value)} from the {where} wins over {_show(values[key])} from {was}"
                )
            values[key] = value
            sources[key] = where
    return EngineOptions(command=command, sources=sources, **values), notes


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def resolve(
    argv: Sequence[str], env: Mapping[str, str] | None = None, logger: logging.Logger | None = None
) -> EngineOptions:
    """`strata-engine ARGV` as options: the command line parsed (what was typed), the config it names read, the
    documented environment read, merged by `merge`; each conflict logged. OptionsError on a config or environment
    value that cannot be used (the config's own checks: installer.config.ConfigError, which is a ValueError)."""
    given = typed(argv)
    command = given.pop("command", None)
    env_values = from_env(os.environ if env is None else env)
    config_values: dict[str, Any] = {}
    config_name = "the config"
    path = given.get("config")
    if path:
        from installer.config import read_config

        cfg = read_config(Path(path))
        config_name = Path(path).name
        config_values, unknown = from_config(cfg, command or "serve", config_name)
        if unknown:
            (logger or log).warning(
                "%s: args %s are not options of %s %s and are ignored", config_name, " ".join(unknown), PROG,
                command,
            )  # fmt: skip
        model = config_values.get("model")
        if model and not Path(model).is_absolute():  # relative to the config's folder
            config_values["model"] = str(Path(path).parent / model)
    opts, notes = merge(command, given, config_values, env_values, config_name)
    for line in notes:
        (logger or log).info("%s", line)
    if opts.api_key_file:
        opts = replace(opts, api_key=read_key_file(opts.api_key_file))
    return opts


def read_key_file(path: str) -> str:
    """The API key in a file (its first line, without spaces): a key on the command line shows in `ps`."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise OptionsError(
            f"--api-key-file {path} cannot be read ({e.strerror or e}): give a file that holds the key"
        ) from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise OptionsError(f"--api-key-file {path} is empty: write the key on its first line")
    return key


def check_args(args: Sequence[str], command: str = "serve", source: str = "the config") -> None:
    """The "args" a config or the app's settings hold, checked as the engine will read them: OptionsError names
    the first flag `command` does not have or a value it cannot take."""
    from installer.config import StrataConfig

    _, unknown = from_config(StrataConfig(model="-", args=tuple(args)), command, source)
    if unknown:
        raise OptionsError(
            f'"args" in {source} has {unknown[0]!r}, which is not an option of {PROG} {command}: see '
            f"{PROG} {command} --help"
        )


def free_cores(sample_s: float = 0.05) -> tuple[int, int]:
    """(cores this process may use that are not busy, those it may use): a core counts as busy when other
    programs kept it over half busy during `sample_s`. The process that started the engine (the app, a shell) is
    not counted: it waits on the engine once it runs. One thread per free core is the default thread count: a
    thread on a busy core stalls every parallel step of the others."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = list(range(os.cpu_count() or 1))
    try:
        parent = psutil.Process(os.getppid())
        parent.cpu_percent(None)
        busy = psutil.cpu_percent(interval=sample_s, percpu=True)
        parent_cores = round(parent.cpu_percent(None) / 100)
    except Exception:  # no /proc (a sandbox), the parent gone: every core counts as free
        return len(usable), len(usable)
    taken = sum(1 for c in usable if c < len(busy) and busy[c] >= 50.0)
    free = len(usable) - max(0, taken - parent_cores)
    return max(1, free), len(usable)
