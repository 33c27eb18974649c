"""The Triton EXL3 kernels against the torch references: on the CPU under TRITON_INTERPRET=1 (small shapes,
in a subprocess since the variable must be set before Triton compiles), and on a GPU over the full grid."""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_experts, random_weight, routing  # noqa: E402

from xmoe.format.trellis import decode_inner, state_windows  # noqa: E402
from xmoe.kernels import ops  # noqa: E402
from xmoe.kernels.reference import exl3_linear_ref, fused_moe_ref  # noqa: E402
from xmoe.kernels.routing import Routing, route  # noqa: E402
from xmoe.kernels.weights import Exl3Slices  # noqa: E402

# Relative to the output's largest magnitude: fp16 rounding of the rotated activations, and of the output.
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 2e-3}


def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= TOL[got.dtype] * scale + 1e-6, f"{what}: max error {err:.3g} vs output scale {scale:.3g}"


def check_linear(M, k, n, K, codebook, bias, device, dtype=torch.float16):
    w = random_weight(k, n, K, codebook, seed=M + k, device=device)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    got = ops.exl3_linear(x, w, b, backend="triton")
    assert got.shape == (M, n) and got.dtype == dtype
    close(got, exl3_linear_ref(x.float(), w, b), f"linear M={M} {k}x{n} K={K} {codebook}")


def check_slices(M, k, widths, K, codebook, device):
    """exl3_linear_slices against each layer's reference, side by side."""
    layers = [random_weight(k, n, K, codebook, seed=n + i, device=device) for i, n in enumerate(widths)]
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(device, torch.float16)
    got = ops.exl3_linear_slices(x, Exl3Slices.of(layers), backend="triton")
    ref = torch.cat([exl3_linear_ref(x.float(), w) for w in layers], dim=1)
    close(got, ref, f"slices M={M} k={k} {widths} K={K} {codebook}")


def check_moe(M, E, hidden, inter, top_k, K, codebook, skew, device, limit=None, ep=False, K_down=None,
              dtype=torch.float16):
    ids, weights = routing(M, E, top_k, skew, seed=M, device=device)
    x = torch.randn(M, hidden, generator=torch.Generator().manual_seed(E)).to(device, dtype)
    emap = None
    n_local = E
    if ep:  # this rank owns the middle half of the experts
        n_local = E // 2
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[E // 4:E // 4 + n_local] = torch.arange(n_local, dtype=torch.int32)
        emap = emap.to(device)
    experts = random_experts(n_local, hidden, inter, K, codebook, K_down, seed=E, device=device)
    got = ops.fused_moe(x, ids, weights, experts, limit=limit, expert_map=emap, backend="triton")
    ref = fused_moe_ref(x.float(), ids, weights, experts, limit=limit, expert_map=emap)
    assert got.dtype == dtype
    close(got, ref, f"moe M={M} E={E} {hidden}/{inter} top{top_k} K={K} {codebook} skew={skew} ep={ep}")


SMALL_LINEAR = [(1, 128, 128, 2, "mcg", False), (7, 200, 300, 3, "mul1", True), (33, 256, 128, 4, "3inst", False),
                (5, 128, 256, 2.5, "mul1", False)]
SMALL_MOE = [dict(M=1, E=8, hidden=128, inter=128, top_k=2, K=2, codebook="mcg", skew=False),
             dict(M=7, E=8, hidden=200, inter=160, top_k=3, K=3, codebook="mul1", skew=True, K_down=2),
             dict(M=6, E=16, hidden=128, inter=256, top_k=8, K=4, codebook="3inst", skew=False, limit=0.7),
             dict(M=33, E=8, hidden=128, inter=128, top_k=1, K=2, codebook="mcg", skew=True, ep=True)]


def run_interpreted(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    run = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          f"from test_ops import *\n{code}"], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]


def test_linear_interpreter():
    pytest.importorskip("triton")
    run_interpreted("\n".join(f"check_linear(*{c}, 'cpu')" for c in SMALL_LINEAR) +
                    "\ncheck_linear(3, 128, 128, 2, 'mcg', True, 'cpu', torch.bfloat16)")


SMALL_SLICES = [(1, 256, (256, 128, 128), 2, "mcg"), (5, 128, (128, 384), 3, "mul1"),
                (3, 200, (384, 128), 2.5, "mul1"), (2, 128, (256, 256), 4, "3inst")]


def test_linear_slices_interpreter():
    """Layers sharing an input as one set of launches, on the grouped path and (DENSE_ROWS 1) the dense one."""
    pytest.importorskip("triton")
    calls = [f"check_slices(*{c}, 'cpu')" for c in SMALL_SLICES]
    run_interpreted("\n".join([*calls, "ops.DENSE_ROWS = 1", *calls[:2]]))


def test_slices_cut_at_the_widths_gcd():
    q, k, v = (random_weight(256, n, 2, "mcg", seed=n) for n in (512, 128, 128))
    slices = Exl3Slices.of([q, k, v])
    assert slices.stack.trellis.shape == (6, 16, 8, 32) and slices.stack.n == 128 and slices.out_features == 768
    assert [slices.bounds(i) for i in range(3)] == [(0, 4), (4, 5), (5, 6)]
    assert torch.equal(slices.stack.trellis[1], q.trellis[:, 8:16]) and torch.equal(slices.stack.suh[5], v.suh)
    assert torch.equal(slices.stack.svh[:4].reshape(-1), q.svh)
    for other, said in ((random_weight(256, 128, 3, "mcg"), "K=3"), (random_weight(128, 128, 2, "mcg"), "128 inputs"),
                        (random_weight(256, 100, 2, "mcg"), "100 outputs")):
        with pytest.raises(ValueError, match=said):
            Exl3Slices.of([q, other], "qkv_proj")


def test_moe_interpreter():
    """The small MoE grid, and bf16 inputs (vLLM's usual dtype) on the decode and the dense prefill paths."""
    pytest.importorskip("triton")
    run_interpreted("\n".join([*(f"check_moe(**{c}, device='cpu')" for c in SMALL_MOE),
                               f"check_moe(**{SMALL_MOE[0]}, device='cpu', dtype=torch.bfloat16)",
                               "ops.DENSE_ROWS = 1",
                               f"check_moe(**{SMALL_MOE[2]}, device='cpu', dtype=torch.bfloat16)"]))


