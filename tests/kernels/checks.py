"""Checks of the Triton ops against the torch references, shared by the CPU (interpreter) and GPU tests, and the
tools the CPU tests use: a subprocess under TRITON_INTERPRET=1, and a torch model of grouped_mma (Gluon runs on
GPUs only) so that what feeds and finishes it runs under the interpreter."""
import os
import subprocess
import sys
from pathlib import Path

import torch
from cases import random_experts, random_weight, routing

from xmoe.format.trellis import decode_inner, tiles_to_matrix, unpack_states
from xmoe.kernels import dense, launch, ops, plan
from xmoe.kernels.reference import exl3_linear_ref, fused_moe_ref
from xmoe.kernels.weights import Exl3Slices

HERE = Path(__file__).parent
# Relative to the output's largest magnitude: fp16 rounding of the rotated activations, and of the output.
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 2e-3}


def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= TOL[got.dtype] * scale + 1e-6, f"{what}: max error {err:.3g} vs output scale {scale:.3g}"


def check_linear(M, k, n, K, codebook, bias, device, dtype=torch.float16, tuning=None):
    w = random_weight(k, n, K, codebook, seed=M + k, device=device)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(device, dtype)
    b = torch.randn(n).to(device, dtype) if bias else None
    got = ops.exl3_linear(x, w, b, backend="triton", tuning=tuning)
    assert got.shape == (M, n) and got.dtype == dtype
    close(got, exl3_linear_ref(x.float(), w, b), f"linear M={M} {k}x{n} K={K} {codebook}")


def check_slices(M, k, widths, K, codebook, device, tuning=None):
    """exl3_linear_slices against each layer's reference, side by side."""
    layers = [random_weight(k, n, K, codebook, seed=n + i, device=device) for i, n in enumerate(widths)]
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(device, torch.float16)
    got = ops.exl3_linear_slices(x, Exl3Slices.of(layers), backend="triton", tuning=tuning)
    ref = torch.cat([exl3_linear_ref(x.float(), w) for w in layers], dim=1)
    close(got, ref, f"slices M={M} k={k} {widths} K={K} {codebook}")


def expert_map(E: int, device) -> tuple:
    """(map, local experts): this rank owns the middle half of the experts."""
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[E // 4:E // 4 + E // 2] = torch.arange(E // 2, dtype=torch.int32)
    return emap.to(device), E // 2


def check_moe(M, E, hidden, inter, top_k, K, codebook, skew, device, limit=None, ep=False, K_down=None,
              dtype=torch.float16, tuning=None):
    ids, weights = routing(M, E, top_k, skew, seed=M, device=device)
    x = torch.randn(M, hidden, generator=torch.Generator().manual_seed(E)).to(device, dtype)
    emap, n_local = expert_map(E, device) if ep else (None, E)
    experts = random_experts(n_local, hidden, inter, K, codebook, K_down, seed=E, device=device)
    got = ops.fused_moe(x, ids, weights, experts, limit=limit, expert_map=emap, backend="triton", tuning=tuning)
    ref = fused_moe_ref(x.float(), ids, weights, experts, limit=limit, expert_map=emap)
    assert got.dtype == dtype
    close(got, ref, f"moe M={M} E={E} {hidden}/{inter} top{top_k} K={K} {codebook} skew={skew} ep={ep}")


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


SMALL_LINEAR = [(1, 128, 128, 2, "mcg", False), (7, 200, 300, 3, "mul1", True), (33, 256, 128, 4, "3inst", False),
                (5, 128, 256, 2.5, "mul1", False)]
SMALL_SLICES = [(1, 256, (256, 128, 128), 2, "mcg"), (5, 128, (128, 384), 3, "mul1"),
                (3, 200, (384, 128), 2.5, "mul1"), (2, 128, (256, 256), 4, "3inst")]
SMALL_MOE = [dict(M=1, E=8, hidden=128, inter=128, top_k=2, K=2, codebook="mcg", skew=False),
             dict(M=7, E=8, hidden=200, inter=160, top_k=3, K=3, codebook="mul1", skew=True, K_down=2),
             dict(M=6, E=16, hidden=128, inter=256, top_k=8, K=4, codebook="3inst", skew=False, limit=0.7),
             dict(M=33, E=8, hidden=128, inter=128, top_k=1, K=2, codebook="mcg", skew=True, ep=True)]


def run_interpreted(fn, *args) -> None:
    """fn(*args) in a subprocess under TRITON_INTERPRET=1, which Triton reads when a kernel is defined: the CPU runs
    the kernels there, while this process compiles them for GPUs. fn is a module-level function of a test module
    here, args Python literals."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    code = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom {fn.__module__} import {fn.__name__}\n" \
           f"{fn.__name__}(*{args!r})"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]


def mul1_h(w, e: int) -> torch.Tensor:
    """(k, n) fp32: mul1's h = 1024 + the byte sum of state x 0x83DCD12D for each weight of expert e (or of a
    single layer), the value the GEMM kernels multiply before the epilogue applies the codebook's FMA."""
    t = (w.trellis[e] if w.experts else w.trellis).cpu()
    states = tiles_to_matrix(unpack_states(t.reshape(-1, t.shape[-1]), w.K), w.k, w.n).long()
    x = (states * 0x83DCD12D) & 0xFFFFFFFF
    return (1024 + sum((x >> 8 * i) & 0xFF for i in range(4))).float()


def emulate_mma() -> tuple:
    """Plan as a GPU where grouped_mma runs (a CPU target that says it is a CUDA GPU), and give its launches to a
    torch model of the kernel's contract: each chunk's rows (the low fp16 half of each int32) times its expert's
    weights, all in K split 0, the other splits zero; at mul1 the weights are h (mul1_h), as the kernel leaves the
    codebook's FMA to the epilogue (triton_epilogues.mul1_affine). The dense path's experts are decoded by
    triton_gemm's decoder. Returns (the emulated launches' codebooks, every grouped launch taken)."""
    gemm, calls, launches = launch.gemm, [], []

    def inner(w, e):
        if w.codebook == "mul1":
            return mul1_h(w, e)
        return decode_inner(w.trellis[e] if w.experts else w.trellis, w.K, w.codebook).float()

    def mma_gemm(a0, a1, chunks, w, p0, p1, second, planned, tuning):
        launches.append(planned)
        if not planned.mma:
            return gemm(a0, a1, chunks, w, p0, p1, second, planned, tuning)
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

    plan.device_target = lambda device: plan.Target(device, gpu=True)
    launch.gemm = mma_gemm
    dense._decode_lanes = dense._decode_tiles  # gluon_mma's dense decoder cannot run here either
    return calls, launches


def record_hot() -> list:
    """Every call's dense experts (dense.hot_experts' answers), appended as the calls run."""
    hot, find = [], dense.hot_experts

    def recorded(found):
        hot.append(find(found))
        return hot[-1]
    dense.hot_experts = recorded
    return hot

