"""Float copies of the weights a CPU model reads every token, up to a RAM budget (`--cpu-weights-mib`)."""

import logging

import psutil

from engine.kernels import cpu_blocks
from engine.layers.qtensor import FloatCache, QTensor
from installer.engine_options import cpu_float_budget

log = logging.getLogger("strata.engine")
MiB = 1 << 20


def budget_bytes(mib: int | None) -> int:
    """`--cpu-weights-mib`: None for the automatic budget, 0 to keep every weight in blocks."""
    if mib is not None:
        return max(0, mib) * MiB
    return cpu_float_budget(psutil.virtual_memory().total)


def attach(model: object, mib: int | None) -> FloatCache | None:
    """Give the 2-D weights of `model`'s CPU parts (the whole model, or each CPU stage of a split) a shared budget
    for float copies. Returns the budget, or None when nothing runs on the CPU or the budget is 0."""
    budget = budget_bytes(mib)
    models = model._models() if hasattr(model, "_models") else [model]  # type: ignore[attr-defined]
    cpu = [
        m
        for m in models
        if getattr(getattr(m, "device", None), "type", None) == "cpu"
        and isinstance(getattr(m, "layers", None), dict)
    ]
    if budget <= 0 or not cpu:
        return None
    cache = FloatCache(budget)
    in_place = floats = 0
    for m in cpu:
        layers = [getattr(lw, "__dict__", {}) for lw in m.layers.values()]
        parts = [getattr(m, "output", None), *[v for d in layers for v in d.values()]]
        weights = [qt for qt in parts if isinstance(qt, QTensor) and len(qt.shape) == 2]
        for qt in parts:
            if qt is not None and hasattr(qt, "gate") and hasattr(qt, "down"):  # routed experts
                # the router (2-D), and gate/up/down: one slice per expert used
                weights += [
                    ex for ex in vars(qt).values() if isinstance(ex, QTensor) and len(ex.shape) in (2, 3)
                ]
        for qt in weights:
            if qt.in_blocks_on_cpu():  # read in place by the CPU kernels: a float copy would only cost RAM
                in_place += 1
            else:
                qt.cache = cache
                floats += 1
    if in_place:
        cpu_blocks.warm_up()
    if floats:
        log.info(
            "CPU: up to %d MiB of weights kept as floats after their first use (--cpu-weights-mib), %d of %d "
            "weights%s",
            budget // MiB,
            floats,
            floats + in_place,
            "" if not in_place else "; the others are read in place from their blocks",
        )
    else:
        log.info(
            "CPU: every weight is read in place from its GGUF blocks (8-bit activations; no float copies)"
        )
    return cache
