"""Fused EXL3 MoE: xmoe's Triton kernels against exllamav3 1.6.5 ("stock", built in the same run) at
DeepSeek-V4.1's per-rank shapes (TP2: 384 experts, hidden 5120, intermediate 1152, top-6, K=2 MCG; --bits and
--codebook change the last two).

Stock is driven as its BlockSparseMLP drives itself (stock_moe.py): the cooperative decode kernels up to 8 tokens;
beyond, its default fused kernel (at mul1 in its own row tiers) with the deterministic slot scratch and gather, and
the batched reconstruct tier (reconstruct_had_batch + hgemm_batched) for experts above the fused kernel's rows.
Each case is timed like with like, L2 flushed:
- ours_us against stock_us: ours replayed from a CUDA graph below EAGER_TOKENS (as vLLM captures those batch
  sizes), stock's forward eagerly beyond 8 tokens (its host work included: its counts are read back); speedup.
- kernel to kernel: both from CUDA graphs, stock's host work (order, counts, slot tables) done outside the graph
  as a server that captures would (stock_graph_us, speedup_graph), below EAGER_TOKENS.
- eager to eager: both called one at a time, host work included (ours_eager_us, speedup_eager), or with
  --pipelined back to back as a model's layers run them.
The 40-layer stack gives every layer its own experts, as a model has.

    python benchmarks/moe_kernel.py [--tokens 6 12 24 48 1542 4096] [--no-stock] [--layers 40] [--pipelined]
                                    [--set FIELD=VALUE ...] [--versus FIELD=VALUE ...] [--json F]
    python benchmarks/moe_kernel.py --sweep --tokens 6 12 --bk 16 32 64 [--table xmoe/kernels/tuning.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from cases import random_experts, routing  # noqa: E402
from common import copy_bandwidth, row, run_info, time_eager, time_graph, time_pipelined, tuning_of  # noqa: E402

from xmoe.kernels import ops  # noqa: E402

E, H, I, TOPK, K = 384, 5120, 1152, 6, 2
CODEBOOK = "mcg"
EAGER_TOKENS = 512  # from here ours is timed eagerly, as vLLM runs batches beyond its CUDA-graph sizes


def touched_bytes(experts, ids) -> tuple[int, int]:
    """(bytes of expert weights the call must read, number of distinct experts)."""
    unique = ids.unique().numel()
    per = sum(w.trellis[0].numel() * 2 + w.suh[0].numel() * 2 + w.svh[0].numel() * 2
              for w in (experts.gate, experts.up, experts.down))
    return unique * per, unique


def bf16_grouped(x, ids, weights, dense):
    """Baseline for prefill: the same MoE on bf16 weights with torch's grouped GEMM."""
    order = ids.reshape(-1).argsort()
    tok = order // TOPK
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    offs = counts.cumsum(0).int()
    xs = x[tok].bfloat16()
    gate, up, down = dense
    h = torch.nn.functional.silu(torch._grouped_mm(xs, gate, offs=offs)) * torch._grouped_mm(xs, up, offs=offs)
    y = torch._grouped_mm(h, down, offs=offs)
    out = torch.zeros(x.shape[0], H, dtype=torch.float, device=x.device)
    return out.index_add_(0, tok, y.float() * weights.reshape(-1)[order, None])


def stock_case(stock, x, ids, weights, ours_fn, result, eager) -> None:
    """Stock's times and ratios for one case, and its output against ours."""
    T = x.shape[0]
    sel, rw = ids.contiguous(), weights.half()
    if T <= 8:
        stock_fn = lambda: stock.decode(x, sel, rw)  # noqa: E731
        result.update(stock_path="exl3_moe_coop (decode)", stock_eager_us=time_eager(stock_fn) * 1e6)
        try:
            result["stock_us"] = result["stock_graph_us"] = time_graph(stock_fn) * 1e6
        except Exception as e:  # timed eagerly then, and said so
            result.update(stock_us=result["stock_eager_us"], stock_graph_error=repr(e)[:200])
    else:
        stock_fn = lambda: stock.forward(x, sel, rw)  # noqa: E731
        result.update(stock_path=stock.path(sel), stock_us=(eager if T >= EAGER_TOKENS else time_eager)(stock_fn) * 1e6)
        result["stock_eager_us"] = result["stock_us"]
        if T < EAGER_TOKENS:
            try:
                result["stock_graph_us"] = time_graph(stock.prepared(x, sel, rw)) * 1e6
            except Exception as e:  # a stock launch that does not capture: say so, keep the eager figures
                result["stock_graph_error"] = repr(e)[:200]
    ref = stock_fn().float()
    got = ours_fn().float()
    result.update(speedup=result["stock_us"] / result["ours_us"],
                  speedup_eager=result["stock_eager_us"] / result["ours_eager_us"],
                  max_rel_diff=float((got - ref).abs().max() / ref.abs().max()))
    if "stock_graph_us" in result:
        result["speedup_graph"] = result["stock_graph_us"] / result["ours_us"]


