"""The ops' surface on any machine (backend choice, errors, merged layers' slices, kept tables), kernels compiled for
GPU architectures (Triton compiles without a GPU), and on a GPU the Triton kernels against the torch references over
the full grid, each kernel path forced by a Tuning. The CPU runs the kernels in test_interpreted.py."""
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_experts, random_weight, routing  # noqa: E402
from checks import check_decode, check_linear, check_moe, check_slices, close  # noqa: E402

from xmoe.format.trellis import state_windows  # noqa: E402
from xmoe.kernels import launch, ops  # noqa: E402
from xmoe.kernels.plan import Target, dense_tile  # noqa: E402
from xmoe.kernels.reference import exl3_linear_ref  # noqa: E402
from xmoe.kernels.tuning import DEFAULT  # noqa: E402
from xmoe.kernels.weights import Exl3Slices  # noqa: E402

INF = float("inf")


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


@pytest.mark.parametrize("split, out, mul1", [(1, "*i32", False), (6, "*i32", False), (12, "*i32", False),
                                              (16, "*i32", False), (16, "*fp32", False), (4, "*i32", True)])
def test_act_epilogue_compiles_without_spills(split, out, mul1):
    """act_epilogue as decode calls launch it (act_rows rows, up to split_most K splits of gate and up; grouped_mma's
    doubled fp16 or grouped_gemv's fp32 out), compiled for sm_90: no register spilled (at 16 rows 120-176 bytes a
    thread spilled at 12-16 splits)."""
    pytest.importorskip("triton")
    from cubins import compile_triton, resources
    from xmoe.kernels.triton_epilogues import act_epilogue

    args = dict(pg_ptr="*fp32", pu_ptr="*fp32", sums_g_ptr="*fp32", sums_u_ptr="*fp32", expert_ptr="*i32",
                svh_g_ptr="*fp16", svh_u_ptr="*fp16", suh_d_ptr="*fp16", had_ptr="*fp16", out_ptr=out,
                sums_ptr="*fp32", P="i32", n="i32", n_real="i32", E="i32", limit="fp32", KB="i32")
    const = dict(HAS_LIMIT=mul1, MUL1_H=mul1, SUMS=mul1, SPLIT=split, BM=DEFAULT.act_rows)
    kernel = compile_triton(act_epilogue, args, const, 90, num_warps=DEFAULT.epilogue_few_warps)
    usage = resources(kernel.asm["cubin"])
    assert usage["STACK"] == usage["LOCAL"] == 0, usage


@pytest.mark.parametrize("arch, smem", [(90, 232448), (100, 232448), (120, 101376), (89, 101376), (86, 101376),
                                         (80, 166912)])
def test_dense_gemm_fits_shared_memory(arch, smem):
    """The dense path's GEMM (dense_gemm_tma from sm_90, dense_gemm before) at the tile and pipeline stages
    plan.dense_tile gives a GPU with `smem` bytes of shared memory a program (H100, H200 and B200: 227 KB; A100:
    163 KB; RTX 3090/4090/5090 and their workstation parts: 99 KB), compiled for its arch: it fits."""
    pytest.importorskip("triton")
    from cubins import compile_triton
    from xmoe.kernels.triton_dense import dense_gemm, dense_gemm_tma

    tile = dense_tile(Target("cuda:0", gpu=True, shared_memory=smem))
    BM, BN, BK = tile.BM, tile.BN, tile.BK
    tma = arch >= 90
    operands = ({"a_desc": f"tensordesc<fp16[{BM}, {BK}]>", "w_desc": f"tensordesc<fp16[{BK}, {BN}]>"} if tma else
                {"a_ptr": "*fp16", "w_ptr": "*fp16"})
    args = {**operands, "chunk_pos_ptr": "*i32", "chunk_len_ptr": "*i32", "chunk_slot_ptr": "*i32", "p_ptr": "*fp32",
            "P": "i32", "k": "i32", "n": "i32"}
    kernel = compile_triton(dense_gemm_tma if tma else dense_gemm, args, dict(SPLIT=1, BM=BM, BN=BN, BK=BK), arch,
                            num_warps=tile.warps, num_stages=tile.stages)
    assert kernel.metadata.shared <= smem, (tile.stages, kernel.metadata.shared)


def test_gather_tables_made_eagerly():
    """The gather decoder's state windows are made by every eager call, whichever path it takes, so that a CUDA
    graph capture that gathers finds them (a host table cannot be copied inside a capture)."""
    launch.windows.cache_clear()
    w = random_weight(256, 256, 3, "mcg")
    launch.eager_tables((w, random_weight(256, 256, 2, "mcg")), torch.device("cpu"))
    assert launch.windows.cache_info().currsize == 2 and torch.equal(launch.windows(3, "cpu"), state_windows(3))