def test_prefill_epilogues_interpreter():
    """The epilogues as prefill takes them: 64 rows a program (EPILOGUE_SMALL lowered), at 300 tokens (the
    smaller cases above take combine_stacked, 2 and 1 tokens a program at top-k 3 and 8, products of 8 rows; here
    also 4 tokens a program at top-k 3, 16 rows, as calls of more than COMBINE_FEW tokens take it)."""
    pytest.importorskip("triton")
    run_interpreted("\n".join(["ops.COMBINE_FEW = 0", f"check_moe(**{SMALL_MOE[1]}, device='cpu')",
                               "ops.EPILOGUE_SMALL = 4", f"check_moe(**{dict(SMALL_MOE[1], M=300)}, device='cpu')",
                               f"check_moe(**{dict(SMALL_MOE[2], M=300)}, device='cpu')"]))


@pytest.mark.parametrize("split, out, mul1", [(1, "*i32", False), (6, "*i32", False), (12, "*i32", False),
                                              (16, "*i32", False), (16, "*fp32", False), (4, "*i32", True)])
def test_act_epilogue_compiles_without_spills(split, out, mul1):
    """act_epilogue as decode calls launch it (ops.ACT_ROWS rows, up to ops.SPLIT_MOST K splits of gate and up;
    grouped_mma's doubled fp16 or grouped_gemv's fp32 out), compiled for sm_90: no register spilled (at 16 rows
    120-176 bytes a thread spilled at 12-16 splits)."""
    pytest.importorskip("triton")
    from cubins import compile_triton, resources
    from xmoe.kernels.triton_exl3 import act_epilogue

    args = dict(pg_ptr="*fp32", pu_ptr="*fp32", sums_g_ptr="*fp32", sums_u_ptr="*fp32", expert_ptr="*i32",
                svh_g_ptr="*fp16", svh_u_ptr="*fp16", suh_d_ptr="*fp16", had_ptr="*fp16", out_ptr=out,
                sums_ptr="*fp32", P="i32", n="i32", n_real="i32", E="i32", limit="fp32", KB="i32")
    const = dict(HAS_LIMIT=mul1, MUL1_H=mul1, SUMS=mul1, SPLIT=split, BM=ops.ACT_ROWS)
    kernel = compile_triton(act_epilogue, args, const, 90, num_warps=ops.EPILOGUE[0][1])
    usage = resources(kernel.asm["cubin"])
    assert usage["STACK"] == usage["LOCAL"] == 0, usage


@pytest.mark.parametrize("arch, smem", [(90, 232448), (100, 232448), (120, 101376), (89, 101376), (86, 101376),
                                         (80, 166912)])
def test_dense_gemm_fits_shared_memory(arch, smem, monkeypatch):
    """The dense path's GEMM (dense_gemm_tma from sm_90, dense_gemm before) at the tile and pipeline stages
    ops._dense_tile gives a GPU with `smem` bytes of shared memory a program (H100, H200 and B200: 227 KB; A100:
    163 KB; RTX 3090/4090/5090 and their workstation parts: 99 KB), compiled for its arch: it fits."""
    pytest.importorskip("triton")
    from cubins import compile_triton
    from xmoe.kernels.triton_exl3 import dense_gemm, dense_gemm_tma

    monkeypatch.setattr(ops, "_shared_memory", lambda index: smem)
    BM, BN, BK, warps, stages = ops._dense_tile(torch.device("cuda", 0))
    tma = arch >= 90
    operands = ({"a_desc": f"tensordesc<fp16[{BM}, {BK}]>", "w_desc": f"tensordesc<fp16[{BK}, {BN}]>"} if tma else
                {"a_ptr": "*fp16", "w_ptr": "*fp16"})
    args = {**operands, "chunk_pos_ptr": "*i32", "chunk_len_ptr": "*i32", "chunk_slot_ptr": "*i32", "p_ptr": "*fp32",
            "P": "i32", "k": "i32", "n": "i32"}
    kernel = compile_triton(dense_gemm_tma if tma else dense_gemm, args, dict(SPLIT=1, BM=BM, BN=BN, BK=BK), arch,
                            num_warps=warps, num_stages=stages)
    assert kernel.metadata.shared <= smem, (stages, kernel.metadata.shared)


def test_gather_decoder_interpreter():
    """The per-weight gather decoder (every K; the default takes it only where K is not 1, 2, 4 or 8)."""
    pytest.importorskip("triton")
    linear = [(3, 256, 256, K, cb, False) for K, cb in ((1, "mcg"), (2, "mcg"), (4, "3inst"), (8, "mul1"))]
    run_interpreted("ops.DECODER = 'gather'\n" + "\n".join(f"check_linear(*{c}, 'cpu')" for c in linear) + "\n" +
                    "\n".join(f"check_moe(**{c}, device='cpu')" for c in SMALL_MOE[:3]))


def test_tiled_decoder_every_power_of_two_interpreter():
    """The tiled decoder (the default for K = 1, 2, 4, 8): each tile's words loaded once and spread."""
    pytest.importorskip("triton")
    linear = [(3, 256, 256, K, cb, False) for K, cb in ((1, "mcg"), (8, "mul1"), (4, "mcg"), (2, "3inst"))]
    run_interpreted("assert ops.DECODER == 'tiled'\n" + "\n".join(f"check_linear(*{c}, 'cpu')" for c in linear))


def test_tiled_swapped_operands_interpreter():
    """Tiled launches computing W^T a^T (ops.SWAP_AB, by default at decode sizes) in both regimes."""
    pytest.importorskip("triton")
    calls = [f"check_linear(*{c}, 'cpu')" for c in SMALL_LINEAR[:2]] + \
            [f"check_moe(**{c}, device='cpu')" for c in (SMALL_MOE[0], SMALL_MOE[2])]
    run_interpreted("\n".join(["ops.SWAP_AB = {'decode', 'prefill'}", *calls]))


def mul1_h(w, e: int) -> torch.Tensor:
    """(k, n) fp32: mul1's h = 1024 + the byte sum of state x 0x83DCD12D for each weight of expert e (or of a
    single layer), the value the GEMM kernels multiply before the epilogue applies the codebook's FMA."""
    from xmoe.format.trellis import tiles_to_matrix, unpack_states
    t = (w.trellis[e] if w.experts else w.trellis).cpu()
    states = tiles_to_matrix(unpack_states(t.reshape(-1, t.shape[-1]), w.K), w.k, w.n).long()
    x = (states * 0x83DCD12D) & 0xFFFFFFFF
    return (1024 + sum((x >> 8 * i) & 0xFF for i in range(4))).float()