def run_case(T, skew, experts, stock, bw, dense, dev, eager=time_eager, tuning=None):
    ids, weights = routing(T, E, TOPK, skew, seed=T, device=dev)
    x = torch.randn(T, H, device=dev, dtype=torch.half)
    ours_fn = lambda: ops.fused_moe(x, ids, weights, experts, backend="triton", tuning=tuning)  # noqa: E731
    ours = time_graph(ours_fn) if T < EAGER_TOKENS else eager(ours_fn)
    nbytes, unique = touched_bytes(experts, ids)
    result = dict(tokens=T, routing="skewed" if skew else "uniform", unique_experts=unique, mbytes=nbytes / 1e6,
                  ours_us=ours * 1e6, ours_eager_us=(eager(ours_fn) if T < EAGER_TOKENS else ours) * 1e6,
                  ours_gbs=nbytes / ours / 1e9, ours_pct_bw=100 * nbytes / ours / bw,
                  ours_tweights=unique * 3 * H * I / ours / 1e12)
    if stock is not None:
        try:
            stock_case(stock, x, ids, weights, ours_fn, result, eager)
        except Exception as e:  # report and keep measuring the other cases
            result["stock_error"] = repr(e)[:200]
    if dense is not None and T >= 1024:
        try:
            result["bf16_us"] = time_eager(lambda: bf16_grouped(x, ids, weights, dense)) * 1e6  # bincount syncs
        except Exception as e:
            result["bf16_error"] = repr(e)[:200]
    return result