def test_row_chunks_kept_per_shape():
    """A dense layer's chunk tables are built once per shape: M rows in chunks of BM, all on expert 0."""
    (pos, length, expert, count, bound), rows, zeros = launch.row_chunks(5, 2, torch.device("cpu"))
    assert pos.tolist() == [0, 2, 4] and length.tolist() == [2, 2, 1] and expert.tolist() == [0, 0, 0]
    assert count.tolist() == [3] and bound == 3 and rows.tolist() == list(range(5)) and zeros.tolist() == [0] * 5
    assert launch.row_chunks(5, 2, torch.device("cpu"))[0][0] is pos


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
GPU_SLICES = [(M, 5120, widths, K, cb) for M in (1, 6, 16, 33, 200) for widths, K, cb in
              (((5120, 1024, 1024), 2, "mcg"), ((2304, 2304), 3, "mcg"), ((4096, 512, 512), 2, "mul1"),
               ((1024, 512), 4, "3inst"))]


def forced(path: str):
    """The default tuning (path "tiled"), or one that forces each path on every case: gather; tiled on tensor cores
    (plain or swapped operands); on CUDA cores (grouped_gemv, chunks of up to 2 rows); on mma.sync (grouped_mma,
    chunks of up to 8 rows, or of 32: "rows", where it can run)."""
    if path == "tiled":
        return DEFAULT
    swap = path.endswith("swap")
    return replace(DEFAULT, decoder=path.split("-")[0], mma_mid_max_rows=0, tiled_dot_max_rows=0,
                   dot_decode=replace(DEFAULT.dot_decode, swap=swap),
                   dot_prefill=replace(DEFAULT.dot_prefill, swap=swap),
                   gemv_max_rows=INF if path.endswith("gemv") else 0,
                   mma_decode_max_rows=INF if path.endswith("mma") else 0,
                   mma_prefill_max_rows=INF if path.endswith("rows") else 0)


@pytest.fixture(params=["gather", "tiled", "tiled-swap", "tiled-gemv", "tiled-mma", "tiled-rows"])
def tuning(request):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return forced(request.param)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_LINEAR, ids=str)
def test_linear_gpu(case, tuning):
    check_linear(*case, "cuda", tuning=tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_MOE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_moe_gpu(case, tuning):
    check_moe(**case, device="cuda", tuning=tuning)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SLICES, ids=str)
def test_linear_slices_gpu(case, tuning):
    check_slices(*case, "cuda", tuning=tuning)


@pytest.mark.gpu
def test_mma_padding_never_reaches_the_output(monkeypatch):
    """grouped_mma's MMA takes 8 rows a chunk, a short chunk's spare rows reading its last row again, never the
    next expert's rows or other ranks' rows: with every activation buffer NaN before it is written
    (launch.act_buffer), every output still matches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    made, mma = launch.act_buffer, replace(DEFAULT, mma_decode_max_rows=INF)

    def poisoned(P, cols, planned, device):
        rows = made(P, cols, planned, device)
        rows.fill_(0x7E007E00 if rows.dtype == torch.int32 else float("nan"))  # int32: fp16 NaN, doubled
        return rows

    monkeypatch.setattr(launch, "act_buffer", poisoned)
    for case in GPU_MOE:
        if case["M"] <= 48:
            check_moe(**case, device="cuda", tuning=mma)
    for M in (1, 6, 7):
        check_linear(M, 5120, 1152, 2, "mcg", False, "cuda", tuning=mma)


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
def test_dense_path_gpu():
    """decode_experts bit-exact at every K and codebook; every expert taken densely (dense_rows 1) on MoE cases."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    for K, cb in ((1, "mcg"), (2, "mcg"), (2, "3inst"), (3, "mcg"), (3, "3inst"), (3, "mul1"), (4, "mcg"), (8, "mul1"),
                  (1.5, "mul1"), (2.5, "mul1"), (3.5, "mul1")):
        check_decode(1024, 384, K, cb, "cuda")
    every = replace(DEFAULT, dense_rows=1)
    for case in GPU_MOE[::7] + GPU_LINEAR[::5]:
        if isinstance(case, dict):
            check_moe(**case, device="cuda", tuning=every)
        else:
            check_linear(*case, "cuda", tuning=every)


@pytest.mark.gpu
def test_linear_cuda_graph_replay_equals_eager():
    """exl3_linear (and exl3_linear_slices) replayed from CUDA graphs equals eager calls: for a shape first seen
    inside the capture (its chunk tables are then made by the graph) and for one whose tables were kept from an
    eager call."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    w = random_weight(1024, 512, 2, "mcg", device="cuda")
    ops.exl3_linear(torch.randn(4, 1024, device="cuda", dtype=torch.float16), w, backend="triton")  # compiles
    k3 = random_weight(1024, 512, 3, "mul1", device="cuda")  # at 48 rows: grouped_mma's chunks of 32
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