def emulate_mma() -> list:
    """Give ops' grouped_mma launches (Gluon, GPUs only) to a torch model of the kernel's contract, so that what
    feeds and finishes them (doubled int32 activations, their block sums, the epilogues) runs under the
    interpreter: each chunk's rows (the low fp16 half of each int32) times its expert's weights, all in K split
    0, the other splits zero; at mul1 the weights are h (mul1_h), as the kernel leaves the codebook's FMA to the
    epilogue (triton_exl3.mul1_affine); the dense path's experts decoded by triton_exl3. Returns the list of
    emulated launches' codebooks."""
    gemm, calls = ops._gemm, []

    def inner(w, e):
        if w.codebook == "mul1":
            return mul1_h(w, e)
        return decode_inner(w.trellis[e] if w.experts else w.trellis, w.K, w.codebook).float()

    def mma_gemm(a0, a1, chunks, w, p0, p1, second, launch):
        if not launch.mma:
            return gemm(a0, a1, chunks, w, p0, p1, second, launch)
        calls.append(w.codebook)
        pos, length, expert, count, _ = chunks
        for a, layer, p in ((a0, w, p0), (a1, second, p1)):
            if layer is None:
                continue
            x = (a & 0xFFFF).to(torch.int16).view(torch.float16).float()
            p.zero_()
            for c in range(int(count)):
                rows = slice(int(pos[c]), int(pos[c]) + int(length[c]))
                p[0, rows] = x[rows] @ inner(layer, int(expert[c]))

    refusal, decode = ops.mma_refusal, ops.decode_experts

    def allowed(w, device):
        return None

    def triton_decode(*args):  # the dense path's Gluon decoder cannot run here either: triton_exl3's does
        ops.mma_refusal = refusal
        try:
            return decode(*args)
        finally:
            ops.mma_refusal = allowed

    ops.mma_refusal, ops._gemm, ops.decode_experts = allowed, mma_gemm, triton_decode
    return calls


def test_mma_epilogues_interpreter():
    """Dense layers and MoE calls as they take grouped_mma (emulate_mma): at mul1 the rotations write the rows'
    block sums and the epilogues apply the codebook's FMA to the products (K = 2, 3, 2.5); at MCG they do not."""
    pytest.importorskip("triton")
    moe = [dict(M=7, E=8, hidden=200, inter=160, top_k=3, K=2.5, codebook="mul1", skew=True),
           dict(M=1, E=8, hidden=128, inter=128, top_k=2, K=3, codebook="mul1", skew=False, K_down=2),
           dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2, codebook="mul1", skew=False, limit=0.7),
           dict(M=6, E=16, hidden=128, inter=128, top_k=2, K=2, codebook="mul1", skew=True, ep=True),
           dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2, codebook="mcg", skew=True)]
    linear = [(5, 256, 384, 2, "mul1", True), (1, 200, 256, 3, "mul1", False), (8, 256, 128, 2, "mcg", False)]
    run_interpreted("\n".join(["calls = emulate_mma()", *(f"check_linear(*{c}, 'cpu')" for c in linear),
                               *(f"check_moe(**{c}, device='cpu')" for c in moe),
                               "assert calls.count('mul1') == 10 and calls.count('mcg') == 3, calls"]))


def test_rows_regime_interpreter():
    """Prefill-sized calls on grouped_mma ("rows": chunks of 32 rows, gate and up in two launches; emulate_mma),
    and those of them with experts for the dense path, which take the tl.dot launches over the same chunks."""
    pytest.importorskip("triton")
    moe = [dict(SMALL_MOE[1], M=40), dict(SMALL_MOE[2], M=9), dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2,
                                                                    codebook="mul1", skew=False)]
    run_interpreted("\n".join([
        "calls, launches, emulated = emulate_mma(), [], ops._gemm",
        "ops._gemm = lambda *a: launches.append(a[-1]) or emulated(*a)",
        "ops.MMA_ROWS = ops.ROWS_MMA_TILED = ops.MID_ROWS = 0",
        "ops.ROWS_MMA = float('inf')",
        *(f"check_linear(*{c}, 'cpu')" for c in SMALL_LINEAR), *(f"check_moe(**{c}, device='cpu')" for c in moe),
        "assert launches and all(l.mma and l.BM == 32 for l in launches), launches",
        "ops.DENSE_ROWS, ops.DENSE_REST = 12, 0", "hot, find = [], ops._hot_experts",
        "ops._hot_experts = lambda *a: hot.append(find(*a)) or hot[-1]", "launches.clear()",
        f"check_moe(**{dict(SMALL_MOE[2], M=24)}, device='cpu')",  # some experts dense, the rest on tl.dot
        "assert hot[-1] is not None and not hot[-1].every and not any(l.mma for l in launches), (hot, launches)",
        "assert all(l.BM == 32 for l in launches), launches", "launches.clear()",
        f"check_moe(**{dict(SMALL_MOE[2], M=24, top_k=1)}, device='cpu')",  # none dense: still grouped_mma
        "assert hot[-1] is None and launches and all(l.mma for l in launches), (hot, launches)"]))


def test_mid_regime_interpreter():
    """Dense and merged layers of 9-16 rows on grouped_mma in chunks of 16 ("mid"; emulate_mma), at the defaults."""
    pytest.importorskip("triton")
    run_interpreted("\n".join([
        "calls, launches, emulated = emulate_mma(), [], ops._gemm",
        "ops._gemm = lambda *a: launches.append(a[-1]) or emulated(*a)",
        *(f"check_linear({M}, 256, 128, {K}, '{cb}', False, 'cpu')" for M in (9, 16) for K, cb in ((2, "mcg"),
                                                                                                 (3, "mul1"))),
        *(f"check_slices({M}, 256, (256, 128), 2, 'mul1', 'cpu')" for M in (12, 16)),
        "assert len(launches) == 6 and all(l.mma and l.BM == 16 for l in launches), launches"]))


