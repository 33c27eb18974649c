"""`xmoe wheelhouse`: everything a GPU host without registry access needs to serve with vLLM, built on a
connected machine for that host (its Python, platform and vLLM release, minus what it already has).

    target$ python3 -m pip freeze > have.txt                       # what the target already holds
    here$   xmoe wheelhouse OUT --vllm 0.26.0 --python 3.12 --have have.txt --drop-fa2 --part-mb 56
    target$ python3 OUT/install.py OUT                              # or: install.py PART1 PART2 ...

Resolution is uv's (`uv pip compile` for the target's Python and platform). Packages the target has are
pinned to its versions; torch, triton and the CUDA libraries are left out entirely (their wheels are the
target's own build). `--part-mb` cuts the wheelhouse into folders of at most that size, splitting large
wheels, for transfers with a size limit; `install.py` joins and checks them (sha256) before installing.
"""
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# The target's own builds, never replaced: dropped from the resolution with their requirements.
OPAQUE = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|jax.*|cupy.*)$")
# vLLM requirements a text-serving host does not load (other attention or GEMM back ends, video, tracing).
SKIP = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "nvidia-cutlass-dsl",
        "quack-kernels", "tokenspeed-mla", "humming-kernels", "pynvvideocodec", "torchcodec",
        "opencv-python-headless", "nvidia-cudnn-frontend", "fastsafetensors", "numba",
        "opentelemetry-exporter-otlp")
# Files of the vLLM wheel a host may not need: FlashAttention-2 (Hopper and newer run FA3/FA4) and the
# optional Rust front end (used only with VLLM_RUST_FRONTEND_PATH).
FA2 = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
RUST_FRONTEND = "vllm/vllm-rs"
INSTALLER = Path(__file__).with_name("wheelhouse_install.py")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> dict[str, str]:
    """{name: version} from `pip freeze` output (editable and URL lines are skipped)."""
    have = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith(("#", "-")):
            have[canonical(name)] = version.split(";")[0].strip()
    return have


@dataclass(frozen=True)
class Target:
    vllm: str
    python: str = "3.12"
    platform: str = "manylinux_2_28_x86_64"
    have: dict = field(default_factory=dict)
    skip: tuple = SKIP
    extra: tuple = ("openai", "httpx", "gguf>=0.10", "transformers>=5.0")  # xmoe's serve extra

    @property
    def uv_platform(self) -> str:
        """uv's name for the platform: manylinux_2_28_x86_64 is x86_64-manylinux_2_28."""
        m = re.fullmatch(r"(manylinux_\d+_\d+)_(x86_64|aarch64)", self.platform)
        if not m:
            raise ValueError(f"platform {self.platform!r}: expected a tag like manylinux_2_28_x86_64")
        return f"{m.group(2)}-{m.group(1)}"

    def overrides(self) -> list[str]:
        never = '; sys_platform == "never"'
        lines = [f"{n}{never}" for n in self.skip]
        for name, version in sorted(self.have.items()):
            lines.append(f"{name}{never}" if OPAQUE.match(name) else f"{name}=={version}")
        return lines + [f"{n}{never}" for n in ("torch", "torchvision", "torchaudio", "triton")
                        if n not in self.have]


def resolve(target: Target, work: Path) -> dict[str, str]:
    """{name: version} of every package the target needs, as uv resolves it for the target."""
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("xmoe wheelhouse resolves with uv: pip install uv")
    req, over, out = work / "requirements.in", work / "overrides.txt", work / "requirements.txt"
    req.write_text("\n".join([f"vllm=={target.vllm}", *target.extra]) + "\n")
    over.write_text("\n".join(target.overrides()) + "\n")
    cmd = [uv, "pip", "compile", str(req), "--override", str(over), "--python-version", target.python,
           "--python-platform", target.uv_platform, "--only-binary", ":all:", "--no-header", "--no-annotate",
           "--quiet", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"uv could not resolve vllm=={target.vllm} for Python {target.python} on "
                           f"{target.platform}:\n{done.stderr.strip()[-3000:]}")
    pins = {}
    for line in out.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[canonical(name)] = version.strip()
    return pins


def download(target: Target, pins: dict[str, str], dest: Path) -> None:
    """The wheels of `pins` that the target lacks, for the target's Python and platform."""
    need = [f"{n}=={v}" for n, v in sorted(pins.items()) if target.have.get(n) != v]
    if not need:
        return
    arch = target.platform.split("_", 3)[-1]
    glibc = int(target.platform.split("_")[2])
    # pip matches platform tags exactly: name every older glibc the target also runs
    platforms = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)] + [f"manylinux2014_{arch}",
                                                                            f"manylinux1_{arch}"]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           "--python-version", target.python, "--implementation", "cp", "-d", str(dest), *need]
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)


