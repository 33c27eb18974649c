"""The Triton EXL3 kernels against the torch references on the CPU, under TRITON_INTERPRET=1 (small shapes; each
case runs in a subprocess, checks.run_interpreted). Launch settings other than the defaults come as Tuning
objects."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_experts  # noqa: E402
from checks import (SMALL_LINEAR, SMALL_MOE, SMALL_SLICES, check_decode, check_linear, check_moe,  # noqa: E402
                    check_slices, emulate_mma, record_hot, run_interpreted)

from xmoe.kernels.tuning import DEFAULT, Tile  # noqa: E402

pytest.importorskip("triton")
INF = float("inf")


def linear_small():
    for c in SMALL_LINEAR:
        check_linear(*c, "cpu")
    check_linear(3, 128, 128, 2, "mcg", True, "cpu", torch.bfloat16)


def test_linear_interpreter():
    run_interpreted(linear_small)


def slices_small():
    for c in SMALL_SLICES:
        check_slices(*c, "cpu")
    for c in SMALL_SLICES[:2]:  # every layer's slices decoded once
        check_slices(*c, "cpu", tuning=replace(DEFAULT, dense_rows=1))


def test_linear_slices_interpreter():
    """Layers sharing an input as one set of launches, on the grouped path and the dense one."""
    run_interpreted(slices_small)


def moe_small():
    for c in SMALL_MOE:
        check_moe(**c, device="cpu")
    check_moe(**SMALL_MOE[0], device="cpu", dtype=torch.bfloat16)
    check_moe(**SMALL_MOE[2], device="cpu", dtype=torch.bfloat16, tuning=replace(DEFAULT, dense_rows=1))


def test_moe_interpreter():
    """The small MoE grid, and bf16 inputs (vLLM's usual dtype) on the decode and the dense prefill paths."""
    run_interpreted(moe_small)


def prefill_epilogues():
    few = replace(DEFAULT, combine_few_max_tokens=0)
    check_moe(**SMALL_MOE[1], device="cpu", tuning=few)
    many = replace(few, epilogue_few_max_rows=4)
    check_moe(**dict(SMALL_MOE[1], M=300), device="cpu", tuning=many)
    check_moe(**dict(SMALL_MOE[2], M=300), device="cpu", tuning=many)


def test_prefill_epilogues_interpreter():
    """The epilogues as prefill takes them: 64 rows a program (the few-rows limit lowered to 4), at 300 tokens (the
    smaller cases take combine_stacked, 2 and 1 tokens a program at top-k 3 and 8, products of 8 rows; here also 4
    tokens a program at top-k 3, 16 rows, as calls of more than combine_few_max_tokens take it)."""
    run_interpreted(prefill_epilogues)


def gather_decoder():
    gather = replace(DEFAULT, decoder="gather")
    for K, cb in ((1, "mcg"), (2, "mcg"), (4, "3inst"), (8, "mul1")):
        check_linear(3, 256, 256, K, cb, False, "cpu", tuning=gather)
    for c in SMALL_MOE[:3]:
        check_moe(**c, device="cpu", tuning=gather)


def test_gather_decoder_interpreter():
    """The per-weight gather decoder (every K; the default takes it only where K is not 1, 2, 4 or 8)."""
    run_interpreted(gather_decoder)


def tiled_decoder():
    for K, cb in ((1, "mcg"), (8, "mul1"), (4, "mcg"), (2, "3inst")):
        check_linear(3, 256, 256, K, cb, False, "cpu")


def test_tiled_decoder_every_power_of_two_interpreter():
    """The tiled decoder (the default for K = 1, 2, 4, 8): each tile's words loaded once and spread."""
    assert DEFAULT.decoder == "tiled"
    run_interpreted(tiled_decoder)


def swapped_operands():
    swap = replace(DEFAULT, dot_decode=replace(DEFAULT.dot_decode, swap=True),
                   dot_prefill=replace(DEFAULT.dot_prefill, swap=True))
    for c in SMALL_LINEAR[:2]:
        check_linear(*c, "cpu", tuning=swap)
    for c in (SMALL_MOE[0], SMALL_MOE[2]):
        check_moe(**c, device="cpu", tuning=swap)


def test_tiled_swapped_operands_interpreter():
    """Tiled launches computing W^T a^T (by default at decode sizes) in both tl.dot tiles."""
    run_interpreted(swapped_operands)


def mma_epilogues():
    calls, _ = emulate_mma()
    for c in ((5, 256, 384, 2, "mul1", True), (1, 200, 256, 3, "mul1", False), (8, 256, 128, 2, "mcg", False)):
        check_linear(*c, "cpu")
    for c in (dict(M=7, E=8, hidden=200, inter=160, top_k=3, K=2.5, codebook="mul1", skew=True),
              dict(M=1, E=8, hidden=128, inter=128, top_k=2, K=3, codebook="mul1", skew=False, K_down=2),
              dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2, codebook="mul1", skew=False, limit=0.7),
              dict(M=6, E=16, hidden=128, inter=128, top_k=2, K=2, codebook="mul1", skew=True, ep=True),
              dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2, codebook="mcg", skew=True)):
        check_moe(**c, device="cpu")
    assert calls.count("mul1") == 10 and calls.count("mcg") == 3, calls


