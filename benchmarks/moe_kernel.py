"""Fused EXL3 MoE: xmoe's Triton kernel against exllamav3 1.6.5 ("stock", built in the same run) at
DeepSeek-V4.1's per-rank shapes (TP2: 384 experts, hidden 5120, intermediate 1152, top-6, K=2 MCG; --bits and
--codebook change the last two).

Stock is driven the way its BlockSparseMLP drives it: the cooperative decode kernels (exl3_moe_coop) up to 8
tokens, the fused exl3_moe kernel beyond (argsort and bincount included; its host-side count of active experts is
done outside the timing, which favours stock), and a reconstruct + matmul loop for experts with more rows than
exl3_moe takes. Both are timed from CUDA graphs where they capture (ours eagerly from EAGER_TOKENS, launch
overheads included), L2 flushed. Eager calls are timed one at a time (a synchronization after each, so the host's
work ahead of the first kernel counts in full), or with --pipelined back to back as a model's layers run them,
the host queueing the next call while the GPU runs this one. The 40-layer stack gives every layer its own
experts, as a model has.

    python benchmarks/moe_kernel.py [--tokens 6 12 24 48 1542 4096] [--no-stock] [--layers 40] [--pipelined]
                                    [--versus ROWS_MMA=0] [--json F]
"""
import argparse
import copy
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from cases import random_experts, routing  # noqa: E402
from common import copy_bandwidth, ptrs, row, settings, time_eager, time_graph, time_pipelined  # noqa: E402

from xmoe.kernels import ops  # noqa: E402

E, H, I, TOPK, K = 384, 5120, 1152, 6, 2
CODEBOOK = "mcg"
EAGER_TOKENS = 512  # from here ours is timed eagerly, as vLLM runs batches beyond its CUDA-graph sizes


