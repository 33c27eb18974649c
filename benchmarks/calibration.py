"""Calibrated quantization against exllamav3 1.6.5, the format's reference encoder. Prints two tables (--json).

    python benchmarks/calibration.py layers [--bits 2 3 4] [--codebook mul1] [--layers 0 15 29] [--ours-only]
    python benchmarks/calibration.py model  [--bits 2 3] [--codebook mul1] [--layers ...] [--ours-only]

layers: real weights, the demo reference's experts (SmolLM2-135M-Instruct's MLPs: the upcycled experts are
copies of them) with Hessians captured by xmoe's capture (all experts, one layer at a time) from the same
calibration text. For each tensor and K, the proxy error tr(E H E^T) / tr(W H W^T) over the calibration inputs
(undamped H, the stored weight decoded) of exllamav3's own `quantize_exl3` and of xmoe's `quantize_ldlq` on
the same W and H, their ratio, and xmoe's uncalibrated path for scale.

model: the demo reference's experts encoded through xmoe's calibrated converter at each K, once with xmoe's
encoder and once with exllamav3's `quantize_exl3` in its place (same capture, same Hessians: the encoders
compared, not the calibration sets), the rest of the model left bf16; KL(reference || pack) and perplexity
on held-out text (`xmoe eval quality`). exllamav3's full `convert.py` run is not part of this script (its
package needs a dozen more dependencies than its quantizer).

exllamav3's side needs a CUDA GPU and its extension, built by benchmarks/stock.py from the wheel in .whl/
(pip download --no-deps exllamav3==1.6.5 -d .whl); its quantizer's Python module is loaded from the same
wheel with only its package's imports stubbed. --ours-only runs xmoe's side alone (on the CPU: beam encoder).
"""
import argparse
import importlib
import json
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from xmoe.format import decode_weight  # noqa: E402
from xmoe.quant.capture import LayerStack  # noqa: E402
from xmoe.quant.hessian import proxy_error  # noqa: E402
from xmoe.quant.ldlq import quantize_ldlq  # noqa: E402
from xmoe.quant.linear import quantize_linear  # noqa: E402

ROLES = ("gate", "up", "down")
SETTINGS = ("codebook", "rows", "cols", "tokens", "beam_width")  # recorded with the rows of a --json file