def test_mma_epilogues_interpreter():
    """Dense layers and MoE calls as they take grouped_mma (emulate_mma): at mul1 the rotations write the rows'
    block sums and the epilogues apply the codebook's FMA to the products (K = 2, 3, 2.5); at MCG they do not."""
    run_interpreted(mma_epilogues)


def prefill_chunks():
    _, launches = emulate_mma()
    rows = replace(DEFAULT, mma_decode_max_rows=0, tiled_dot_max_rows=0, mma_mid_max_rows=0, mma_prefill_max_rows=INF)
    for c in SMALL_LINEAR:
        check_linear(*c, "cpu", tuning=rows)
    for c in (dict(SMALL_MOE[1], M=40), dict(SMALL_MOE[2], M=9),
              dict(M=20, E=16, hidden=128, inter=256, top_k=2, K=2, codebook="mul1", skew=False)):
        check_moe(**c, device="cpu", tuning=rows)
    assert launches and all(x.mma and x.BM == 32 for x in launches), launches
    dense = replace(rows, dense_rows=12, dense_rest=0)
    hot = record_hot()
    launches.clear()
    check_moe(**dict(SMALL_MOE[2], M=24), device="cpu", tuning=dense)  # some experts dense, the rest on tl.dot
    assert hot[-1] is not None and not hot[-1].every and not any(x.mma for x in launches), (hot, launches)
    assert all(x.BM == 32 for x in launches), launches
    launches.clear()
    check_moe(**dict(SMALL_MOE[2], M=24, top_k=1), device="cpu", tuning=dense)  # none dense: still grouped_mma
    assert hot[-1] is None and launches and all(x.mma for x in launches), (hot, launches)


def test_mma_prefill_chunks_interpreter():
    """Prefill-sized calls on grouped_mma (chunks of 32 rows, gate and up in two launches; emulate_mma), and those
    of them with experts for the dense path, which take the tl.dot launches over the same chunks."""
    run_interpreted(prefill_chunks)


def mid_chunks():
    _, launches = emulate_mma()
    for M in (9, 16):
        for K, cb in ((2, "mcg"), (3, "mul1")):
            check_linear(M, 256, 128, K, cb, False, "cpu")
    for M in (12, 16):
        check_slices(M, 256, (256, 128), 2, "mul1", "cpu")
    assert len(launches) == 6 and all(x.mma and x.BM == 16 for x in launches), launches


def test_mma_mid_chunks_interpreter():
    """Dense and merged layers of 9-16 rows on grouped_mma in chunks of 16 (emulate_mma), at the defaults."""
    run_interpreted(mid_chunks)