def strip_wheel(wheel: Path, drop: set[str]) -> int:
    """Remove files from a wheel in place (RECORD rewritten); returns the bytes saved."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if line.split(",")[0] not in drop).encode()
            dst.writestr(info, data)
    tmp.replace(wheel)
    return before - wheel.stat().st_size


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cut_into_parts(wheels: Path, out: Path, part_bytes: int) -> list[dict]:
    """Move the wheels into out/part1..N of at most `part_bytes` each, a wheel larger than that in pieces
    (`NAME.000`, `.001`, ...); returns the manifest entries."""
    pieces = []  # (size, source, offset, piece name, wheel)
    for whl in sorted(wheels.glob("*.whl")):
        size = whl.stat().st_size
        if size <= part_bytes:
            pieces.append((size, whl, 0, whl.name, whl.name))
            continue
        for i, start in enumerate(range(0, size, part_bytes)):
            pieces.append((min(part_bytes, size - start), whl, start, f"{whl.name}.{i:03d}", whl.name))
    parts: list[list] = []
    for piece in sorted(pieces, key=lambda p: -p[0]):  # first fit, largest first
        home = next((p for p in parts if sum(x[0] for x in p) + piece[0] <= part_bytes), None)
        if home is None:
            parts.append(home := [])
        home.append(piece)
    manifest = {}
    for n, part in enumerate(parts, 1):
        folder = out / f"part{n}"
        folder.mkdir(parents=True, exist_ok=True)
        for size, src, start, name, wheel in part:
            with open(src, "rb") as f:
                f.seek(start)
                (folder / name).write_bytes(f.read(size))
            manifest.setdefault(wheel, {"sha256": sha256(src), "pieces": []})["pieces"].append(name)
    return [{"wheel": w, **m, "pieces": sorted(m["pieces"])} for w, m in sorted(manifest.items())]


def build(target: Target, out: Path, drop: set[str], part_mb: int | None) -> dict:
    """Resolve, download, strip and (optionally) cut; writes out/manifest.json and out/install.py."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pins = resolve(target, work)
        wheels = work / "wheels"
        download(target, pins, wheels)
        saved = sum(strip_wheel(w, drop) for w in wheels.glob("vllm-*.whl")) if drop else 0
        if part_mb:
            entries = cut_into_parts(wheels, out, part_mb * 2 ** 20)
        else:
            (out / "part1").mkdir(exist_ok=True)
            entries = []
            for whl in sorted(wheels.glob("*.whl")):
                entries.append({"wheel": whl.name, "sha256": sha256(whl), "pieces": [whl.name]})
                shutil.move(str(whl), out / "part1" / whl.name)
    manifest = {"vllm": target.vllm, "python": target.python, "platform": target.platform,
                "dropped_files": sorted(drop), "skipped_packages": list(target.skip), "wheels": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy(INSTALLER, out / "install.py")
    return {"wheels": len(entries), "bytes": sum(f.stat().st_size for f in out.rglob("*.whl*")),
            "parts": len(list(out.glob("part*"))), "stripped_bytes": saved}


def _run(args) -> int:
    have = read_freeze(args.have) if args.have else {}
    target = Target(args.vllm, args.python, args.platform, have,
                    tuple(n for n in SKIP if n not in args.keep) + tuple(args.skip))
    drop = ({FA2} if args.drop_fa2 else set()) | ({RUST_FRONTEND} if not args.keep_rust_frontend else set())
    info = build(target, args.out, drop, args.part_mb)
    stripped = f", {info['stripped_bytes'] / 2 ** 20:.0f} MiB stripped from vLLM" if drop else ""
    print(f"wheelhouse {args.out}: {info['wheels']} wheels, {info['bytes'] / 2 ** 20:.0f} MiB in "
          f"{info['parts']} part(s){stripped}")
    print(f"on the target: python3 {args.out.name}/install.py {args.out.name}")
    return 0


def add_wheelhouse_parser(sub) -> None:
    w = sub.add_parser("wheelhouse", help="build an offline install of vLLM (and what xmoe serve needs) for a "
                                          "GPU host without registry access")
    w.add_argument("out", type=Path, help="output folder (part1..N, manifest.json, install.py)")
    w.add_argument("--vllm", required=True, help="vLLM release, e.g. 0.26.0 (the plugin supports 0.26-0.32)")
    w.add_argument("--python", default="3.12", help="the target's Python version (default 3.12)")
    w.add_argument("--platform", default="manylinux_2_28_x86_64", help="the target's newest manylinux tag")
    w.add_argument("--have", type=Path, help="`pip freeze` of the target: those packages stay as they are")
    w.add_argument("--drop-fa2", action="store_true", help="leave out FlashAttention-2 (Hopper and newer "
                                                           "never load it; ~130 MB)")
    w.add_argument("--keep-rust-frontend", action="store_true", help="keep vLLM's optional Rust front end")
    w.add_argument("--skip", action="append", default=[], metavar="NAME", help="leave out this package too")
    w.add_argument("--keep", action="append", default=[], metavar="NAME",
                   help=f"include a package left out by default ({', '.join(SKIP)})")
    w.add_argument("--part-mb", type=int, help="cut into folders of at most this many MiB (large wheels split)")
    w.set_defaults(func=_run)
