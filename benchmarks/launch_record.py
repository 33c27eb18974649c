"""Every kernel launch the ops layer issues, recorded on the CPU without running the GEMMs: kernel, grid, every
argument (tensors as dtype, shape and strides; scalars and constexprs as values). Two checkouts that record the
same file launch the same kernels with the same settings for every call in the grid, so a change to the
planning or the launchers that keeps the record keeps the outputs bit for bit and the speed.

Runs under TRITON_INTERPRET=1 (set here). Only the routing feeds the host (the dense path reads its counts back):
route_small runs interpreted, route_scatter's runs of experts and hot_experts' tables are computed in torch (the
interpreter takes minutes for them at prefill sizes), every other launch is recorded and skipped. --target h100
answers the planner's questions about the device as an H100 or H200 would (132 multiprocessors, grouped_mma
available); cpu as the CPU does.

    python benchmarks/launch_record.py --out launches.json [--target cpu h100] [--quick]
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: kernels are made interpreted when defined
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from cases import routing  # noqa: E402

from xmoe.kernels.weights import Exl3Experts, Exl3Slices, Exl3Weight  # noqa: E402

RUN = {"route_small"}  # run interpreted: the dense path reads what it writes
TOKENS = (1, 2, 4, 6, 8, 12, 16, 32, 48, 128, 1542, 4096)
BITS = [(K, cb) for K in (1, 2, 3, 4) for cb in ("mcg", "3inst", "mul1")] + [(K, "mul1") for K in (1.5, 2.5, 3.5)]
MOE_SHAPES = ((384, 5120, 1152, 6), (64, 1024, 384, 8))  # experts, hidden, intermediate, top-k
LINEAR_SHAPES = ((5120, 2304), (2304, 5120), (5120, 1152), (1152, 5120), (4096, 4096), (576, 1536), (200, 300))
SLICES = ((5120, (5120, 1024, 1024)), (5120, (2304, 2304)), (4096, (4096, 512, 512)))
log: list = []


def describe(value):
    """A launch argument as it decides the compiled kernel and its work: tensors by dtype, shape and strides."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape), list(value.stride())]
    if type(value).__name__ == "TensorDescriptor":
        return ["descriptor", describe(value.base), list(value.shape), list(value.strides), list(value.block_shape)]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def recording(original):
    def launch(self, grid):
        run = original(self, grid)
        fn = getattr(self, "fn", None)
        name = getattr(fn, "__name__", repr(self))
        kind = "gluon" if type(self).__name__.startswith("Gluon") else "triton"

        def call(*args, **kwargs):
            log.append([kind, name, list(grid), [describe(a) for a in args],
                        {k: describe(v) for k, v in sorted(kwargs.items())}])
            if name in RUN and kind == "triton":
                return run(*args, **kwargs)
            if name in EMULATED:
                EMULATED[name](*args, **kwargs)
        return call
    return launch