class Stock:
    """exllamav3's MoE paths over the same expert tensors (pointer tables into the stacked tensors)."""

    def __init__(self, ext, experts, dev):
        self.ext, self.dev = ext, dev
        self.tables = self._tables(experts)
        self.experts = experts
        self.cb = (CODEBOOK == "mcg", CODEBOOK == "mul1")  # exllamav3's codebook flags (both off: 3INST)
        S = 8 * TOPK
        h = lambda *s, dt=torch.half: torch.empty(s, dtype=dt, device=dev)  # noqa: E731
        self.coop = (h(S, H), h(S, H), h(S, I), h(S, I), h(S, I), h(S, H, dt=torch.float))
        self.coop_out = h(8, H, dt=torch.float)
        self.ctr = torch.zeros(S * (I // 128) + 8 * (H // 128) + 2 + (S + 1) + S, dtype=torch.int, device=dev)
        self.R = 128
        cc = ext.exl3_moe_max_concurrency(torch.cuda.current_device())
        self.temp = (h(cc, self.R, H), h(cc, self.R, H), h(cc, self.R, I), h(cc, self.R, I))

    def _tables(self, experts):
        """Pointer tables of every expert's trellis, suh and svh, per projection."""
        return [ptrs(list(t), self.dev) for w in (experts.gate, experts.up, experts.down)
                for t in (w.trellis, w.suh, w.svh)]

    def over(self, experts):
        """The same buffers over another set of experts."""
        other = copy.copy(self)
        other.experts, other.tables = experts, self._tables(experts)
        return other

    def decode(self, x, sel, rw):
        self.ext.exl3_moe_coop(x, sel, rw, -1, -1, H, *self.tables, None, None, None, float(K), float(K), float(K),
                               *self.cb, 0, 0.0, True, *self.coop, self.ctr, self.coop_out, None, None)
        return self.coop_out[:x.shape[0]]

    def fused(self, x, sel, rw, num_active, hot):
        T = x.shape[0]
        flat_e, flat_w = sel.reshape(-1), rw.reshape(-1)
        flat_t = torch.arange(T, device=self.dev).repeat_interleave(TOPK)
        order = flat_e.argsort()
        count = torch.bincount(flat_e, minlength=E + 1)
        out = torch.zeros(T, H, dtype=torch.float, device=self.dev)
        self.ext.exl3_moe(x, out, count, flat_t[order], flat_w[order], *self.temp, 0, float(K), float(K), float(K),
                          *self.tables, *self.cb * 3, 0.0, num_active, None, None, 1,
                          self.R, 16)
        for e, tok, w in hot:  # experts above R rows: reconstruct, then fp16 matmuls
            g, u, d = (self._dense(p, e) for p in (self.experts.gate, self.experts.up, self.experts.down))
            xs = x[tok]
            a = torch.nn.functional.silu(xs @ g) * (xs @ u)
            out.index_add_(0, tok, (a @ d).float() * w[:, None].float())
        return out

    def _dense(self, w, e):
        W = torch.empty(w.k, w.n, dtype=torch.half, device=self.dev)
        self.ext.reconstruct_had_slice(W, w.trellis[e], w.suh[e], w.svh[e], float(K), *self.cb, 0)
        return W


def touched_bytes(experts, ids) -> tuple[int, int]:
    """(bytes of expert weights the call must read, number of distinct experts)."""
    unique = ids.unique().numel()
    per = sum(w.trellis[0].numel() * 2 + w.suh[0].numel() * 2 + w.svh[0].numel() * 2
              for w in (experts.gate, experts.up, experts.down))
    return unique * per, unique


def bf16_grouped(x, ids, weights, dense):
    """Baseline for prefill: the same MoE on bf16 weights with torch's grouped GEMM (a loop if absent)."""
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


def run_case(T, skew, experts, stock, bw, dense, dev, eager=time_eager):
    ids, weights = routing(T, E, TOPK, skew, seed=T, device=dev)
    x = torch.randn(T, H, device=dev, dtype=torch.half)
    ours_fn = lambda: ops.fused_moe(x, ids, weights, experts, backend="triton")  # noqa: E731
    ours = time_graph(ours_fn) if T < EAGER_TOKENS else eager(ours_fn)
    nbytes, unique = touched_bytes(experts, ids)
    result = dict(tokens=T, routing="skewed" if skew else "uniform", unique_experts=unique, mbytes=nbytes / 1e6,
                  ours_us=ours * 1e6, ours_gbs=nbytes / ours / 1e9, ours_pct_bw=100 * nbytes / ours / bw,
                  ours_tweights=unique * 3 * H * I / ours / 1e12)
    if stock is not None:
        sel, rw = ids.contiguous(), weights.half()
        try:
            if T <= 8:
                stock_fn = lambda: stock.decode(x, sel, rw)  # noqa: E731
                try:
                    t = time_graph(stock_fn)
                except Exception as e:
                    print(f"  stock decode does not capture ({repr(e)[:80]}); timed eagerly")
                    t = time_eager(stock_fn)
            else:
                count = torch.bincount(sel.reshape(-1), minlength=E)
                big = (count > stock.R).nonzero().flatten().tolist()
                hot = [(e, *torch.nonzero(sel == e, as_tuple=True)) for e in big]
                hot = [(e, tok, weights[tok, slot].half()) for e, tok, slot in hot]
                active = -1 if T * TOPK <= stock.R else int(((count >= 1) & (count <= stock.R)).sum())
                stock_fn = lambda: stock.fused(x, sel, rw, active, hot)  # noqa: E731
                t = (eager if T >= EAGER_TOKENS else time_eager)(stock_fn)
            ref = stock_fn().float()
            got = ops.fused_moe(x, ids, weights, experts, backend="triton").float()
            result.update(stock_us=t * 1e6, speedup=t / ours,
                          max_rel_diff=float((got - ref).abs().max() / ref.abs().max()))
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
    ours = lambda: step(lambda l, h, i, w: ops.fused_moe(h, i, w, sets[l], backend="triton"))  # noqa: E731
    out["ours_us"] = time_graph(ours, reps=20) * 1e6
    if versus:
        with versus():
            out["versus_us"] = time_graph(ours, reps=20) * 1e6
    if stock is not None:
        try:
            out["stock_us"] = time_graph(lambda: step(lambda l, h, i, w: stocks[l].decode(h, i, w.half())),
                                         reps=20) * 1e6
            out["ratio"] = out["ours_us"] / out["stock_us"]
        except Exception as e:
            out["stock_error"] = repr(e)[:200]
    return out


def sweep(experts, dev, tokens, grid, best_path=None, skew=False):
    """Time fused_moe under each launch setting of `grid` (lists of BM, BK, BN, warps, stages; both GEMMs of the
    regime each token count falls in; ops.plan still picks the K split). Writes the fastest setting per regime
    to best_path."""
    tiled = ops.DECODER == "tiled"
    default, default_fill = dict(ops.TUNED), dict(ops.FILL)
    best = {}
    mma = tiled and ops.mma_refusal(experts.gate, dev) is None
    for T in tokens:
        ids, weights = routing(T, E, TOPK, skew, seed=T, device=dev)
        x = torch.randn(T, H, device=dev, dtype=torch.half)
        mode = ops.regime(T * TOPK / ops.expected_experts(T * TOPK, E), tiled, mma)  # as fused_moe plans it
        for *cfg, fill in itertools.product(grid["bm"], grid["bk"], grid["bn"], grid["warps"], grid["stages"],
                                            grid["fill"] or [None]):
            cfg, ops.FILL = tuple(cfg), dict.fromkeys(ops.FILL, fill) if fill else dict(default_fill)
            ops.TUNED[mode, tiled] = cfg
            try:
                t = time_graph(lambda: ops.fused_moe(x, ids, weights, experts, backend="triton"), reps=10)
            except Exception as e:
                print(f"sweep T={T} BM,BK,BN,warps,stages={cfg} fill={fill}: {repr(e)[:80]}", flush=True)
                continue
            print(f"sweep T={T} BM,BK,BN,warps,stages={cfg} fill={fill}: {t * 1e6:.1f} us", flush=True)
            if t < best.get(T, (None, float("inf")))[1]:
                best[T] = (cfg, t, mode)
        ops.TUNED.update(default)
    ops.FILL = default_fill
    for T, (cfg, t, mode) in best.items():
        print(f"best T={T} ({mode}): {cfg} {t * 1e6:.1f} us")
    if best_path:
        Path(best_path).write_text(json.dumps({mode: cfg for cfg, t, mode in best.values()}))


def profile(experts, dev, tokens, skew=False):
    """Per-kernel CUDA time of fused_moe (torch profiler, 20 eager calls): where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for T in tokens:
        ids, weights = routing(T, E, TOPK, skew, seed=T, device=dev)
        x = torch.randn(T, H, device=dev, dtype=torch.half)
        ops.fused_moe(x, ids, weights, experts, backend="triton")
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                ops.fused_moe(x, ids, weights, experts, backend="triton")
            torch.cuda.synchronize()
        events = prof.key_averages()
        busy = sum(ev.self_device_time_total for ev in events) / 20
        wall = time_eager(lambda: ops.fused_moe(x, ids, weights, experts, backend="triton")) * 1e6
        print(f"tokens {T}, {'skewed' if skew else 'uniform'} routing, per call: eager {wall:.0f} us, "
              f"GPU busy {busy:.0f} us")
        for ev in sorted(events, key=lambda ev: -ev.device_time_total)[:12]:
            print(f"  {ev.device_time_total / 20:9.1f} us  {ev.count // 20:3d}x  {ev.key[:90]}")


def main():
    global K, CODEBOOK
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[6, 12, 24, 48, 1542, 4096])
    p.add_argument("--no-stock", action="store_true")
    p.add_argument("--bits", type=float, default=K,
                   help="K of every expert projection (V4.1's pack: 2; half-integer K: mul1 only)")
    p.add_argument("--codebook", choices=("3inst", "mcg", "mul1"), default=CODEBOOK)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--shared-experts", action="store_true", help="every layer of the stack uses the same experts")
    p.add_argument("--profile", action="store_true", help="per-kernel time of one call per token count")
    p.add_argument("--sweep", action="store_true", help="time launch settings of the gate/up and down GEMMs")
    for name, default in (("bm", [16]), ("bk", [16, 32, 64]), ("bn", [32, 64, 128]), ("warps", [4, 8]),
                          ("stages", [1, 2, 3]), ("fill", None)):
        p.add_argument(f"--{name}", type=int, nargs="+", default=default, help=f"--sweep grid ({name})")
    p.add_argument("--best", help="--sweep: write the fastest setting per regime to this JSON file")
    p.add_argument("--skewed", action="store_true", help="--sweep, --profile: skewed routing (else uniform)")
    p.add_argument("--dense-tile", type=int, nargs=5, default=ops.DENSE_TILE,
                   metavar=("BM", "BN", "BK", "WARPS", "STAGES"), help="dense_gemm's launch (ops.DENSE_TILE)")
    p.add_argument("--tuned", help="JSON {regime: [BM, BK, BN, warps, stages], ...} to use; regimes \"mma\", "
                                   "\"rows\", \"gemv\", \"decode\", \"prefill\"")
    p.add_argument("--decoder", choices=("gather", "tiled"), default=ops.DECODER)
    p.add_argument("--swap", nargs="*", choices=("decode", "prefill"), default=sorted(ops.SWAP_AB),
                   help="regimes whose tiled launches multiply W^T a^T (ops.SWAP_AB)")
    p.add_argument("--gemv-rows", type=float, default=ops.GEMV_ROWS,
                   help="rows per chunk up to which tiled launches take grouped_gemv (ops.GEMV_ROWS; 0: never)")
    p.add_argument("--mma-rows", type=float, default=ops.MMA_ROWS,
                   help="rows per chunk up to which grouped_mma takes the call (ops.MMA_ROWS; 0: never)")
    p.add_argument("--rows-mma", type=float, default=ops.ROWS_MMA,
                   help="rows per chunk up to which grouped_mma takes the call in chunks of 32 "
                        "(ops.ROWS_MMA; 0: never)")
    p.add_argument("--dense-rows", type=int, default=ops.DENSE_ROWS,
                   help="rows from which an expert is decoded once and multiplied densely (ops.DENSE_ROWS)")
    p.add_argument("--dense-group", type=int, default=ops.DENSE_GROUP,
                   help="dense experts decoded and multiplied per launch (ops.DENSE_GROUP)")
    p.add_argument("--dense-tma", type=int, choices=(0, 1), default=int(ops.DENSE_TMA),
                   help="dense_gemm_tma (tensor descriptors) where the GPU has TMA (ops.DENSE_TMA)")
    p.add_argument("--epilogue", type=int, nargs=4, default=[v for launch in ops.EPILOGUE for v in launch],
                   metavar=("ROWS", "WARPS", "ROWS_LARGE", "WARPS_LARGE"),
                   help="rows and warps a program of the rotation and the epilogues, up to ops.EPILOGUE_SMALL rows "
                        "and beyond (ops.EPILOGUE)")
    p.add_argument("--mma-maxnreg", type=int, nargs=2, default=ops.MMA_MAXNREG, metavar=("GATE_UP", "DOWN"),
                   help="registers a thread grouped_mma may take (ops.MMA_MAXNREG; 0: the compiler's choice)")
    p.add_argument("--rows-maxnreg", type=int, default=ops.ROWS_MAXNREG,
                   help="the same in the \"rows\" regime (ops.ROWS_MAXNREG)")
    p.add_argument("--versus", nargs="+", metavar="ATTR=VALUE", default=[],
                   help="also time our side of every case with these ops settings (e.g. ROWS_MMA=0), just after "
                        "the default's, in the same process")
    p.add_argument("--pipelined", action="store_true", help="time eager calls back to back (else one at a time)")
    p.add_argument("--json")
    args = p.parse_args()
    ops.DENSE_ROWS, ops.DENSE_TILE, ops.DENSE_GROUP = args.dense_rows, tuple(args.dense_tile), args.dense_group
    ops.DENSE_TMA = bool(args.dense_tma)
    ops.DECODER, ops.SWAP_AB, ops.GEMV_ROWS = args.decoder, set(args.swap), args.gemv_rows
    ops.MMA_ROWS, ops.MMA_MAXNREG = args.mma_rows, tuple(args.mma_maxnreg)
    ops.ROWS_MMA, ops.ROWS_MAXNREG = args.rows_mma, args.rows_maxnreg
    ops.EPILOGUE = tuple(args.epilogue[:2]), tuple(args.epilogue[2:])
    if args.fill and not args.sweep:
        ops.FILL = dict.fromkeys(ops.FILL, args.fill[0])
    if args.tuned:
        for regime, cfg in json.loads(Path(args.tuned).read_text()).items():
            ops.TUNED[regime, args.decoder == "tiled"] = tuple(cfg)
    K, CODEBOOK = args.bits, args.codebook
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s; calls of {EAGER_TOKENS}+ tokens "
          f"timed eagerly, {'back to back' if args.pipelined else 'one at a time'}")
    experts = random_experts(E, H, I, K, CODEBOOK, device=dev)
    if args.profile:
        profile(experts, dev, args.tokens, args.skewed)
        return
    if args.sweep:
        sweep(experts, dev, args.tokens, vars(args), args.best, args.skewed)
        return
    stock = None
    if not args.no_stock:
        from stock import load_stock
        stock = Stock(load_stock(), experts, dev)
    dense = None
    if max(args.tokens) >= 1024:
        g = torch.Generator(device=dev).manual_seed(1)
        dense = tuple(torch.randn(E, *s, device=dev, dtype=torch.bfloat16, generator=g) / s[0] ** 0.5
                      for s in ((H, I), (H, I), (I, H)))
    widths = (6, 8, 6, 8, 10, 10, 8, 8, 6, 8, 10, 9)
    print(row(("tokens", "routing", "uniq", "MB", "stock us", "ours us", "speedup", "GB/s", "%bw", "Tw/s",
               "bf16 us", "rel diff"), widths))
    results = []
    versus = settings(args.versus)
    eager = time_pipelined if args.pipelined else time_eager
    for T in args.tokens:
        for skew in (False, True):
            r = run_case(T, skew, experts, stock, bw, dense, dev, eager)
            if versus:
                with versus():
                    r["versus_us"] = run_case(T, skew, experts, None, bw, None, dev, eager)["ours_us"]
                print(f"  {' '.join(args.versus)}: {r['versus_us']:.1f} us")
            results.append(r)
            print(row((T, r["routing"], r["unique_experts"], f"{r['mbytes']:.0f}", f"{r.get('stock_us', 0):.1f}",
                       f"{r['ours_us']:.1f}", f"{r.get('speedup', 0):.2f}", f"{r['ours_gbs']:.0f}",
                       f"{r['ours_pct_bw']:.1f}", f"{r['ours_tweights']:.2f}", f"{r.get('bf16_us', 0):.0f}",
                       f"{r.get('max_rel_diff', 0):.1e}"), widths), flush=True)
            for key in ("stock_error", "bf16_error"):
                if key in r:
                    print(f"  {key}: {r[key]}")
    dense = None
    torch.cuda.empty_cache()
    step = stack_step(args.layers, experts, stock, dev, distinct=not args.shared_experts,
                      versus=versus) if args.layers else None
    if step:
        print(f"\n{step['layers']}-layer MoE step ({'distinct' if step['distinct_experts'] else 'shared'} experts per "
              f"layer), {step['tokens']} tokens, one CUDA graph: ours "
              f"{step['ours_us']:.0f} us, stock {step.get('stock_us', 0):.0f} us, ours/stock "
              f"{step.get('ratio', 0):.2f} {step.get('stock_error', '')}\n  {step['experts_per_layer']:.1f} distinct "
              f"experts per layer; router, shared expert and residual alone {step['other_us']:.0f} us")
        if versus:
            print(f"  {' '.join(args.versus)}: ours {step['versus_us']:.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), copy_gbs=bw / 1e9,
                                                   pipelined=args.pipelined, cases=results, stack=step), indent=1))


if __name__ == "__main__":
    main()
