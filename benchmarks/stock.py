"""
Build and load the CUDA extension of exllamav3 1.6.5 ("stock") as a benchmark baseline.

exllamav3 ships as a pure-Python wheel that JIT-compiles its C++/CUDA sources
(``exllamav3/exllamav3_ext/``) on first import. Its package ``__init__`` pulls in
dependencies we do not have on the GPU machine, so we never ``import exllamav3``.
Instead we unpack only the extension sources from the wheel and hand them to
``torch.utils.cpp_extension.load`` with the same source list and compiler flags that
exllamav3's ``ext.py`` / ``util/cuda_flags.py`` use for a Linux CUDA build (no ROCm,
no Windows branches).

Wheel lookup order: the ``source`` argument, ``$XMOE_EXL3_WHEEL``, then
``<repo>/.whl/exllamav3-1.6.5-*.whl`` (fetched with
``pip download --no-deps exllamav3==1.6.5 -d .whl``; ``.whl/`` is git-ignored, so on the
device machine it has to be carried explicitly, e.g. ``carry=[".whl"]``). ``source`` may
also be an unpacked wheel directory or the ``exllamav3_ext`` directory itself; those are
compiled in place.

Build reuse: sources are unpacked once into ``<build_dir>/src`` (guarded by a stamp file,
so their mtimes never change) and torch builds into ``build_dir`` itself. A later process
calling ``load_stock`` with the same ``build_dir`` and name only runs a no-op ninja pass
and imports the existing ``.so``; if a build is still running, torch's lock file in
``build_dir`` makes it wait for that build instead of starting another one. (A build that
was killed leaves ``<build_dir>/lock`` behind; delete it by hand.) Typical use::

    nohup python benchmarks/stock.py > /tmp/stock_build.log 2>&1 &   # ~300 s on 16 cores
    ...
    from benchmarks.stock import load_stock
    ext = load_stock()            # waits for / reuses the build above

``XMOE_STOCK_SO=path/to/exllamav3_ext.so`` (or ``.so.xz``) imports a finished build from an identical machine
image instead (a fresh device machine then skips the ~300 s compile); one that does not load there is built.

Command line: ``python benchmarks/stock.py [--build-dir DIR] [--source PATH] [--verbose]
[--dry-run]``. ``--dry-run`` unpacks the sources and prints the sources count and flags
without compiling (works without a GPU).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
import zipfile

EXL3_VERSION = "1.6.5"
EXT_NAME = "exllamav3_ext"                      # the name exllamav3's ext.py builds under
EXT_PREFIX = "exllamav3/exllamav3_ext/"         # location of the sources inside the wheel
DEFAULT_ARCH = "9.0"                            # H200 (sm_90)
DEFAULT_MAX_JOBS = "16"

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_build_dir() -> str:
    """$XMOE_STOCK_BUILD_DIR, else a fixed directory under /tmp (outside the repo, so that
    carrying .whl/ to the device machine never replaces a finished build)."""
    return os.environ.get("XMOE_STOCK_BUILD_DIR") or f"/tmp/xmoe_exl3_stock_{EXL3_VERSION}"


def find_wheel() -> str:
    wheel = os.environ.get("XMOE_EXL3_WHEEL")
    if wheel:
        return wheel
    hits = sorted(glob.glob(os.path.join(REPO_ROOT, ".whl", f"exllamav3-{EXL3_VERSION}-*.whl")))
    if not hits:
        raise FileNotFoundError(
            f"no exllamav3 {EXL3_VERSION} wheel in {REPO_ROOT}/.whl; run "
            f"`pip download --no-deps exllamav3=={EXL3_VERSION} -d .whl` (and carry .whl to the device)"
        )
    return hits[-1]


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unpack_sources(wheel: str, build_dir: str) -> str:
    """Extract exllamav3/exllamav3_ext/ from the wheel into <build_dir>/src/exllamav3_ext,
    once per wheel. Returns the sources directory."""
    src_root = os.path.join(build_dir, "src")
    sources_dir = os.path.join(src_root, EXT_NAME)
    stamp = os.path.join(src_root, "wheel.sha256")
    digest = _sha256(wheel)
    os.makedirs(src_root, exist_ok = True)
    with open(os.path.join(src_root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)        # concurrent first calls unpack once
        if os.path.exists(stamp):
            with open(stamp) as f:
                if f.read().strip() == digest:
                    return sources_dir
        shutil.rmtree(sources_dir, ignore_errors = True)
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if not member.startswith(EXT_PREFIX) or member.endswith("/"):
                    continue
                dest = os.path.join(sources_dir, member[len(EXT_PREFIX):])
                os.makedirs(os.path.dirname(dest), exist_ok = True)
                with z.open(member) as fin, open(dest, "wb") as fout:
                    shutil.copyfileobj(fin, fout)
        with open(stamp, "w") as f:
            f.write(digest + "\n")
    return sources_dir


def resolve_sources_dir(source: str | None, build_dir: str) -> str:
    """source: None (find the wheel), a .whl file, an unpacked wheel dir, or the
    exllamav3_ext dir itself."""
    if source is None or os.path.isfile(source):
        return unpack_sources(source or find_wheel(), build_dir)
    for cand in (os.path.join(source, "exllamav3", EXT_NAME), source):
        if os.path.isfile(os.path.join(cand, "bindings.cpp")):
            return os.path.abspath(cand)
    raise FileNotFoundError(f"{source}: no exllamav3_ext sources (bindings.cpp) found")


# --- mirror of exllamav3/util/cuda_flags.py + ext.py (Linux, CUDA, ext_debug = False) ------------

def extension_sources(sources_dir: str) -> list[str]:
    """All .c/.cpp/.cu translation units, minus rocm/ and hipify outputs, sorted."""
    base = os.path.abspath(sources_dir)
    sources = []
    for root, _, files in os.walk(base):
        for file in files:
            path = os.path.join(root, file)
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            if not file.endswith((".c", ".cpp", ".cu")):
                continue
            if "_hip." in file or file.endswith(".hip") or file.startswith("hip_"):
                continue
            if rel.startswith("rocm/"):
                continue
            sources.append(path)
    return sorted(sources)


def find_nvcc(cuda_home: str | None) -> list[str] | None:
    if os.environ.get("PYTORCH_NVCC"):
        return shlex.split(os.environ["PYTORCH_NVCC"])
    for home in (cuda_home, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return [os.path.join(home, "bin", "nvcc")]
    path = shutil.which("nvcc")
    return [path] if path else None


def nvcc_has_compress_mode(nvcc: list[str] | None) -> bool:
    if not nvcc:
        return False
    try:
        out = subprocess.run(nvcc + ["--help"], capture_output = True, text = True, timeout = 60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--compress-mode" in out


def cuda_cflags(cuda_home: str | None) -> list[str]:
    flags = ["-lineinfo"] if os.environ.get("EXLLAMA_EXT_LINEINFO") else []
    flags += ["-O3", "--use_fast_math",
              "-Xcudafe", "--diag_suppress=177",
              "-Xcudafe", "--diag_suppress=20012"]
    compress = os.environ.get("EXLLAMA_EXT_COMPRESS", "1")
    if compress != "0":
        nvcc = find_nvcc(cuda_home)
        if nvcc_has_compress_mode(nvcc):
            flags += ["--compress-mode=size"]
        elif compress == "require":
            raise RuntimeError("EXLLAMA_EXT_COMPRESS=require, but nvcc lacks --compress-mode")
    return flags


def build_args(sources_dir: str, name: str = EXT_NAME) -> dict:
    """Keyword arguments for torch.utils.cpp_extension.load, as exllamav3's ext.py builds them.
    (ext.py's module-level verbose switch, off by default, would add --ptxas-options=-v; it is
    deliberately not tied to our verbose flag, since changed flags force a full rebuild.)"""
    from torch.utils.cpp_extension import CUDA_HOME
    extra_cuda_cflags = cuda_cflags(CUDA_HOME)
    if os.environ.get("CUDAHOSTCXX"):
        extra_cuda_cflags += ["-ccbin", os.environ["CUDAHOSTCXX"]]
    return dict(
        name = name,
        sources = extension_sources(sources_dir),
        extra_cflags = ["-Ofast"],
        extra_cuda_cflags = extra_cuda_cflags,
        extra_ldflags = [],
        extra_include_paths = [sources_dir],
    )


def _set_build_env(arch: str, max_jobs: str):
    # Only fill in what the caller has not set; ext.py itself derives the list from the visible
    # GPUs when unset (which would give "9.0+PTX" on an H200), we pin sm_90 explicitly
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch)
    os.environ.setdefault("MAX_JOBS", max_jobs)


def load_stock(
    build_dir: str | None = None,
    verbose: bool = False,
    *,
    source: str | None = None,
    name: str = EXT_NAME,
    arch: str = DEFAULT_ARCH,
    max_jobs: str = DEFAULT_MAX_JOBS,
):
    """Build (or reuse) and import the exllamav3 1.6.5 extension; returns the module.

    build_dir: torch build directory (default: default_build_dir()). Reuse across processes
    needs the same build_dir, name and flags.
    source: wheel file, unpacked wheel dir or exllamav3_ext dir (default: the wheel in .whl/).
    """
    prebuilt = os.environ.get("XMOE_STOCK_SO")
    if prebuilt:
        try:
            return load_prebuilt(prebuilt, name)
        except (ImportError, OSError) as e:  # another machine image: build after all
            print(f"XMOE_STOCK_SO={prebuilt} does not load here ({e}); building instead", file = sys.stderr)
    from torch.utils.cpp_extension import load
    build_dir = os.path.abspath(build_dir or default_build_dir())
    os.makedirs(build_dir, exist_ok = True)
    sources_dir = resolve_sources_dir(source, build_dir)
    _set_build_env(arch, max_jobs)
    return load(**build_args(sources_dir, name), build_directory = build_dir, verbose = verbose)


def unpacked(path: str, build_dir: str | None = None) -> str:
    """The shared object at `path`, or for `.so.xz` its contents, decompressed once into build_dir/prebuilt
    (atomically, so an interrupted copy is never imported)."""
    if not path.endswith(".xz"):
        return path
    import lzma
    out_dir = os.path.join(os.path.abspath(build_dir or default_build_dir()), "prebuilt")
    out = os.path.join(out_dir, os.path.basename(path)[:-3])
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(path):
        os.makedirs(out_dir, exist_ok = True)
        tmp = f"{out}.{os.getpid()}.tmp"
        with lzma.open(path) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, out)
    return out


def load_prebuilt(path: str, name: str = EXT_NAME):
    """Import an extension built earlier on an identical machine image ($XMOE_STOCK_SO: the .so, or the .so
    compressed by xz, which fits the device's 16 MiB a returned file), skipping the build."""
    import importlib.util
    import torch  # noqa: F401  (the extension links against torch's libraries)
    spec = importlib.util.spec_from_file_location(name, unpacked(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_in_background(build_dir: str | None = None, log_path: str | None = None) -> subprocess.Popen:
    """Start `python stock.py --build-dir ...` detached; a later load_stock(build_dir) reuses it."""
    build_dir = os.path.abspath(build_dir or default_build_dir())
    os.makedirs(build_dir, exist_ok = True)
    log = open(log_path or os.path.join(build_dir, "build.log"), "w")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--build-dir", build_dir],
        stdout = log, stderr = subprocess.STDOUT, start_new_session = True,
    )


def exported_names(module) -> list[str]:
    return sorted(n for n in dir(module) if not n.startswith("_"))


def main(argv = None):
    ap = argparse.ArgumentParser(description = __doc__.strip().splitlines()[0])
    ap.add_argument("--build-dir", default = None)
    ap.add_argument("--source", default = None, help = "wheel, unpacked wheel dir or exllamav3_ext dir")
    ap.add_argument("--verbose", action = "store_true")
    ap.add_argument("--dry-run", action = "store_true", help = "unpack and print flags, do not compile")
    args = ap.parse_args(argv)

    build_dir = os.path.abspath(args.build_dir or default_build_dir())
    if args.dry_run:
        os.makedirs(build_dir, exist_ok = True)
        sources_dir = resolve_sources_dir(args.source, build_dir)
        kw = build_args(sources_dir)
        print(f"build_dir:           {build_dir}")
        print(f"sources_dir:         {sources_dir}")
        print(f"name:                {kw['name']}")
        print(f"sources:             {len(kw['sources'])} files (.cu: "
              f"{sum(s.endswith('.cu') for s in kw['sources'])})")
        for key in ("extra_cflags", "extra_cuda_cflags", "extra_ldflags", "extra_include_paths"):
            print(f"{key + ':':<21}{kw[key]}")
        print(f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', DEFAULT_ARCH)} "
              f"MAX_JOBS={os.environ.get('MAX_JOBS', DEFAULT_MAX_JOBS)}")
        return

    t0 = time.time()
    ext = load_stock(build_dir, args.verbose, source = args.source)
    print(f"loaded {ext.__name__} from {ext.__file__} in {time.time() - t0:.1f} s")
    names = exported_names(ext)
    print(f"{len(names)} exported names:")
    print(" ".join(names))


if __name__ == "__main__":
    main()
