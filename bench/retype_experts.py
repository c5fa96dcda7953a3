"""Copy a MoE GGUF with its routed experts in another block type, for speed runs on other expert types.

    python bench/retype_experts.py IN.gguf OUT.gguf --type iq4_xs|q8_0|q5_k|q6_k|...

Every tensor but the routed experts' (`blk.N.ffn_{gate,up,down}_exps.weight`) is copied byte for byte, with the
metadata. The experts become random blocks of the type with sane scales (engine/gguf/random_blocks.py): speed does
not depend on the values, and a run that needs real routing replays a trace (STRATA_ROUTE_TRACE). Each projection's
blocks are drawn once and repeated in every layer, so the file is written at disk speed; llama.cpp's
llama-quantize would need the source in full precision, or --allow-requantize and ~15 minutes for the kit's
17 GB file. The types are those engine.gguf.random_blocks writes (K-, IQ- and the 32-value types)."""

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.gguf.random_blocks import random_blocks

EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def retype(src: Path, dst: Path, qtype: QT, seed: int = 0) -> int:
    """Write `dst` from `src` with the routed experts in `qtype` -> the number of expert tensors rewritten."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    _copy_metadata(reader, writer)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(seed)
    drawn: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
    plan = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # the reader gives ggml's order
        if EXPERTS.search(t.name):
            if shape[-1] % block:
                raise SystemExit(
                    f"{t.name}: rows of {shape[-1]} values do not split into {qtype.name} blocks"
                )
            kind = EXPERTS.search(t.name).group(1)  # type: ignore[union-attr]
            if (kind, shape) not in drawn:
                rows = int(np.prod(shape[:-1]))
                drawn[kind, shape] = random_blocks(qtype, rows, shape[-1], rng).reshape(*shape[:-1], -1)
            data = drawn[kind, shape]
            plan.append((t.name, data, qtype))
        else:
            plan.append((t.name, t.data, t.tensor_type))
    for name, data, qt in plan:
        if qt in (QT.F32, QT.F16, QT.BF16) and data.dtype != np.uint8:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qt)
        else:
            writer.add_tensor_info(name, data.shape, np.dtype(np.uint8), data.nbytes, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in plan:
        writer.write_tensor_data(np.asarray(data))
    writer.close()
    return sum(1 for name, _, _ in plan if EXPERTS.search(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument(
        "--type", required=True, help="the experts' block type (gguf's name, any case: iq4_xs, q8_0)"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        qtype = QT[a.type.upper()]
    except KeyError:
        raise SystemExit(f"--type {a.type}: not a GGUF block type (e.g. IQ4_XS, Q8_0, Q5_K)") from None
    n = retype(a.src, a.dst, qtype, a.seed)
    print(f"wrote {a.dst}: {n} expert tensors as {qtype.name}", file=sys.stderr)


if __name__ == "__main__":
    main()