def test_gemv_interpreter():
    """grouped_gemv (chunks of up to 2 rows, CUDA cores) on every case it can take, every power-of-two K, then
    with chunks of 2 and of 1 row at a second block shape (BK 32, BN 32, 2 warps)."""
    pytest.importorskip("triton")
    linear = [(1, 128, 128, 2, "mcg", False), (3, 256, 256, 1, "mcg", True), (2, 256, 128, 4, "3inst", False),
              (1, 200, 300, 8, "mul1", True)]
    calls = [f"check_linear(*{c}, 'cpu')" for c in linear] + [f"check_moe(**{c}, device='cpu')" for c in SMALL_MOE]
    run_interpreted("\n".join(["ops.GEMV_ROWS = float('inf')", *calls, "ops.TUNED['gemv', True] = (2, 32, 32, 2, 1)",
                                *calls[-2:], "ops.TUNED['gemv', True] = (1, 32, 32, 2, 1)", *calls[-2:]]))


def check_decode(k, n, K, codebook, device):
    """decode_experts is bit-exact with the format's decode, for the experts asked for, in that order; at mul1
    with mul1_h, h exactly."""
    w = random_weight(k, n, K, codebook, experts=3, seed=k + n, device=device)
    ids = torch.tensor([2, 0], dtype=torch.int32, device=device)
    got = ops.decode_experts(w, ids)
    for i, e in enumerate((2, 0)):
        assert torch.equal(got[i].cpu(), decode_inner(w.trellis[e].cpu(), K, codebook)), f"K={K} {codebook}"
    if codebook == "mul1":
        got = ops.decode_experts(w, ids, mul1_h=True)
        for i, e in enumerate((2, 0)):
            assert torch.equal(got[i].cpu().float(), mul1_h(w, e)), f"K={K} mul1 h"


def test_dense_path_interpreter():
    """Experts with at least ops.DENSE_ROWS rows (here 3; 1 for the second MoE: every expert) decoded once and
    multiplied densely, beside the grouped kernels for the rest; a dense linear layer; every K and decoder; a
    call whose few experts all go dense as the rest (DENSE_REST); experts of more rows than one dense_gemm chunk
    (BM 16 here); a call of more than routing.ROUTE_SLOTS slots (sorted routing); dense_gemm_tma and, for GPUs
    without the copy engine, dense_gemm."""
    pytest.importorskip("triton")
    decode = [f"check_decode(256, 128, {K}, {cb!r}, 'cpu')" for K, cb in ((1, "mcg"), (2, "3inst"), (3, "mul1"),
                                                                         (4, "mcg"), (8, "mul1"))]
    moe = [dict(SMALL_MOE[1], M=9), dict(SMALL_MOE[2], M=9), SMALL_MOE[3]]
    run_interpreted("\n".join([
        "ops.DENSE_ROWS, ops.DENSE_REST = 3, 0", *decode, *(f"check_moe(**{c}, device='cpu')" for c in moe),
        *(f"check_linear(*{c}, 'cpu')" for c in SMALL_LINEAR), "ops.DENSE_ROWS = 1",
        f"check_moe(**{SMALL_MOE[0]}, device='cpu')", "ops.DENSE_ROWS, ops.DENSE_REST = 3, 8",
        f"check_moe(**{SMALL_MOE[1]}, device='cpu')", "ops.DENSE_ROWS, ops.DENSE_TILE = 1, (16, 256, 64, 4, 1)",
        f"check_moe(**{dict(SMALL_MOE[0], M=40, E=4, inter=384)}, device='cpu')",
        "ops.DENSE_ROWS, ops.DENSE_REST = 12, 0", "hot, find = [], ops._hot_experts",
        "ops._hot_experts = lambda *a: hot.append(find(*a)) or hot[-1]",
        f"check_moe(**{dict(SMALL_MOE[2], M=24)}, device='cpu')",
        "assert hot and all(h is not None and not h.every for h in hot), hot",
        "ops.DENSE_TMA = False", f"check_moe(**{dict(SMALL_MOE[2], M=24)}, device='cpu')"]))


def check_hot_tables(rows: int, rest: int, group: int) -> None:
    """The dense experts' tables: which experts go dense, and chunks of at most BM rows (pos, length, index in
    the group) covering each one's sorted rows in order, once; a route_small routing (no runs) too."""
    ops.DENSE_REST, ops.DENSE_GROUP = rest, group
    BM, E = 16, 64
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        counts = (torch.rand(E, generator=g) ** 6 * 400).long() * (torch.rand(E, generator=g) < trial / 40)
        ends = counts.cumsum(0)
        r = Routing(*[None] * 5, runs=torch.stack([ends - counts, ends]).int())
        hot = ops._hot_experts(ops._find_hot(r, int(ends[-1]), E, BM, rows, torch.device("cpu")))
        nonzero = [e for e in range(E) if counts[e]]
        dense = [e for e in nonzero if counts[e] >= rows]
        if len(nonzero) - len(dense) <= rest:
            dense = nonzero
        if not dense:
            assert hot is None
            continue
        assert hot.flags.tolist() == [int(e in dense) for e in range(E + 1)] and hot.every == (dense == nonzero)
        assert [len(ids) for ids, *_ in hot.groups] == [min(group, len(dense) - i) for i in range(0, len(dense), group)]
        for i, (ids, pos, length, slot) in enumerate(hot.groups):
            assert ids.tolist() == dense[i * group:(i + 1) * group]
            assert ((length >= 1) & (length <= BM)).all()
            for j, e in enumerate(ids.tolist()):
                mine = slot == j
                covered = [r for p, n in zip(pos[mine].tolist(), length[mine].tolist()) for r in range(p, p + n)]
                assert covered == list(range(ends[e] - counts[e], ends[e])), (trial, e)
    ids = torch.tensor([[3, 1], [3, 3], [0, 3]])  # route_small's routing, whose runs _find_hot counts itself
    hot = ops._hot_experts(ops._find_hot(route(ids, 4, BM, backend="triton"), 6, 4, BM, 2, torch.device("cpu")))
    dense = [0, 1, 3] if rest >= 2 else [3]  # experts 0 and 1 have a row each, 3 has four
    assert hot.flags.tolist() == [int(e in dense) for e in range(5)]
    assert torch.cat([g[0] for g in hot.groups]).tolist() == dense


def test_hot_expert_tables():
    pytest.importorskip("triton")
    run_interpreted("\n".join(f"check_hot_tables{c}" for c in ((128, 8, 32), (12, 0, 2), (1, 8, 3))))


