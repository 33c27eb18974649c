"""benchmarks/moe_kernel.py --sweep and --profile: the launch tiles of fused_moe timed on the GPU, the fastest
written into the tuning table; and where a call's time goes, per kernel."""
import datetime
import itertools
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from cases import routing
from common import run_info, time_eager, time_graph

from xmoe.kernels import ops
from xmoe.kernels.plan import is_tiled, mma_refusal, regime, target_of, tile_name
from xmoe.kernels.routing import expected_experts
from xmoe.kernels.tuning import gpu_key, tuning_for, write_entry


def regime_field(T: int, top_k: int, experts, target, tuning) -> str:
    """The Tuning field of the tile gate and up take in a call of T tokens, as fused_moe plans it."""
    g = experts.gate
    P, E = T * top_k, experts.count
    rows = P / expected_experts(P, E)
    tiled = is_tiled(g.K, tuning)
    mma = mma_refusal(g.K, target, tuning) is None and mma_refusal(experts.down.K, target, tuning) is None
    mode = regime(rows, tiled, mma, tuning=tuning)
    return tile_name(mode, tiled or mode.startswith("mma"))


def sweep(experts, dev, tokens, top_k, grid, table=None, skew=False, base=None) -> None:
    """Time fused_moe under each tile of `grid` (lists of bm, bk, bn, warps, stages, fill) in the regime each token
    count falls in (both GEMMs; the plan still picks the K split). With `table`, the tile of least total time per
    regime goes into the table's entry for this GPU."""
    base = base or tuning_for(str(dev))
    target = target_of(dev)
    totals = defaultdict(lambda: defaultdict(float))
    for T in tokens:
        ids, weights = routing(T, experts.count, top_k, skew, seed=T, device=dev)
        x = torch.randn(T, experts.hidden, device=dev, dtype=torch.half)
        field = regime_field(T, top_k, experts, target, base)
        now = getattr(base, field)
        for BM, BK, BN, warps, stages, fill in itertools.product(grid["bm"], grid["bk"], grid["bn"], grid["warps"],
                                                                  grid["stages"], grid["fill"] or [None]):
            tile = replace(now, BM=BM, BK=BK, BN=BN, warps=warps, stages=stages, fill=fill or now.fill)
            tuning = replace(base, **{field: tile})
            try:
                t = time_graph(lambda: ops.fused_moe(x, ids, weights, experts, backend="triton", tuning=tuning),
                               reps=10)
            except Exception as e:
                print(f"sweep T={T} {field} {tile}: {repr(e)[:80]}", flush=True)
                totals[field][tile] = float("inf")
                continue
            print(f"sweep T={T} {field} {tile}: {t * 1e6:.1f} us", flush=True)
            totals[field][tile] += t
    best = {field: min(times, key=times.get) for field, times in totals.items()}
    for field, tile in best.items():
        print(f"best {field}: {tile} ({totals[field][tile] * 1e6:.1f} us over its token counts)")
    if table:
        props = torch.cuda.get_device_properties(dev)
        info = run_info()
        write_entry(gpu_key((props.major, props.minor), props.multi_processor_count), replace(base, **best),
                    dict(gpus=props.name, commit=info["commit"], date=datetime.date.today().isoformat(),
                         measured=f"benchmarks/moe_kernel.py --sweep --tokens {' '.join(map(str, tokens))}"),
                    path=Path(table))


def profile(experts, dev, tokens, top_k, skew=False, tuning=None) -> None:
    """Per-kernel CUDA time of fused_moe (torch profiler, 20 eager calls): where a call's time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for T in tokens:
        ids, weights = routing(T, experts.count, top_k, skew, seed=T, device=dev)
        x = torch.randn(T, experts.hidden, device=dev, dtype=torch.half)

        def call():
            return ops.fused_moe(x, ids, weights, experts, backend="triton", tuning=tuning)
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        events = prof.key_averages()
        busy = sum(ev.self_device_time_total for ev in events) / 20
        wall = time_eager(call) * 1e6
        print(f"tokens {T}, {'skewed' if skew else 'uniform'} routing, per call: eager {wall:.0f} us, "
              f"GPU busy {busy:.0f} us")
        for ev in sorted(events, key=lambda ev: -ev.device_time_total)[:12]:
            print(f"  {ev.device_time_total / 20:9.1f} us  {ev.count // 20:3d}x  {ev.key[:90]}")
