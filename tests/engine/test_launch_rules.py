"""Early launches (engine/kernels/launch.py) are safe only if every kernel launched that way waits for the kernel
before it before it reads or writes anything of the step. Checked on the source, so it holds on machines without
a GPU: each kernel launched with `pdl_args` takes `PDL` and calls `pdl_enter(PDL)` before any load, store or
atomic (a `prefetch_l2` of constant weights may come first), and every kernel that takes `PDL` is launched with
it somewhere."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "engine" / "kernels").glob("*.py"))
MEMORY = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min"}
# helpers of the kernel modules that touch memory; a call to one counts as a memory access
ALLOWED_BEFORE = {"prefetch_l2", "program_id", "minimum", "maximum", "cdiv", "num_programs", "arange", "to"}


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).startswith("triton.jit") for d in node.decorator_list
        ):
            out[node.name] = node
    return out


def _launched_with_pdl(tree: ast.Module) -> set[str]:
    """Names of kernels launched as `kernel[grid](..., **pdl_args(...))` (or `**pa` with `pa = pdl_args(...)`)."""
    aliases = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "pdl_args"
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def pdl_kw(kw: ast.keyword) -> bool:
        v = kw.value
        return kw.arg is None and (
            (isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl_args")
            or (isinstance(v, ast.Name) and v.id in aliases)
        )

    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
            and any(pdl_kw(kw) for kw in node.keywords)
        ):
            names.add(node.func.value.id)
    return names


def _calls(node: ast.AST) -> list[str]:
    return [
        (c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", ""))
        for c in ast.walk(node)
        if isinstance(c, ast.Call)
    ]


def _first_wait_is_before_memory(fn: ast.FunctionDef, helpers: set[str]) -> str | None:
    """None when the body reaches `pdl_enter(PDL)` before any memory access; else what came first."""
    body = (
        fn.body[1:]
        if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        else fn.body
    )
    for stmt in body:
        if isinstance(stmt, ast.Expr) and ast.unparse(stmt.value) == "pdl_enter(PDL)":
            return None
        for name in _calls(stmt):
            if name in MEMORY or (name in helpers and name not in ALLOWED_BEFORE):
                return f"{name}(...) in `{ast.unparse(stmt).splitlines()[0]}`"
    return "no pdl_enter(PDL) at the top level of the body"


def test_every_early_launched_kernel_waits_before_touching_memory() -> None:
    trees = {p: ast.parse(p.read_text()) for p in MODULES}
    kernels = {name: fn for t in trees.values() for name, fn in _jit_kernels(t).items()}
    helpers = set(kernels)  # a jit helper may load or store: only prefetch_l2 may run before the wait
    launched = set().union(*(_launched_with_pdl(t) for t in trees.values()))
    assert launched, "no kernel is launched with pdl_args: the check found nothing to check"
    problems = []
    for name in sorted(launched):
        fn = kernels.get(name)
        if fn is None:
            problems.append(f"{name}: launched with pdl_args but not a @triton.jit kernel of engine/kernels")
            continue
        if "PDL" not in [a.arg for a in fn.args.args + fn.args.kwonlyargs]:
            problems.append(f"{name}: launched with pdl_args but takes no PDL")
            continue
        why = _first_wait_is_before_memory(fn, helpers - {name})
        if why:
            problems.append(f"{name}: {why}")
    takes = {n for n, fn in kernels.items() if "PDL" in [a.arg for a in fn.args.args] and n.startswith("_")}
    problems += [f"{n}: takes PDL but no launch passes pdl_args" for n in sorted(takes - launched)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_read_before_the_wait() -> None:
    src = """
@triton.jit
def _k(x_ptr, PDL: tl.constexpr = False):
    \"\"\"doc\"\"\"
    pid = tl.program_id(0)
    v = tl.load(x_ptr + pid)
    pdl_enter(PDL)

@triton.jit
def _ok(x_ptr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if PDL:
        prefetch_l2(x_ptr, 16, PDL)
    pdl_enter(PDL)
    tl.store(x_ptr + pid, 1)

def launch(x):
    pa = pdl_args(x.device)
    _k[(1,)](x, **pdl_args(x.device))
    _ok[(1,)](x, **pa)
"""
    tree = ast.parse(src)
    assert _launched_with_pdl(tree) == {"_k", "_ok"}
    ks = _jit_kernels(tree)
    assert "load" in (_first_wait_is_before_memory(ks["_k"], set()) or "")
    assert _first_wait_is_before_memory(ks["_ok"], {"prefetch_l2"}) is None
