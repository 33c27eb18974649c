"""Dense EXL3 linear: xmoe's Triton kernel against exllamav3 1.6.5's exl3_gemm (built in the same run,
autotuned before timing) and a bf16 matmul, at 1-8 and 1,024+ rows, K 2/3/4, MCG (--codebook). CUDA graphs up
to 512 rows, L2 flushed. With --layers N each timing runs N layers of distinct weights in a row (one graph) and
reports the time a layer: a graph of one small call is mostly its own launch, where a model's graph holds them all.
With --merged, layers that read one input (q, k, v; gate, up): each alone, and as one exl3_linear_slices call,
against exllamav3 running them as it does at decode (one sliced exl3_mgemm) and one at a time. --set measures other
launch settings (Tuning fields); with --versus, ours is timed again under other settings, just after the default's,
in the same process.

    python benchmarks/linear_kernel.py [--rows 1 4 8 1024 4096] [--layers 1] [--merged] [--no-stock]
                                       [--set FIELD=VALUE ...] [--versus split_most=48] [--json F]
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from cases import random_weight  # noqa: E402
from common import copy_bandwidth, ptrs, row, run_info, time_eager, time_graph, tuning_of  # noqa: E402

from xmoe.kernels import ops  # noqa: E402
from xmoe.kernels.weights import Exl3Slices  # noqa: E402

SHAPES = [(5120, 5120), (5120, 2304), (2304, 5120)]
# inputs and the widths of layers reading them: q, k, v of 64 query and 4 or 8 KV heads of 128; a gate and up pair
MERGED = [(4096, (8192, 512, 512)), (5120, (8192, 1024, 1024)), (5120, (2304, 2304))]
EAGER_ROWS = 512  # from here ours is timed eagerly, as vLLM runs batches beyond its CUDA-graph sizes


def case(ext, k, n, K, M, bw, dev, codebook, layers=1, versus=None, tuning=None):
    ws = [random_weight(k, n, K, codebook, seed=i, device=dev) for i in range(layers)]
    w = ws[0]
    x = torch.randn(M, k, device=dev, dtype=torch.half)
    timer = time_eager if M >= EAGER_ROWS else time_graph
    def ours_call(t=tuning):
        return lambda: [ops.exl3_linear(x, wi, backend="triton", tuning=t) for wi in ws]
    call = ours_call()
    ours = timer(call) / layers
    nbytes = w.trellis.numel() * 2
    dense = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) for _ in ws]
    xb = x.bfloat16()
    r = dict(k=k, n=n, K=K, rows=M, layers=layers, ours_us=ours * 1e6, ours_gbs=nbytes / ours / 1e9,
             ours_pct_bw=100 * nbytes / ours / bw, ours_tweights=k * n / ours / 1e12,
             bf16_us=time_graph(lambda: [xb @ d for d in dense]) / layers * 1e6)
    if versus:
        base, other = call()[0].float(), ours_call(versus)
        r["versus_us"] = timer(other) / layers * 1e6
        r["versus_diff"] = float((other()[0].float() - base).abs().max() / base.abs().max())
    if ext is not None:
        y, xh = torch.empty(M, n, device=dev, dtype=torch.half), torch.empty_like(x)
        mcg, mul1 = codebook == "mcg", codebook == "mul1"  # exllamav3's codebook flags (both off: 3INST)

        def stock_fn(ws=ws):
            for wi in ws:
                ext.exl3_gemm(x, wi.trellis, y, wi.suh, xh, wi.svh, -1, mcg, mul1, 0)
        try:
            stock_fn(ws[:1])  # autotunes outside the capture
            try:
                t = time_graph(stock_fn) / layers
            except Exception:
                t = time_eager(stock_fn) / layers
            stock_fn(ws[:1])  # y: the first layer's output again, for the comparison
            got = ops.exl3_linear(x, w, backend="triton", tuning=tuning).float()
            r.update(stock_us=t * 1e6, speedup=t / ours,
                     max_rel_diff=float((got - y.float()).abs().max() / y.float().abs().max()))
        except Exception as e:
            r["stock_error"] = repr(e)[:200]
    return r


def stock_sliced(ext, layers, x, codebook):
    """exllamav3's decode path for layers reading one input (attn.py's SlicedMultiLinear): one exl3_mgemm over
    column slices of the widths' gcd, the input rotated once per layer inside it; returns the call and its outputs."""
    m, k = x.shape
    width = math.gcd(*(w.n for w in layers))
    outs = [torch.empty(m, w.n, device=x.device, dtype=torch.half) for w in layers]
    cut = [(i, w, n0) for i, w in enumerate(layers) for n0 in range(0, w.n, width)]
    tables = dict(trellis=[w.trellis.data_ptr() + n0 // 16 * w.trellis.shape[-1] * 2 for _, w, n0 in cut],
                  svh=[w.svh.data_ptr() + n0 * 2 for _, w, n0 in cut],
                  out=[outs[i].data_ptr() + n0 * 2 for i, _, n0 in cut])
    tables = {key: torch.tensor(v, dtype=torch.long, device=x.device) for key, v in tables.items()}
    ints = lambda v: torch.tensor(v, dtype=torch.int32, device=x.device)  # noqa: E731
    sizes, strides, sources = ints([width] * len(cut)), ints([w.n for _, w, _ in cut]), ints([i for i, _, _ in cut])
    suh = ptrs([w.suh for w in layers], x.device)
    carrier = torch.empty(len(cut), m, width, device=x.device, dtype=torch.half)
    rotated = torch.empty(len(layers), m, k, device=x.device, dtype=torch.half)
    K = layers[0].K

    def call():
        ext.exl3_mgemm(x.view(1, m, k), tables["trellis"], carrier, suh, rotated, tables["svh"], None, None, K, -1,
                       codebook == "mcg", codebook == "mul1", -1, -1, 0, 1, sizes, tables["out"], strides, sources,
                       len(layers))
    return call, outs


def merged_case(ext, k, widths, K, M, dev, codebook, layers=1, versus=None, tuning=None):
    sets = [[random_weight(k, n, K, codebook, seed=10 * i + j, device=dev) for j, n in enumerate(widths)]
            for i in range(layers)]
    slices = [Exl3Slices.of(s) for s in sets]
    x = torch.randn(M, k, device=dev, dtype=torch.half)
    apart = time_graph(lambda: [ops.exl3_linear(x, w, backend="triton", tuning=tuning) for s in sets for w in s]) \
        / layers

    def merged_call(t=tuning):
        return lambda: [ops.exl3_linear_slices(x, s, backend="triton", tuning=t) for s in slices]
    call = merged_call()
    merged = time_graph(call) / layers
    dense = [torch.randn(k, sum(widths), device=dev, dtype=torch.bfloat16) for _ in sets]
    xb = x.bfloat16()
    ours = ops.exl3_linear_slices(x, slices[0], backend="triton", tuning=tuning).float()
    apart_out = torch.cat([ops.exl3_linear(x, w, backend="triton", tuning=tuning) for w in sets[0]], 1).float()
    r = dict(k=k, widths=widths, K=K, rows=M, layers=layers, apart_us=apart * 1e6, merged_us=merged * 1e6,
             merged_vs_apart=float((ours - apart_out).abs().max() / apart_out.abs().max()),
             bf16_us=time_graph(lambda: [xb @ d for d in dense]) / layers * 1e6)
    if versus:
        other = merged_call(versus)
        r["versus_us"] = time_graph(other) / layers * 1e6
        r["versus_diff"] = float((other()[0].float() - ours).abs().max() / ours.abs().max())
    if ext is None:
        return r
    try:
        calls = [stock_sliced(ext, s, x, codebook) for s in sets]
        one, y = [torch.empty(M, w.n, device=dev, dtype=torch.half) for w in sets[0]], torch.empty_like(x)
        mcg, mul1 = codebook == "mcg", codebook == "mul1"

        def stock_apart(sets=sets):
            for s in sets:
                for w, out in zip(s, one):
                    ext.exl3_gemm(x, w.trellis, out, w.suh, y, w.svh, -1, mcg, mul1, 0)
        stock_apart(sets[:1])  # autotunes outside the capture
        calls[0][0]()
        r.update(stock_apart_us=time_graph(stock_apart) / layers * 1e6,
                 stock_sliced_us=time_graph(lambda: [c() for c, _ in calls]) / layers * 1e6)
        calls[0][0]()
        stock_out = torch.cat(calls[0][1], 1).float()
        r["stock_vs_ours"] = float((ours - stock_out).abs().max() / stock_out.abs().max())
        r["speedup"] = min(r["stock_apart_us"], r["stock_sliced_us"]) / r["merged_us"]
    except Exception as e:
        r["stock_error"] = repr(e)[:200]
    return r


def merged_table(ext, args, dev) -> list:
    widths = (24, 3, 5, 9, 9, 9, 9, 8, 8, 9, 9)
    print(row(("k -> widths", "K", "rows", "stock 1by1", "stock mg", "ours 1by1", "ours mg", "speedup", "bf16 us",
               "vs stock", "vs 1by1"), widths))
    results = []
    for k, outs in MERGED:
        for K in args.bits:
            for M in args.rows:
                r = merged_case(ext, k, outs, K, M, dev, args.codebook, args.layers, args.versus_tuning, args.tuning)
                results.append(dict(r, codebook=args.codebook))
                print(row((f"{k}->{'/'.join(map(str, outs))}", f"{K:g}", M, f"{r.get('stock_apart_us', 0):.1f}",
                           f"{r.get('stock_sliced_us', 0):.1f}", f"{r['apart_us']:.1f}", f"{r['merged_us']:.1f}",
                           f"{r.get('speedup', 0):.2f}", f"{r['bf16_us']:.1f}", f"{r.get('stock_vs_ours', 0):.1e}",
                           f"{r['merged_vs_apart']:.1e}"), widths), flush=True)
                if "stock_error" in r:
                    print(f"  stock_error: {r['stock_error']}")
                if "versus_us" in r:
                    print(f"  {' '.join(args.versus)}: ours mg {r['versus_us']:.1f} us (diff {r['versus_diff']:.1e})")
    return results


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 1024, 4096])
    p.add_argument("--bits", type=float, nargs="+", default=[2, 3, 4])
    p.add_argument("--layers", type=int, default=1, help="layers of distinct weights a timing runs in a row")
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--merged", action="store_true", help="layers reading one input (MERGED), apart and sliced")
    p.add_argument("--codebook", choices=("3inst", "mcg", "mul1"), default="mcg")
    p.add_argument("--set", nargs="+", metavar="FIELD=VALUE", default=[],
                   help="launch settings to measure instead of the device's (Tuning fields; a tile's as gemv.BK=32)")
    p.add_argument("--versus", nargs="+", metavar="FIELD=VALUE", default=[],
                   help="also time ours with these settings (e.g. split_most=48), just after the default's")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.tuning = tuning_of(args.set)
    args.versus_tuning = tuning_of(args.versus, args.tuning)  # before any GPU work: a bad name stops the run at once
    return args


