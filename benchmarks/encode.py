"""EXL3 codec against exllamav3 1.6.5 on one GPU, in one run (needs the stock build, see stock.py).

(a) decode_inner == exllamav3 `reconstruct`, all K 1..8 (and 1.5/2.5/3.5 for mul1) and codebooks;
(b) layers quantized by xmoe decode identically under exllamav3's kernels (`reconstruct` + Hadamards,
    and its `exl3_gemm` against x @ decode_weight);
(c) encoders on i.i.d. Gaussian tiles at the codebook's std: normalised MSE and tiles/s side by side.
Prints tables; --json PATH writes everything.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stock import load_stock  # noqa: E402
from xmoe.format import CODEBOOKS, codebook_table, decode_inner, decode_weight, had_cols, had_rows  # noqa: E402
from xmoe.quant import quantize_linear  # noqa: E402
from xmoe.quant.viterbi_triton import viterbi_triton  # noqa: E402

FLAGS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}
# Triton Viterbi variants timed side by side (viterbi_triton.TUNED settings, or explicit ones).
VARIANTS = {"xmoe": {}, "fp32": {"half": False}}  # fp32: the fp32-cost kernel at K = 2 too


def check_decode(ext, dev):
    rows = []
    for codebook in CODEBOOKS:
        for K in [1, 2, 3, 4, 5, 6, 7, 8] + ([1.5, 2.5, 3.5] if codebook == "mul1" else []):
            g = torch.Generator().manual_seed(int(K * 10))
            trellis = torch.randint(-32768, 32768, (32, 48, int(16 * K)), generator=g, dtype=torch.int32)
            trellis = trellis.to(torch.int16).to(dev)
            theirs = torch.empty(512, 768, dtype=torch.half, device=dev)
            ext.reconstruct(theirs, trellis, float(K), *FLAGS[codebook])
            ours = decode_inner(trellis, K, codebook)
            rows.append({"codebook": codebook, "K": K, "equal": bool(torch.equal(ours.view(torch.int16),
                                                                                 theirs.view(torch.int16)))})
    return rows


def check_layers(ext, dev):
    rows = []
    for K, codebook in [(2, "mcg"), (3, "mul1"), (4, "3inst"), (2, "mul1")]:
        g = torch.Generator().manual_seed(K)
        weight = (torch.randn(768, 1000, generator=g) * 0.02).to(dev)  # in=1000 pads to 1024
        t = {k: v.to(dev) for k, v in quantize_linear(weight, K, codebook, "viterbi", seed=3).items()}
        what = torch.empty(1024, 768, dtype=torch.half, device=dev)
        ext.reconstruct(what, t["trellis"], float(K), *FLAGS[codebook])
        w_theirs = t["suh"].float()[:, None] * had_rows(had_cols(what.float())) * t["svh"].float()[None, :]
        w_ours = decode_weight(t)
        x = torch.randn(4, 1024, device=dev, dtype=torch.half) * 0.5
        x[:, 1000:] = 0
        y = torch.empty(4, 768, dtype=torch.half, device=dev)
        ext.exl3_gemm(x, t["trellis"], y, t["suh"], torch.empty_like(x), t["svh"], -1, *FLAGS[codebook], 0)
        y_ref = x.float() @ w_ours
        rel = float((w_ours[:1000] - weight.T).pow(2).sum() / weight.pow(2).sum())
        rows.append({"K": K, "codebook": codebook, "weights_equal": bool(torch.equal(w_theirs, w_ours)),
                     "inner_equal": bool(torch.equal(what, decode_inner(t["trellis"].cpu(), K, codebook).to(dev))),
                     "gemm_rel_err": float((y.float() - y_ref).norm() / y_ref.norm()), "quant_rel_err": rel})
    return rows


def stock_encode(ext, tiles, K, codebook):
    dev = tiles.device
    out, idx = torch.empty_like(tiles), torch.empty(tiles.shape, dtype=torch.int16, device=dev)
    B = 256 if K < 4 else max(256, {7: 4, 8: 8}.get(K, 2) * ext.g_get_num_sms(dev.index))
    costs = torch.zeros((B, 2, 65536 >> K), dtype=torch.half, device=dev)
    edges = torch.zeros((B, 256, 65536 >> K), dtype=torch.int16, device=dev)
    ext.quantize_tiles(tiles, out, idx, costs, edges, K, *FLAGS[codebook])
    return out, idx


def timed(fn, reps=1):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        res = fn()
    torch.cuda.synchronize()
    return res, (time.perf_counter() - t0) / reps


def compare_encoders(ext, dev, n_tiles):
    rows = []
    for K in (2, 3, 4):
        for codebook in CODEBOOKS:
            std = codebook_table(codebook).float().std()
            tiles = (torch.randn(n_tiles, 256, generator=torch.Generator().manual_seed(K)) * std).to(dev)
            energy = float(tiles.pow(2).sum())
            (vals, idx), t_stock = timed(lambda: stock_encode(ext, tiles, K, codebook))
            row = {"K": K, "codebook": codebook, "tiles": n_tiles,
                   "stock_nmse": float((vals - tiles).pow(2).sum()) / energy, "stock_tiles_s": n_tiles / t_stock}
            # Stock's states must decode, through our unpack, to the values it reports.
            row["stock_states_consistent"] = bool(torch.equal(
                codebook_table(codebook, dev)[idx.to(torch.int64) & 0xFFFF].float(), vals))
            for name, opts in VARIANTS.items():
                states, t = timed(lambda: viterbi_triton(tiles, K, codebook, **opts))
                v = codebook_table(codebook, dev)[states].float()
                row[f"xmoe_{name}_nmse"] = float((v - tiles).pow(2).sum()) / energy
                row[f"xmoe_{name}_tiles_s"] = n_tiles / t
            rows.append(row)
            print(f"K={K} {codebook:5s} stock {row['stock_nmse']:.5f} @ {row['stock_tiles_s']:7.0f}/s" + "".join(
                f" | {n} {row[f'xmoe_{n}_nmse']:.5f} @ {row[f'xmoe_{n}_tiles_s']:7.0f}/s" for n in VARIANTS), flush=True)
    return rows


def half_launches(dev, n_tiles: int = 1980) -> dict:
    """ms per launch of the K = 2 fp16-pair Viterbi over one wave of tiles (CUDA events, warm, mean of 3)."""
    import triton

    from xmoe.quant import viterbi_half as vh

    tiles = torch.randn(n_tiles, 256, device=dev) * 1.24
    ends = torch.zeros(n_tiles, dtype=torch.int32, device=dev)
    states = torch.empty(n_tiles, 256, dtype=torch.int32, device=dev)
    bp = torch.empty((n_tiles, 256, vh.M2.value), dtype=torch.int32, device=dev)
    grid = (triton.cdiv(n_tiles, 32),)
    launches = {
        "pass 1": lambda: vh._forward_kernel[(n_tiles,)](tiles, ends, bp, CB=1, WARMUP=128, PASS=1, ASM=True,
                                                         num_warps=16),
        "trace 1": lambda: vh._trace_kernel[grid](ends, bp, states, n_tiles, K=2, STEPS=128, STATES=False,
                                                  BLOCK=32),
        "pass 2": lambda: vh._forward_kernel[(n_tiles,)](tiles, ends, bp, CB=1, WARMUP=128, PASS=2, ASM=True,
                                                         num_warps=16),
        "trace 2": lambda: vh._trace_kernel[grid](ends, bp, states, n_tiles, K=2, STEPS=256, STATES=True,
                                                  BLOCK=32)}
    out = {}
    for name, fn in launches.items():
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(3):
            fn()
        b.record()
        torch.cuda.synchronize()
        out[name] = a.elapsed_time(b) / 3
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out["us per step"] = out["pass 2"] * 1e3 / (n_tiles / sms) / 256
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip", nargs="*", default=[], choices=["decode", "layers", "encoders", "launches"])
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    ext = load_stock()
    report = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    if "decode" not in args.skip:
        report["decode"] = check_decode(ext, dev)
        bad = [r for r in report["decode"] if not r["equal"]]
        print(f"(a) decode_inner vs reconstruct: {len(report['decode']) - len(bad)}/{len(report['decode'])} "
              f"bit-exact; mismatches: {bad}", flush=True)
    if "layers" not in args.skip:
        report["layers"] = check_layers(ext, dev)
        print("(b) xmoe-quantized layers under exllamav3 kernels")
        for r in report["layers"]:
            print(f"    K={r['K']} {r['codebook']:5s} W equal: {r['weights_equal']}  W_hat equal: {r['inner_equal']}  "
                  f"exl3_gemm vs x@W rel err {r['gemm_rel_err']:.2e}  quant rel err {r['quant_rel_err']:.4f}")
    if "encoders" not in args.skip:
        print(f"(c) encoders on {args.tiles} Gaussian tiles")
        report["encoders"] = compare_encoders(ext, dev, args.tiles)
    if "launches" not in args.skip:
        report["half_launches"] = half_launches(dev)
        print("(d) K=2 fp16-pair Viterbi, one wave of 1,980 tiles: " +
              ", ".join(f"{k} {v:.2f} {'us' if 'us' in k else 'ms'}" for k, v in report["half_launches"].items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