def exl3_quantizer():
    """exllamav3's quantize_exl3, from the wheel's own Python source, on its compiled extension."""
    from stock import default_build_dir, find_wheel, load_stock
    ext = load_stock()
    root = Path(default_build_dir()) / "py"
    if not (root / "exllamav3").is_dir():
        with zipfile.ZipFile(find_wheel()) as z:
            z.extractall(root, [m for m in z.namelist() if m.startswith("exllamav3/") and m.endswith((".py", ".txt"))])

    def stub(name, path=None, **attrs):
        m = types.ModuleType(name)
        if path is not None:
            m.__path__ = [str(root / path)]
        m.__dict__.update(attrs)
        sys.modules[name] = m

    class Progress:  # the quantizer's progress bar, silent
        def __init__(self, *a, **k): pass
        def __enter__(self): return self
        def __exit__(self, *a): return False
        def update(self, *a, **k): pass
        def new_task(self, *a, **k): pass

    stub("exllamav3", "exllamav3")
    stub("exllamav3.ext", exllamav3_ext=ext)
    stub("exllamav3.util", "exllamav3/util", cuda_sync_active=lambda *a, **k: None)
    stub("exllamav3.util.progress", ProgressBar=Progress)
    stub("exllamav3.util.memory", free_mem=lambda: torch.cuda.empty_cache(), list_gpu_tensors=lambda *a, **k: None)
    stub("exllamav3.util.tensor", save_tensor_image=lambda *a, **k: None)
    stub("exllamav3.modules", "exllamav3/modules")
    stub("exllamav3.modules.quant", "exllamav3/modules/quant")
    q = importlib.import_module("exllamav3.modules.quant.exl3_lib.quantize")

    def quantize(weight: torch.Tensor, H: torch.Tensor, K: float, codebook: str, seed: int = 0) -> dict:
        """weight (out, in), H (in, in) -> EXL3 tensors, as exllamav3 packs them (k, n padded to 128)."""
        n_out, n_in = weight.shape
        k, n = -(-n_in // 128) * 128, -(-n_out // 128) * 128
        w = torch.zeros(k, n, device="cuda")
        w[:n_in, :n_out] = weight.T.float().cuda()
        Hp = torch.zeros(k, k, device="cuda")
        Hp[:n_in, :n_in] = H.float().cuda()
        args = {"K": K, "seed": seed, "devices": [0], "apply_out_scales": None, "sigma_reg": 0.025,
                "mcg": codebook == "mcg", "mul1": codebook == "mul1"}
        _, _, out = q.quantize_exl3(w, {"H": Hp, "count": 1, "finalized": False}, args, False)
        return {s: t.cpu() for s, t in out.items()}
    return quantize


def capture(reference: Path, layers: list[int], rows: int, cols: int, out: Path) -> None:
    """Expert 0's weights and the all-experts Hessians of each layer in `layers`, into out/layer-L.safetensors."""
    from transformers import AutoTokenizer

    from xmoe.quant.calib_data import calibration_rows
    from xmoe.quant.experts import find_experts
    from xmoe.quant.jobs import load_expert
    from xmoe.quant.plan import read_source
    config, shards = read_source(reference)
    experts = find_experts(config, {t.name: t.shape for ts in shards.values() for t in ts})
    stack = LayerStack(reference, shards, experts, "cuda" if torch.cuda.is_available() else "cpu", torch.float32)
    shard_of = {t.name: s for s, ts in shards.items() for t in ts}
    tokens = calibration_rows(AutoTokenizer.from_pretrained(reference), None, rows, cols)
    states = stack.embed(tokens).cpu()
    for i in range(max(layers) + 1):
        ws = {e: {r: load_expert(reference, shard_of[p.source], p) for r, p in roles.items()}
              for e, roles in stack.experts[i].items()}
        layer = stack.layer(i, ws, capture=i in layers)
        states = stack.forward(layer, states, batch=max(1, 8192 // cols))
        if i in layers:
            H = layer.get_submodule(stack.paths[i]).hessians()
            save_file({"H.input": H["input"].cpu(), "H.down": H["down.0"].cpu(),
                       **{f"W.{r}": ws[0][r].contiguous() for r in ROLES}}, str(out / f"layer-{i}.safetensors"))
        stack.release(i)
        print(f"captured layer {i}", file=sys.stderr)


def layer_table(args) -> list[dict]:
    out = Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    missing = [i for i in args.layers if not (out / f"layer-{i}.safetensors").exists()]
    if missing:
        from xmoe.serve.demo import demo_reference
        capture(Path(args.reference or demo_reference()), missing, args.rows, args.cols, out)
    theirs = None if args.ours_only else exl3_quantizer()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    encoder = "viterbi" if dev == "cuda" else "beam"
    rows = []
    for i in args.layers:
        t = load_file(str(out / f"layer-{i}.safetensors"))
        for r in ROLES:
            W, H = t[f"W.{r}"].to(dev), t["H.down" if r == "down" else "H.input"].to(dev)
            for K in args.bits:
                def err(tensors):
                    e = decode_weight({s: x.to(dev) for s, x in tensors.items()})[:W.shape[1], :W.shape[0]] - W.T
                    return proxy_error(e, W.T, H)
                t0 = time.perf_counter()
                ours = err(quantize_ldlq(W, H, K, args.codebook, encoder, beam_width=args.beam_width)[0])
                row = {"layer": i, "tensor": r, "K": K, "xmoe": ours, "xmoe_s": time.perf_counter() - t0,
                       "xmoe_uncalibrated": err(quantize_linear(W, K, args.codebook, encoder,
                                                                beam_width=args.beam_width))}
                if theirs:
                    t0 = time.perf_counter()
                    row["exllamav3"] = err(theirs(W, H, K, args.codebook))
                    row["exllamav3_s"] = time.perf_counter() - t0
                    row["ratio"] = ours / row["exllamav3"]
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def model_table(args) -> list[dict]:
    """Calibrated packs of the demo reference at each K (xmoe's encoder, then exllamav3's), KL and perplexity."""
    from xmoe.bench.cli import QUALITY_TEXT
    from xmoe.bench.quality import QualityOptions, evaluate
    from xmoe.quant import jobs
    from xmoe.quant.convert import convert
    from xmoe.quant.plan import ConvertOptions
    from xmoe.serve.demo import LAYERS, demo_reference
    reference = Path(args.reference or demo_reference())
    dev = ["cuda:0"] if torch.cuda.is_available() else ["cpu"] * 2
    keep = () if args.layers == list(range(LAYERS)) else (
        rf"^model\.layers\.(?!({'|'.join(map(str, args.layers))})\.)\d+\.",)
    encoders = {f"xmoe ({inputs} inputs)": (jobs.quantize_ldlq, inputs) for inputs in args.inputs}
    if not args.no_uncalibrated:
        encoders["xmoe uncalibrated"] = (None, None)
    if not args.ours_only:
        theirs = exl3_quantizer()

        def exl3_ldlq(w, H, K, codebook, encoder, seed, **kw):
            return theirs(w, H, K, codebook, seed), {"proxy_err": float("nan"), "cholesky_retries": 0}
        encoders["exllamav3 (quantized inputs)"] = (exl3_ldlq, "quantized")
    ours = jobs.quantize_ldlq
    rows = []
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for K in args.bits:
        for name, (fn, inputs) in encoders.items():
            jobs.quantize_ldlq = fn or ours
            opts = ConvertOptions(bits=K, codebook=args.codebook, encoder="viterbi" if dev[0] != "cpu" else "beam",
                                  beam_width=args.beam_width, keep=keep, calibrate=fn is not None,
                                  bits_for=tuple(args.bits_for),
                                  calib_rows=args.rows, calib_cols=args.cols, calib_inputs=inputs or "quantized")
            with tempfile.TemporaryDirectory(dir=args.work) as tmp:
                t0 = time.perf_counter()
                convert(reference, Path(tmp) / "pack", opts, dev)
                seconds = time.perf_counter() - t0
                q = evaluate(str(Path(tmp) / "pack"), str(reference), QualityOptions(QUALITY_TEXT, tokens=args.tokens))
                mix = allocation(Path(tmp) / "pack")
            rows.append({"encoder": name, "K": K, "layers": args.layers, "kl_mean": q["kl_mean"], "ppl": q["ppl"],
                         "ppl_reference": q["ppl_reference"], "build_s": seconds, **mix,
                         **({"bits_for": [f"{p}={k:g}" for p, k in args.bits_for]} if args.bits_for else {})})
            print(json.dumps(rows[-1]), file=sys.stderr)
    jobs.quantize_ldlq = ours
    return rows


def allocation(pack: Path) -> dict:
    """The allocator's choice from the pack's report (K, weight and cost per group), kept before the pack goes."""
    from xmoe.quant.convert import REPORT
    report = json.loads((pack / REPORT).read_text())
    return {"allocation": report["allocation"]} if "allocation" in report else {}


def main() -> int:
    from xmoe.cli import _bits_rule
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=["layers", "model"])
    p.add_argument("--bits", type=float, nargs="+", default=[2, 3, 4])
    p.add_argument("--codebook", default="mul1", choices=["3inst", "mcg", "mul1"])
    p.add_argument("--layers", type=int, nargs="+", default=[0, 15, 29])
    p.add_argument("--reference", help="the unquantized MoE (default: the demo reference, built on first use)")
    p.add_argument("--rows", type=int, default=64, help="calibration rows")
    p.add_argument("--cols", type=int, default=512, help="tokens per calibration row")
    p.add_argument("--tokens", type=int, default=2048, help="model table: tokens of held-out text scored")
    p.add_argument("--beam-width", type=int, default=16, help="xmoe's CPU encoder (GPUs run the Viterbi)")
    p.add_argument("--ours-only", action="store_true", help="xmoe's side only (no GPU, no exllamav3)")
    p.add_argument("--inputs", nargs="*", default=["quantized"], choices=["quantized", "original"],
                   help="model table: where each layer's calibration states come from, one calibrated pack each "
                        "(none: the uncalibrated pack alone)")
    p.add_argument("--no-uncalibrated", action="store_true",
                   help="model table: no uncalibrated pack (its figure is already known for these settings)")
    p.add_argument("--bits-for", type=_bits_rule, action="append", default=[], metavar="PATTERN=K",
                   help="model table: K for expert modules whose key matches PATTERN, as `xmoe quantize` takes it")
    p.add_argument("--work", default="/tmp/xmoe-calibration-bench", help="captured weights and Hessians")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    from common import run_info
    info = run_info()  # at the start: a long run must name the code it ran, not the commit at its end
    rows = layer_table(args) if args.table == "layers" else model_table(args)
    if args.table == "layers":
        print(f"{'layer':>5} {'tensor':<6} {'K':>4} {'xmoe':>9} {'exllamav3':>10} {'ratio':>7} {'uncalibrated':>13}")
        for r in rows:
            theirs = f"{r['exllamav3']:>10.5f} {r['ratio']:>7.3f}" if "exllamav3" in r else f"{'-':>10} {'-':>7}"
            print(f"{r['layer']:>5} {r['tensor']:<6} {r['K']:>4g} {r['xmoe']:>9.5f} {theirs} "
                  f"{r['xmoe_uncalibrated']:>13.5f}")
    else:
        print(f"{'encoder':<30} {'K':>4} {'KL mean':>8} {'ppl':>8} {'ppl ref':>8} {'build s':>8}")
        for r in rows:
            print(f"{r['encoder']:<30} {r['K']:>4g} {r['kl_mean']:>8.4f} {r['ppl']:>8.2f} {r['ppl_reference']:>8.2f} "
                  f"{r['build_s']:>8.0f}")
    if args.json:
        run = {**info, "calibration": args.table, "settings": {k: getattr(args, k) for k in SETTINGS},
               "rows": rows}
        Path(args.json).write_text(json.dumps(run, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