def route_scatter(ids, emap, hist, rows, sorted_expert, slot_pos, slot_expert, table, runs, count, P, E, blocks,
                  stride, TOPK, BM, HAS_MAP, **_):
    """What the host reads of route_scatter: each local expert's run of sorted positions, and the chunk count."""
    key = (emap[ids.long()] if HAS_MAP else ids).reshape(-1).long()
    total = torch.bincount(torch.where(key >= 0, key, E), minlength=E + 1)[:E]
    ends = total.cumsum(0)
    runs[:E], runs[E:2 * E] = (ends - total).int(), ends.int()
    count[0] = int((-(-total // BM)).sum())


def hot_experts(runs, flags, ids, table, counts, E, rows, rest, stride_runs, stride_table, BM, G, EB, GB, **_):
    """hot_experts in torch: the call's dense experts, their chunks and the counts the host reads."""
    start = runs.reshape(-1)[:E].long()
    length = runs.reshape(-1)[stride_runs:stride_runs + E].long() - start
    hot = (length >= rows) & (length > 0)
    left = (length > 0) & ~hot
    every = int(left.sum()) <= rest
    dense = hot | (left & every)
    flags[:E], flags[E] = dense.int(), 0
    chunks = torch.where(dense, -(-length // BM), 0)
    at, rank = 0, 0
    per_group = [0] * GB
    for e in dense.nonzero().flatten().tolist():
        ids[rank] = e
        for j in range(int(chunks[e])):
            table[0, at], table[1, at], table[2, at] = start[e] + j * BM, min(int(length[e]) - j * BM, BM), rank % G
            at += 1
        per_group[rank // G] += int(chunks[e])
        rank += 1
    counts[0], counts[1] = rank, int(every)
    counts[2:] = torch.tensor(per_group, dtype=counts.dtype)


EMULATED = {"route_scatter": route_scatter, "hot_experts": hot_experts}


def record_mm(mm):
    def call(a, b, *args, out=None, **kwargs):  # the dense path's matmuls: recorded, not computed
        log.append(["torch", "mm", [], [describe(a), describe(b), describe(out)], {}])
        return out if out is not None else torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    return call


def weight(k: int, n: int, K: float, codebook: str, experts: int = 0) -> Exl3Weight:
    """A layer (or a stack of experts) of the right shapes whose tensors take no memory: GEMMs are not run."""
    lead = (experts,) if experts else ()
    trellis = torch.zeros(1, k // 16, n // 16, int(16 * K), dtype=torch.int16).expand(*lead or (1,), -1, -1, -1)
    trellis = trellis if experts else trellis[0]
    vec = lambda m: torch.ones(1, m, dtype=torch.float16).expand(*lead or (1,), -1)  # noqa: E731
    vec = (lambda m, v=vec: v(m)) if experts else (lambda m, v=vec: v(m)[0])
    return Exl3Weight(trellis, vec(k), vec(n), K, codebook, k, n)


def padded(m: int) -> int:
    return -(-m // 128) * 128


def moe_calls(quick: bool):
    for E, H, I, top_k in MOE_SHAPES[:1] if quick else MOE_SHAPES:
        for K, cb in BITS[:4] if quick else BITS:
            down_K = {2: 3, 3: 2}.get(K, K) if cb == "mcg" else K  # mixed K: one chunking serves both GEMMs
            for K_down in sorted({K, down_K}):
                experts = Exl3Experts(weight(H, I, K, cb, E), weight(H, I, K, cb, E), weight(I, H, K_down, cb, E))
                for T in TOKENS[:6] if quick else TOKENS:
                    for skew in (False, True):
                        yield f"moe E={E} {H}x{I} top{top_k} K={K}/{K_down} {cb} T={T} skew={skew}", \
                            (T, H, top_k, E, skew, experts, None)
                if E == 384 and K == 2 and cb == "mcg":  # expert parallelism: this rank owns the middle half
                    half = Exl3Experts(*(weight(w.k, w.n, w.K, cb, E // 2) for w in (experts.gate, experts.up,
                                                                                       experts.down)))
                    emap = torch.full((E,), -1, dtype=torch.int32)
                    emap[E // 4:E // 4 + E // 2] = torch.arange(E // 2, dtype=torch.int32)
                    for T in TOKENS:
                        yield f"moe ep E={E} T={T}", (T, H, top_k, E, True, half, emap)


def run_moe(ops, T, H, top_k, E, skew, experts, emap):
    ids, w = routing(T, E, top_k, skew, seed=T)
    x = torch.zeros(T, H, dtype=torch.float16)
    ops.fused_moe(x, ids, w, experts, expert_map=emap, backend="triton")


def linear_calls(quick: bool):
    bits = ((2, "mcg"), (3, "mul1"), (4, "3inst"), (1, "mcg"), (2.5, "mul1"), (8, "mcg"), (3, "mcg"))
    for k, n in LINEAR_SHAPES[:2] if quick else LINEAR_SHAPES:
        for K, cb in bits[:3] if quick else bits:
            w = weight(padded(k), padded(n), K, cb)
            w = Exl3Weight(w.trellis, w.suh, w.svh, K, cb, k, n)
            for M in TOKENS[:6] if quick else TOKENS:
                for bias in (False, True) if M in (1, 48) else (False,):
                    yield f"linear {k}x{n} K={K} {cb} M={M} bias={bias}", ("linear", M, w, bias)
    for k, widths in SLICES[:1] if quick else SLICES:
        for K, cb in bits[:3]:
            layers = [weight(k, n, K, cb) for n in widths]
            slices = Exl3Slices.of(layers)
            for M in TOKENS[:6] if quick else TOKENS:
                yield f"slices {k} {widths} K={K} {cb} M={M}", ("slices", M, slices, False)


def run_linear(ops, what, M, w, bias):
    if what == "linear":
        b = torch.zeros(w.out_features, dtype=torch.float16) if bias else None
        ops.exl3_linear(torch.zeros(M, w.in_features, dtype=torch.float16), w, b, backend="triton")
    else:
        ops.exl3_linear_slices(torch.zeros(M, w.stack.in_features, dtype=torch.float16), w, backend="triton")


def pretend_gpu():
    """The planner's device facts as an H100 or H200 gives them (132 multiprocessors, sm_90, Gluon available)."""
    from xmoe.kernels import plan
    target = plan.Target("cuda:0", sms=132, gpu=True, gluon_refusal=None, tma=True, shared_memory=232448)
    plan.device_target = lambda device: target


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--target", nargs="+", choices=("cpu", "h100"), default=["cpu", "h100"])
    p.add_argument("--quick", action="store_true", help="a small part of the grid")
    args = p.parse_args()
    from xmoe.kernels import ops
    KernelInterface.__getitem__ = recording(KernelInterface.__getitem__)
    torch.mm = record_mm(torch.mm)
    result = {"triton": triton.__version__}
    for target in args.target:
        if target == "h100":
            pretend_gpu()
        calls = {}
        for name, case in [*moe_calls(args.quick), *linear_calls(args.quick)]:
            log.clear()
            if name.startswith("moe"):
                run_moe(ops, *case)
            else:
                run_linear(ops, *case)
            calls[name] = list(log)
        result[target] = calls
        print(f"{target}: {len(calls)} calls, {sum(len(v) for v in calls.values())} launches", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=0))


if __name__ == "__main__":
    main()