def test_gemv_plan():
    assert ops.plan(36, 1152, 5120, 1.0, 132).gemv and ops.plan(36, 1152, 5120, 1.0, 132).BM == 2
    assert not ops.plan(6, 1152, 5120, 6.0, 132).gemv
    assert not ops.plan(36, 1152, 5120, 1.0, 132, K=3).gemv  # the gather decoder has no CUDA-core path


@pytest.mark.parametrize("chunks", [1, 6, 18, 35, 68, 202])
@pytest.mark.parametrize("n, k", [(1152, 5120), (5120, 1152), (5120, 2304), (2304, 5120)])
def test_plan_leaves_no_split_empty(chunks, n, k):
    """Each K split gets ceil(steps / split) steps in the kernels; the plan never has a split past the last step,
    which would load a step beyond the weight's words before its empty loop."""
    for (rows, mma), single in itertools.product(((1.0, True), (6.0, True), (24.0, True), (1.0, False), (64.0, False)),
                                                 (False, True)):
        launch = ops.plan(chunks, n, k, rows, 132, mma=mma, single=single)
        steps = k // launch.BK
        assert (launch.split - 1) * -(-steps // launch.split) < steps, (launch, steps)


def test_mma_plan(monkeypatch):
    launch = ops.plan(36, 1152, 5120, 1.0, 132, mma=True)
    assert launch.mma and not launch.gemv and launch.BM == 8
    rows = ops.plan(36, 1152, 5120, 24.0, 132, mma=True)  # more rows per expert than 8: chunks of 32 ("rows")
    assert rows.mma and rows.BM == 32 and rows.BN == 128  # 256 does not divide 1,152 columns
    assert not ops.plan(36, 1152, 5120, 12.0, 132, mma=True).mma  # the tiled decoder's tl.dot launch up to 16
    assert ops.plan(36, 1152, 5120, 12.0, 132, K=3, mma=True).BM == 32  # none at K = 3
    assert not ops.plan(36, 1152, 5120, 200.0, 132, mma=True).mma
    mid = ops.plan(1, 1152, 5120, 12.0, 132, mma=True, mid=True)  # a dense layer of 9-16 rows: chunks of 16
    assert mid.mma and mid.BM == 16 and ops.plan(1, 1152, 5120, 12.0, 132, K=3, mma=True, mid=True).BM == 16
    assert ops.plan(1, 1152, 5120, 17.0, 132, K=3, mma=True, mid=True).BM == 32
    assert ops.plan(1, 2304, 5120, 64.0, 132, K=3, mma=True, rows_mma=127).BM == 32  # a K = 3 dense layer's reach
    assert ops.plan(36, 1152, 5120, 1.0, 132, K=3, mma=True).mma  # K = 3: no tiled decoder, but grouped_mma's
    monkeypatch.setitem(ops.TUNED, ("mma", True), (8, 32, 256, 4, 1))
    assert ops.plan(36, 1152, 5120, 1.0, 132, mma=True).BN == 128  # 256 does not divide 1,152 columns
    w = random_weight(256, 256, 8, "mul1")
    assert "K = 8" in ops.mma_refusal(w, torch.device("cuda")) and "CUDA" in ops.mma_refusal(w, torch.device("cpu"))


def test_mma_pair_plan(monkeypatch):
    """A decode-size launch of one projection takes two column blocks a program (MMA_PAIR): half the programs, so
    more K splits; gate and up (two projections already), other regimes and odd counts of blocks do not."""
    down = ops.plan(35, 5120, 1152, 1.0, 132, mma=True, single=True)
    unpaired = ops.plan(35, 5120, 1152, 1.0, 132, mma=True)
    assert down.pair and not unpaired.pair and down.split > unpaired.split
    assert not ops.plan(36, 1152, 5120, 1.0, 132, mma=True, single=True).pair  # 9 blocks of 128 columns
    assert not ops.plan(36, 5120, 1152, 24.0, 132, mma=True, single=True).pair  # "rows"
    assert not ops.plan(1, 5120, 1152, 12.0, 132, mma=True, mid=True, single=True).pair  # "mid"
    assert not ops.plan(35, 5120, 1152, 1.0, 132, single=True).pair  # no grouped_mma
    dense = ops.plan(1, 2304, 5120, 1.0, 132, mma=True, mid=True, single=True)  # one chunk: the split at its cap
    assert not dense.pair and dense.split == ops.SPLIT_MOST
    monkeypatch.setattr(ops, "MMA_PAIR", False)
    assert not ops.plan(35, 5120, 1152, 1.0, 132, mma=True, single=True).pair


def test_moe_split_cap():
    """A MoE call's decode launches split K at most SPLIT_MOST_MOE times, dense layers at most SPLIT_MOST, and into
    no fewer than MMA_MIN_STEPS K steps a program: at V4.1 shapes gate/up of two tokens (12 experts, 9 column blocks)
    reach the MoE cap, a one-row dense layer its own, one token's down (36 steps) the steps' bound."""
    gate_up = ops.plan(12, 1152, 5120, 1.0, 132, mma=True)
    assert gate_up.mma and gate_up.split == ops.SPLIT_MOST_MOE < ops.SPLIT_MOST
    assert ops.plan(1, 1152, 5120, 1.0, 132, mma=True, mid=True, single=True).split == ops.SPLIT_MOST
    assert ops.plan(34, 1152, 5120, 1.0, 132, mma=True).split < ops.SPLIT_MOST_MOE  # 6 tokens: FILL decides
    down = ops.plan(6, 5120, 1152, 1.0, 132, mma=True, single=True)  # one token's: 36 K steps
    assert down.split == 1152 // down.BK // ops.MMA_MIN_STEPS < ops.SPLIT_MOST_MOE


def test_mma_pair_launch(monkeypatch):
    """How _gemm launches grouped_mma for one projection, paired (half the column blocks, gate and up's registers
    and unroll) and not."""
    from xmoe.kernels import gluon_mma
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    monkeypatch.setattr(gluon_mma, "grouped_mma", Recorder())
    w = random_weight(256, 512, 2, "mcg", experts=4)
    chunks = tuple(torch.zeros(3, dtype=torch.int32) for _ in range(4)) + (3,)
    a, p = torch.zeros(24, 256, dtype=torch.int32), torch.zeros(2, 24, 512)
    for pair in (True, False):
        ops._gemm(a, a, chunks, w, p, None, None, ops.Launch(8, 128, 2, mma=True, pair=pair))
    (paired, kw), (alone, kw_alone) = launches
    assert paired == (3, 2, 2) and kw["PAIR"] and not kw["DUAL"] and alone == (3, 4, 2) and not kw_alone["PAIR"]
    assert (kw["UNROLL"], kw["maxnreg"]) == (ops.MMA_UNROLL[0], ops.MMA_MAXNREG[0])  # gate and up's
    assert (kw_alone["UNROLL"], kw_alone["maxnreg"]) == (ops.MMA_UNROLL[1], ops.MMA_MAXNREG[1])


def test_gather_tables_made_eagerly():
    """The gather decoder's state windows are made by every eager call, whichever path it takes, so that a CUDA
    graph capture that gathers finds them (a host table cannot be copied inside a capture)."""
    ops._windows.cache_clear()
    w = random_weight(256, 256, 3, "mcg")
    ops._eager_tables((w, random_weight(256, 256, 2, "mcg")), torch.device("cpu"))
    assert ops._windows.cache_info().currsize == 2 and torch.equal(ops._windows(3, "cpu"), state_windows(3))


def test_dense_rows():
    """Experts go dense from fewer rows where the grouped kernels would gather (K = 3, 2.5) but gluon_mma decodes."""
    gpu = torch.device("cuda")  # mma_refusal's answer for a CUDA device; nothing runs there
    half, k2, k5 = (random_weight(256, 256, K, cb) for K, cb in ((2.5, "mul1"), (2, "mcg"), (5, "mcg")))
    untiled = ops.DENSE_ROWS_UNTILED if ops._gluon_refusal() is None else ops.DENSE_ROWS
    assert ops._dense_rows((k2, half), gpu) == untiled and ops._dense_rows((k2, k2), gpu) == ops.DENSE_ROWS
    assert ops._dense_rows((k5,), gpu) == ops.DENSE_ROWS and ops._dense_rows((half,), torch.device("cpu")) == \
        ops.DENSE_ROWS
    assert ops._dense_rows((k2, half), gpu, rows=True) == ops.DENSE_ROWS  # grouped_mma takes the rest


def test_route_groups_slots_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]])
    r = ops.route(ids, experts=4, BM=2)
    pos, length, expert, count, bound = r.chunks
    n = int(count)
    chunks = [(int(p), int(c), int(e)) for p, c, e in zip(pos[:n], length[:n], expert[:n])]
    # expert 0: slot (1,1); expert 1: slots (0,1),(1,0),(2,1) cut at BM=2; expert 2: (3,0); expert 3: (0,0),(2,0),(3,1)
    assert chunks == [(0, 1, 0), (1, 2, 1), (3, 1, 1), (4, 1, 2), (5, 2, 3), (7, 1, 3)]
    assert bound >= n
    flat = ids.reshape(-1)
    assert torch.equal(r.sorted_expert[r.slot_pos.long()].long(), flat)
    assert torch.equal(r.rows[r.slot_pos.long()].long(), torch.arange(8) // 2)


def test_route_expert_map_drops_other_ranks():
    ids = torch.tensor([[0, 5], [4, 1]])
    emap = torch.tensor([-1, -1, -1, -1, 0, 1, -1, -1])
    r = ops.route(ids, experts=2, BM=16, expert_map=emap)
    assert r.slot_expert.tolist() == [-1, 1, 0, -1]
    assert int(r.chunks[3]) == 2


def test_backend_choice_is_explicit():
    x = torch.randn(2, 128)
    w = random_weight(128, 128, 2, "mcg")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="CPU"):
            ops.exl3_linear(x, w, backend="triton")
    assert ops.pick_backend("auto", torch.device("cpu")) in ("torch", "triton")
    with pytest.raises(ValueError, match="backend"):
        ops.exl3_linear(x, w, backend="cuda")
    close(ops.exl3_linear(x, w, backend="torch"), exl3_linear_ref(x, w), "torch backend")