def gemv_everywhere():
    gemv = replace(DEFAULT, gemv_max_rows=INF)
    linear = [(1, 128, 128, 2, "mcg", False), (3, 256, 256, 1, "mcg", True), (2, 256, 128, 4, "3inst", False),
              (1, 200, 300, 8, "mul1", True)]
    for c in linear:
        check_linear(*c, "cpu", tuning=gemv)
    for c in SMALL_MOE:
        check_moe(**c, device="cpu", tuning=gemv)
    for BM in (2, 1):  # chunks of 2 and of 1 row at a second block shape
        other = replace(gemv, gemv=Tile(BM=BM, BK=32, BN=32, warps=2, fill=32))
        check_moe(**SMALL_MOE[-1], device="cpu", tuning=other)


def test_gemv_interpreter():
    """grouped_gemv (chunks of up to 2 rows, CUDA cores) on every case it can take, every power-of-two K, then with
    chunks of 2 and of 1 row at a second block shape (BK 32, BN 32, 2 warps) on one case."""
    run_interpreted(gemv_everywhere)


def dense_path_grouped_beside():
    for K, cb in ((1, "mcg"), (2, "3inst"), (3, "mul1"), (4, "mcg"), (8, "mul1")):
        check_decode(256, 128, K, cb, "cpu")
    t = replace(DEFAULT, dense_rows=3, dense_rest=0)
    for c in (dict(SMALL_MOE[1], M=9), dict(SMALL_MOE[2], M=9), SMALL_MOE[3]):
        check_moe(**c, device="cpu", tuning=t)
    for c in SMALL_LINEAR:
        check_linear(*c, "cpu", tuning=t)


def test_dense_path_interpreter():
    """Experts with at least dense_rows rows (here 3) decoded once and multiplied densely, beside the grouped
    kernels for the rest, every K and decoder; a call of more than routing.ROUTE_SLOTS slots (sorted routing); a
    dense linear layer."""
    run_interpreted(dense_path_grouped_beside)


def dense_path_settings():
    t = replace(DEFAULT, dense_rows=1, dense_rest=0)
    check_moe(**SMALL_MOE[0], device="cpu", tuning=t)
    check_moe(**SMALL_MOE[1], device="cpu", tuning=replace(t, dense_rows=3, dense_rest=8))  # the few left go too
    t = replace(t, dense_rest=8, dense=Tile(BM=16, BK=64, BN=256, fill=0))  # experts of many chunks
    check_moe(**dict(SMALL_MOE[0], M=40, E=4, inter=384), device="cpu", tuning=t)
    t = replace(t, dense_rows=12, dense_rest=0)
    hot = record_hot()
    check_moe(**dict(SMALL_MOE[2], M=24), device="cpu", tuning=t)
    assert hot and all(h is not None and not h.every for h in hot), hot
    check_moe(**dict(SMALL_MOE[2], M=24), device="cpu", tuning=replace(t, dense_tma=False))


def test_dense_path_settings_interpreter():
    """The dense path's settings: every expert dense (dense_rows 1); a call whose few experts all go dense as the
    rest (dense_rest); experts of more rows than one dense_gemm chunk (BM 16 here); some experts dense, not all;
    dense_gemm_tma and, for GPUs without the copy engine, dense_gemm."""
    run_interpreted(dense_path_settings)


def empty_batch():
    from xmoe.kernels import ops
    experts = random_experts(8, 128, 128, 2, "mcg")
    x, ids, w = torch.zeros(0, 128, dtype=torch.float16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    for backend in ("triton", "torch"):
        assert ops.fused_moe(x, ids, w, experts, backend=backend).shape == (0, 128), backend


def test_empty_batch_interpreter():
    """A call with no tokens (a rank with nothing routed to it) returns an empty output, on every backend."""
    run_interpreted(empty_batch)