def stack_step(layers, experts, stock, dev, tokens=6, distinct=True, versus=None):
    """One decode step through `layers` MoE layers (RMS norm, router, routed experts, bf16 shared expert),
    graphed. Each layer has its own experts as in a model (distinct=False: all share one set, which L2 partly
    caches). Without the norm the residual grows until every token picks the same experts."""
    g = torch.Generator(device=dev).manual_seed(0)
    sets = [experts] + [random_experts(E, H, I, K, CODEBOOK, seed=3 * i, device=dev) if distinct else experts
                        for i in range(1, layers)]
    stocks = [stock.over(s) for s in sets] if stock is not None else None
    routers = [torch.randn(H, E, device=dev, dtype=torch.bfloat16, generator=g) / H ** 0.5 for _ in range(layers)]
    shared = [tuple(torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) / s[0] ** 0.5
                    for s in ((H, I), (H, I), (I, H))) for _ in range(layers)]
    x0 = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)

    def step(moe):
        x = x0
        for layer, (router, (sg, su, sd)) in enumerate(zip(routers, shared)):
            h = torch.nn.functional.rms_norm(x, (H,))
            w, ids = (h @ router).float().softmax(-1).topk(TOPK, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            routed = moe(layer, h.half(), ids, w)
            x = x + routed.to(x.dtype) + (torch.nn.functional.silu(h @ sg) * (h @ su)) @ sd
        return x

    out = {"layers": layers, "tokens": tokens, "distinct_experts": distinct}
    seen = []  # distinct experts each layer's tokens pick (eager pass): the stack's routing against the cases'
    step(lambda l, h, i, w: seen.append(i.unique().numel()) or torch.zeros_like(h))
    out["experts_per_layer"] = sum(seen) / len(seen)
    out["other_us"] = time_graph(lambda: step(lambda l, h, i, w: h * w[:, :1].half()), reps=20) * 1e6  # no experts

    def ours(tuning=None):
        return lambda: step(lambda l, h, i, w: ops.fused_moe(h, i, w, sets[l], backend="triton", tuning=tuning))
    out["ours_us"] = time_graph(ours(), reps=20) * 1e6
    if versus:
        out["versus_us"] = time_graph(ours(versus), reps=20) * 1e6
    if stock is not None:
        try:
            out["stock_us"] = time_graph(lambda: step(lambda l, h, i, w: stocks[l].decode(h, i, w.half())),
                                         reps=20) * 1e6
            out["ratio"] = out["ours_us"] / out["stock_us"]
        except Exception as e:
            out["stock_error"] = repr(e)[:200]
    return out


def print_case(r, widths) -> None:
    print(row((r["tokens"], r["routing"], r["unique_experts"], f"{r['mbytes']:.0f}", f"{r.get('stock_us', 0):.1f}",
               f"{r['ours_us']:.1f}", f"{r.get('speedup', 0):.2f}", f"{r.get('speedup_graph', 0):.2f}",
               f"{r.get('speedup_eager', 0):.2f}", f"{r['ours_gbs']:.0f}", f"{r['ours_pct_bw']:.1f}",
               f"{r.get('bf16_us', 0):.0f}", f"{r.get('max_rel_diff', 0):.1e}"), widths), flush=True)
    for key in ("stock_path", "stock_error", "stock_graph_error", "bf16_error"):
        if key in r:
            print(f"  {key}: {r[key]}")


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[6, 12, 24, 48, 1542, 4096])
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--bits", type=float, default=K,
                   help="K of every expert projection (V4.1's pack: 2; half-integer K: mul1 only)")
    p.add_argument("--codebook", choices=("3inst", "mcg", "mul1"), default=CODEBOOK)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--shared-experts", action="store_true", help="every layer of the stack uses the same experts")
    p.add_argument("--profile", action="store_true", help="per-kernel time of one call per token count")
    p.add_argument("--sweep", action="store_true", help="time tiles of the gate/up and down GEMMs (sweep.py)")
    for name, default in (("bm", [16]), ("bk", [16, 32, 64]), ("bn", [32, 64, 128]), ("warps", [4, 8]),
                          ("stages", [1, 2, 3]), ("fill", None)):
        p.add_argument(f"--{name}", type=int, nargs="+", default=default, help=f"--sweep grid ({name})")
    p.add_argument("--table", help="--sweep: write the fastest tile per regime into this tuning table (JSON)")
    p.add_argument("--skewed", action="store_true", help="--sweep, --profile: skewed routing (else uniform)")
    p.add_argument("--set", nargs="+", metavar="FIELD=VALUE", default=[],
                   help="launch settings to measure instead of the device's (Tuning fields; a tile's as gemv.BK=32)")
    p.add_argument("--versus", nargs="+", metavar="FIELD=VALUE", default=[],
                   help="also time our side of every case with these settings, just after the default's")
    p.add_argument("--pipelined", action="store_true", help="time eager calls back to back (else one at a time)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    args.tuning = tuning_of(args.set + ([f"fill={args.fill[0]}"] if args.fill and not args.sweep else []))
    args.versus_tuning = tuning_of(args.versus, args.tuning)  # checked before any GPU work
    return args


def main(argv=None):
    global K, CODEBOOK
    args = arguments(argv)
    K, CODEBOOK = args.bits, args.codebook
    dev = torch.device("cuda")
    experts = random_experts(E, H, I, K, CODEBOOK, device=dev)
    if args.profile or args.sweep:
        from sweep import profile, sweep
        if args.profile:
            return profile(experts, dev, args.tokens, TOPK, args.skewed, args.tuning)
        return sweep(experts, dev, args.tokens, TOPK, vars(args), args.table, args.skewed, args.tuning)
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; calls of {EAGER_TOKENS}+ tokens "
          f"timed eagerly, {'back to back' if args.pipelined else 'one at a time'}")
    stock = None
    if not args.no_stock:
        from stock import load_stock
        from stock_moe import Stock
        stock = Stock(load_stock(), experts, K, CODEBOOK, dev, TOPK)
    dense = None
    if max(args.tokens) >= 1024:
        g = torch.Generator(device=dev).manual_seed(1)
        dense = tuple(torch.randn(E, *s, device=dev, dtype=torch.bfloat16, generator=g) / s[0] ** 0.5
                      for s in ((H, I), (H, I), (I, H)))
    widths = (6, 8, 6, 8, 10, 10, 8, 8, 8, 8, 6, 8, 9)
    print(row(("tokens", "routing", "uniq", "MB", "stock us", "ours us", "speedup", "kernels", "eager", "GB/s",
               "%bw", "bf16 us", "rel diff"), widths))
    results = []
    eager = time_pipelined if args.pipelined else time_eager
    for T in args.tokens:
        for skew in (False, True):
            r = run_case(T, skew, experts, stock, bw, dense, dev, eager, args.tuning)
            if args.versus_tuning:
                r["versus_us"] = run_case(T, skew, experts, None, bw, None, dev, eager, args.versus_tuning)["ours_us"]
                print(f"  {' '.join(args.versus)}: {r['versus_us']:.1f} us")
            results.append(r)
            print_case(r, widths)
    dense = None
    torch.cuda.empty_cache()
    step = stack_step(args.layers, experts, stock, dev, distinct=not args.shared_experts,
                      versus=args.versus_tuning) if args.layers else None
    if step:
        print(f"\n{step['layers']}-layer MoE step ({'distinct' if step['distinct_experts'] else 'shared'} experts per "
              f"layer), {step['tokens']} tokens, one CUDA graph: ours {step['ours_us']:.0f} us, stock "
              f"{step.get('stock_us', 0):.0f} us, ours/stock {step.get('ratio', 0):.2f} {step.get('stock_error', '')}"
              f"\n  {step['experts_per_layer']:.1f} distinct experts per layer; router, shared expert and residual "
              f"alone {step['other_us']:.0f} us" + (f"\n  {' '.join(args.versus)}: ours {step['versus_us']:.0f} us"
                                                    if args.versus_tuning else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(run_info(), copy_gbs=bw / 1e9, pipelined=args.pipelined,
                                                   bits=K, codebook=CODEBOOK, settings=args.set, cases=results,
                                                   stack=step), indent=1))


if __name__ == "__main__":
    main()