def test_shape_errors_name_the_problem():
    w = random_weight(128, 256, 2, "mcg")
    with pytest.raises(ValueError, match="takes 128"):
        ops.exl3_linear(torch.randn(2, 64), w, backend="torch")
    experts = random_experts(4, 128, 128, 2, "mcg")
    with pytest.raises(ValueError, match="top_k"):
        ops.fused_moe(torch.randn(3, 128), torch.zeros(3, 2, dtype=torch.long), torch.ones(2, 2), experts)


GPU_LINEAR = [(M, k, n, K, cb, bias) for M in (1, 6, 7, 33, 222, 1542) for (k, n) in ((576, 1536), (5120, 1152))
              for K, cb in ((2, "mcg"), (3, "mul1"), (4, "3inst")) for bias in (False,)] + \
             [(8, 2048, 640, 2.5, "mul1", True), (1, 4096, 4096, 8, "mcg", False), (64, 1000, 300, 1, "mcg", True)] + \
             [(M, 5120, 1152, 3, cb, False) for M in (1, 7, 33) for cb in ("mcg", "3inst")] + \
             [(M, 5120, 1152, K, "mul1", False) for M in (1, 7) for K in (2, 4)] + \
             [(M, 5120, 1152, K, cb, False) for M in (12, 16) for K, cb in ((2, "mcg"), (3, "mul1"), (4, "3inst"))]
GPU_MOE = [dict(M=M, E=E, hidden=h, inter=i, top_k=k, K=K, codebook=cb, skew=s)
           for M in (1, 6, 7, 33, 222, 1542) for (E, h, i, k) in ((8, 576, 1536, 2), (384, 1024, 384, 6))
           for K, cb in ((2, "mcg"), (3, "mul1"), (4, "3inst")) for s in (False, True)] + \
          [dict(M=6, E=64, hidden=640, inter=256, top_k=8, K=2, codebook="mcg", skew=False, limit=10.0),
           dict(M=48, E=128, hidden=5120, inter=1152, top_k=6, K=2, codebook="mcg", skew=True, ep=True),
           dict(M=12, E=32, hidden=300, inter=200, top_k=4, K=2, codebook="mul1", skew=False, K_down=3)] + \
          [dict(M=M, E=E, hidden=h, inter=i, top_k=k, K=3, codebook=cb, skew=s) for M in (1, 6, 33)
           for (E, h, i, k, cb, s) in ((8, 576, 1536, 2, "3inst", False), (384, 1024, 384, 6, "mcg", True))] + \
          [dict(M=6, E=32, hidden=512, inter=256, top_k=4, K=2, codebook="mcg", skew=False, K_down=3)] + \
          [dict(M=M, E=64, hidden=1024, inter=384, top_k=6, K=K, codebook="mul1", skew=M == 6) for M in (1, 6, 33)
           for K in (2, 4, 1.5, 2.5, 3.5)] + \
          [dict(M=M, E=384, hidden=1024, inter=384, top_k=1, K=2, codebook="mcg", skew=s) for M in (1, 7, 222, 1542)
           for s in (False, True)]  # top-1 routing: one slot a token


