"""The GPU kernels' tuning file: launch shapes per block type and class, measured on a GPU by
bench/gemv_graph_micro.py (and bench/moe_gemm_micro.py for the grouped prompt kernel) and kept in gemv_tuned.json
beside this file. Entries: [rows a program, super-blocks a step, warps, kernel variant]; "<class>:q8" keys for the
8-bit bodies; "F32": {"norm_route": ...}; "<type>": {"moe_gemm": ...}. STRATA_GEMV_TUNED names another file."""

import functools
import json
from pathlib import Path

from installer.engine_options import runtime_switches

TUNED_FILE = Path(runtime_switches().gemv_tuned or Path(__file__).with_name("gemv_tuned.json"))


@functools.cache
def tuned() -> dict[str, dict[str, list[int]]]:
    try:
        return json.loads(TUNED_FILE.read_text())
    except (OSError, ValueError):
        return {}