def main(argv=None):
    args = arguments(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layer(s) a timing")
    ext = None
    if not args.no_stock:
        from stock import load_stock
        ext = load_stock()
    if args.merged:
        results = merged_table(ext, args, dev)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(run_info(), merged=results), indent=1))
        return
    widths = (11, 3, 5, 9, 9, 8, 7, 6, 6, 9, 8)
    print(row(("k x n", "K", "rows", "stock us", "ours us", "speedup", "GB/s", "%bw", "Tw/s", "bf16 us", "rel diff"),
              widths))
    results = []
    for k, n in SHAPES:
        for K in args.bits:
            for M in args.rows:
                r = case(ext, k, n, K, M, bw, dev, args.codebook, args.layers, args.versus_tuning, args.tuning)
                results.append(dict(r, codebook=args.codebook))
                print(row((f"{k}x{n}", f"{K:g}", M, f"{r.get('stock_us', 0):.1f}", f"{r['ours_us']:.1f}",
                           f"{r.get('speedup', 0):.2f}", f"{r['ours_gbs']:.0f}", f"{r['ours_pct_bw']:.1f}",
                           f"{r['ours_tweights']:.2f}", f"{r['bf16_us']:.1f}", f"{r.get('max_rel_diff', 0):.1e}"),
                          widths), flush=True)
                if "stock_error" in r:
                    print(f"  stock_error: {r['stock_error']}")
                if "versus_us" in r:
                    print(f"  {' '.join(args.versus)}: ours {r['versus_us']:.1f} us (diff {r['versus_diff']:.1e})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(run_info(), copy_gbs=bw / 1e9, settings=args.set, cases=results),
                                              indent=1))


if __name__ == "__main__":
    main()