@pytest.fixture(params=["gather", "tiled", "tiled-swap", "tiled-gemv", "tiled-mma", "tiled-rows"])
def decoder(request, monkeypatch):
    """The default launches, and each path on every case: gather, tiled on tensor cores (plain or swapped
    operands), tiled on CUDA cores (grouped_gemv, chunks of up to 2 rows), tiled on mma.sync (grouped_mma,
    chunks of up to 8 rows, or of 32: "rows", where it can run). The default also takes dense layers of 9-16 rows
    on grouped_mma in chunks of 16 ("mid")."""
    monkeypatch.setattr(ops, "DECODER", request.param.split("-")[0])
    if request.param != "tiled":
        monkeypatch.setattr(ops, "MID_ROWS", 0)
        monkeypatch.setattr(ops, "SWAP_AB", {"decode", "prefill"} if request.param.endswith("swap") else set())
        monkeypatch.setattr(ops, "GEMV_ROWS", float("inf") if request.param.endswith("gemv") else 0)
        monkeypatch.setattr(ops, "MMA_ROWS", float("inf") if request.param.endswith("mma") else 0)
        monkeypatch.setattr(ops, "ROWS_MMA", float("inf") if request.param.endswith("rows") else 0)
        monkeypatch.setattr(ops, "ROWS_MMA_TILED", 0)
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_LINEAR, ids=str)
def test_linear_gpu(case, decoder):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_linear(*case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MOE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_moe_gpu(case, decoder):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_moe(**case, device="cuda")


GPU_SLICES = [(M, 5120, widths, K, cb) for M in (1, 6, 16, 33, 200) for widths, K, cb in
              (((5120, 1024, 1024), 2, "mcg"), ((2304, 2304), 3, "mcg"), ((4096, 512, 512), 2, "mul1"),
               ((1024, 512), 4, "3inst"))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SLICES, ids=str)
def test_linear_slices_gpu(case, decoder):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    check_slices(*case, "cuda")


@pytest.mark.gpu
def test_mma_padding_never_reaches_the_output(monkeypatch):
    """grouped_mma's MMA takes 8 rows a chunk, a short chunk's spare rows reading its last row again, never the
    next expert's rows or other ranks' rows: with every activation buffer NaN before it is written (ops._act_buffer),
    every output still matches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setattr(ops, "MMA_ROWS", float("inf"))
    made = ops._act_buffer

    def poisoned(P, cols, launch, device):
        rows = made(P, cols, launch, device)
        rows.fill_(0x7E007E00 if rows.dtype == torch.int32 else float("nan"))  # int32: fp16 NaN, doubled
        return rows

    monkeypatch.setattr(ops, "_act_buffer", poisoned)
    for case in GPU_MOE:
        if case["M"] <= 48:
            check_moe(**case, device="cuda")
    for M in (1, 6, 7):
        check_linear(M, 5120, 1152, 2, "mcg", False, "cuda")


@pytest.mark.gpu
def test_moe_cuda_graph_replay_equals_eager():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    experts = random_experts(64, 1024, 512, 2, "mcg", device="cuda")
    for M in (6, 48):  # one-launch routing (36 slots), sorted routing (288)
        ids, weights = routing(M, 64, 6, False, device="cuda")
        x = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
        ops.fused_moe(x, ids, weights, experts, backend="triton")  # compiles before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.fused_moe(x, ids, weights, experts, backend="triton")
        for seed in range(3):  # new routing and inputs each replay, written into the captured buffers
            new_ids, new_w = routing(M, 64, 6, True, seed=seed + 1, device="cuda")
            ids.copy_(new_ids), weights.copy_(new_w), x.normal_()
            graph.replay()
            assert torch.equal(out, ops.fused_moe(x, ids, weights, experts, backend="triton")), M


@pytest.mark.gpu
def test_dense_path_gpu(monkeypatch):
    """decode_experts bit-exact at every K and codebook; every expert taken densely (DENSE_ROWS 1) on MoE cases."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for K, cb in ((1, "mcg"), (2, "mcg"), (2, "3inst"), (3, "mcg"), (3, "3inst"), (3, "mul1"), (4, "mcg"), (8, "mul1"),
                  (1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")):
        check_decode(1024, 384, K, cb, "cuda")
    monkeypatch.setattr(ops, "DENSE_ROWS", 1)
    for case in GPU_MOE[::7] + GPU_LINEAR[::5]:
        if isinstance(case, dict):
            check_moe(**case, device="cuda")
        else:
            check_linear(*case, "cuda")


def test_row_chunks_kept_per_shape():
    """A dense layer's chunk tables are built once per shape: M rows in chunks of BM, all on expert 0."""
    (pos, length, expert, count, bound), rows, zeros = ops._row_chunks(5, 2, torch.device("cpu"))
    assert pos.tolist() == [0, 2, 4] and length.tolist() == [2, 2, 1] and expert.tolist() == [0, 0, 0]
    assert count.tolist() == [3] and bound == 3 and rows.tolist() == list(range(5)) and zeros.tolist() == [0] * 5
    assert ops._row_chunks(5, 2, torch.device("cpu"))[0][0] is pos


@pytest.mark.gpu
def test_linear_cuda_graph_replay_equals_eager():
    """exl3_linear (and exl3_linear_slices) replayed from CUDA graphs equals eager calls: for a shape first seen
    inside the capture (its chunk tables are then made by the graph) and for one whose tables were kept from an
    eager call."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    w = random_weight(1024, 512, 2, "mcg", device="cuda")
    ops.exl3_linear(torch.randn(4, 1024, device="cuda", dtype=torch.float16), w, backend="triton")  # compiles
    k3 = random_weight(1024, 512, 3, "mul1", device="cuda")  # at 48 rows: grouped_mma's "rows" regime
    slices = Exl3Slices.of([w, random_weight(1024, 256, 2, "mcg", seed=1, device="cuda")])
    for M, eager_first, layer in ((3, False, w), (5, True, w), (48, True, k3), (3, False, slices), (6, True, slices)):
        call = ops.exl3_linear_slices if isinstance(layer, Exl3Slices) else ops.exl3_linear
        x = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
        if eager_first:
            call(x, layer, backend="triton")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = call(x, layer, backend="triton")
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            x.normal_()
            graph.replay()
            assert torch.equal(out, call(x, layer, backend="triton")), M


def test_triton_routes_equal_route_interpreter():
    """The Triton routings (one launch for decode sizes, a counting sort in two launches beyond, here over up to
    four blocks of slots) give route()'s sorted slots and chunks exactly, and the experts' runs."""
    pytest.importorskip("triton")
    run_interpreted("""
for M, E, top_k, BM, skew, ep in ((1, 8, 2, 1, False, False), (6, 384, 6, 1, True, False), (12, 32, 6, 4, True, False),
                                  (7, 16, 8, 16, True, True),
                                  (21, 64, 6, 2, False, True), (16, 8, 8, 16, True, False),
                                  (40, 384, 6, 16, True, False), (300, 64, 4, 64, False, True),
                                  (222, 384, 6, 64, True, True), (1100, 8, 1, 128, True, False),
                                  (400, 384, 8, 16, True, False), (500, 64, 8, 128, False, True)):
    ids, _ = routing(M, E, top_k, skew, seed=M, device='cpu')
    emap = None
    if ep:
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[E // 4:E // 4 + E // 2] = torch.arange(E // 2, dtype=torch.int32)
    n = E // 2 if ep else E
    a, b = ops.route(ids, n, BM, emap), ops.route(ids, n, BM, emap, backend='triton')
    for f in ('rows', 'sorted_expert', 'slot_pos', 'slot_expert'):
        assert torch.equal(getattr(a, f).int(), getattr(b, f).int()), (M, E, f)
    count = int(a.chunks[3])
    assert int(b.chunks[3]) == count and a.chunks[4] == b.chunks[4], (M, E)
    for x, y in zip(a.chunks[:3], b.chunks[:3]):
        assert torch.equal(x[:count].int(), y[:count].int()), (M, E)
    if b.runs is not None:
        counts = torch.bincount(a.sorted_expert.long(), minlength=n + 1)[:n]
        ends = counts.cumsum(0)
        assert torch.equal(b.runs.long(), torch.stack([ends - counts, ends])), (M, E)
""")


def test_route_rotate_equals_route_then_rotate_interpreter():
    """Decode-size calls route and rotate in one launch (route_rotate), each rotating program finding its slots
    itself: the routing and the rotated rows and block sums equal route_small's and rotate_rows' exactly, for
    every operand format, with expert maps, up to ROUTE_SLOTS slots; fused_moe takes it up to ROUTE_ROTATE."""
    pytest.importorskip("triton")
    run_interpreted("""
from xmoe.kernels.routing import ROUTE_SLOTS
for M, E, top_k, skew, ep, codebook, launch in (
        (1, 8, 2, False, False, 'mcg', ops.Launch(8, 128, 1, mma=True)),
        (6, 64, 6, True, False, 'mul1', ops.Launch(8, 128, 1, mma=True)),
        (7, 16, 8, True, True, 'mul1', ops.Launch(16, 64, 1)),
        (21, 64, 6, False, True, '3inst', ops.Launch(2, 64, 1, tiled=True, gemv=True)),
        (16, 8, 8, True, False, 'mcg', ops.Launch(16, 64, 1))):
    ids, _ = routing(M, E, top_k, skew, seed=M, device='cpu')
    emap, n = None, E
    if ep:
        n = E // 2
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[E // 4:E // 4 + n] = torch.arange(n, dtype=torch.int32)
    experts = random_experts(n, 256, 128, 2, codebook, seed=E)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).half()
    P = M * top_k
    assert P <= ROUTE_SLOTS
    a = ops.route(ids, n, launch.BM, emap, backend='triton')
    rotated = ops._rotate(x, a.rows, a.sorted_expert, experts.gate, experts.up, P, launch)
    b, fused = ops._route_rotate(x, ids, emap, experts.gate, experts.up, launch)
    for f in ('rows', 'sorted_expert', 'slot_pos', 'slot_expert'):
        assert torch.equal(getattr(a, f), getattr(b, f)), (M, E, f)
    count = int(a.chunks[3])
    assert int(b.chunks[3]) == count and a.chunks[4] == b.chunks[4], (M, E)
    for u, v in zip(a.chunks[:3], b.chunks[:3]):
        assert torch.equal(u[:count], v[:count]), (M, E)
    live = a.sorted_expert < n
    assert live.any() and (ep or live.all()), (M, E)
    pairs = zip(rotated, fused) if codebook == 'mul1' else zip(rotated[:2], fused[:2])  # sums only at mul1
    for u, v in pairs:
        assert torch.equal(u[live], v[live]), (M, E, codebook)
taken, fused = [], ops._route_rotate
ops._route_rotate = lambda *args: taken.append(args[1].numel()) or fused(*args)
experts = random_experts(8, 128, 128, 2, 'mcg')
for M in (ops.ROUTE_ROTATE // 8, ops.ROUTE_ROTATE // 8 + 1):
    ids, weights = routing(M, 8, 8, False)
    ops.fused_moe(torch.randn(M, 128).half(), ids, weights, experts, backend='triton')
assert taken == [ops.ROUTE_ROTATE], taken
""")


def test_empty_batch_interpreter():
    """A call with no tokens (a rank with nothing routed to it) returns an empty output, on every backend."""
    pytest.importorskip("triton")
    run_interpreted("""
experts = random_experts(8, 128, 128, 2, 'mcg')
x, ids, w = torch.zeros(0, 128, dtype=torch.float16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
for backend in ('triton', 'torch'):
    assert ops.fused_moe(x, ids, w, experts, backend=backend).shape == (0, 128), backend
""")
