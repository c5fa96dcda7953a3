"""The engine's GPU kernels (Triton) and what they share with the CPU kernels; importing the package itself loads
no Triton."""

from installer import engine_options


def int8_activations() -> bool:
    """`--activations` (STRATA_ACTIVATIONS, read by installer.engine_options): "int8", the default, lets a GPU
    launch class whose tuning entry has an 8-bit body (a "<class>:q8" key) read activations rounded to 8 bits, as
    llama.cpp's MMVQ does (1.7-2.3x the float bodies' speed on an H200), and lets the CPU's expert kernels
    (engine/experts/cpu_q4k.py) round theirs; "float" keeps every product on float activations (the exact path)."""
    return engine_options.int8_activations()
