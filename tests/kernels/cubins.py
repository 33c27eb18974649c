"""Kernels compiled for a GPU architecture on any machine (Triton ships ptxas and cuobjdump), and what their
cubins hold. Shared by the compile tests and benchmarks/kernel_sass.py."""
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_gluon(fn, args: dict, const: dict, arch: int, **options):
    """Gluon kernel fn compiled for sm_`arch`: args {name: type} (pointers, sizes), const {name: value}; its
    pointers and sizes aligned as at V4.1 shapes, which decides how the loads are vectorised."""
    from triton.experimental import gluon

    return _compile(gluon._runtime.GluonASTSource, fn, args, const, arch, options)


def compile_triton(fn, args: dict, const: dict, arch: int, **options):
    """The same for a Triton kernel."""
    return _compile(triton.compiler.ASTSource, fn, args, const, arch, options)


def _compile(source, fn, args: dict, const: dict, arch: int, options: dict):
    names = [name for name in fn.arg_names if name in args or name in const]
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in args
               if a.endswith("_ptr") or a in ("k", "n", "stride_te")}
    src = source(fn, signature={name: args.get(name, "constexpr") for name in names}, attrs=aligned,
                 constexprs={(names.index(a),): v for a, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def cuobjdump(cubin: bytes, *args: str) -> str:
    """cuobjdump's output for a cubin (e.g. -sass, -res-usage)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(BIN / "cuobjdump"), *args, str(path)], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> dict:
    """Registers a thread (REG) and local memory (STACK, LOCAL: spills) of a compiled kernel."""
    usage = cuobjdump(cubin, "-res-usage")
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
