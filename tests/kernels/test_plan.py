"""The planner: which kernel, tile and K split each call takes, as plain values (no kernel runs). The plans at
DeepSeek-V4.1's per-rank shapes on an H100 or H200 (132 multiprocessors, grouped_mma available) are pinned: a
change to the planning that moves one of them changes the launches the GPU figures were measured with."""
import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_weight  # noqa: E402

from xmoe.kernels import launch  # noqa: E402
from xmoe.kernels.plan import (Launch, Target, dense_tile, mma_refusal, plan_gemm, plan_linear,  # noqa: E402
                               plan_moe)
from xmoe.kernels.tuning import DEFAULT  # noqa: E402
from xmoe.kernels.weights import Exl3Experts, Exl3Weight  # noqa: E402

GPU = Target("cuda:0", sms=132, gpu=True, gluon_refusal=None, tma=True, shared_memory=232448)


def weight(k: int, n: int, K: float, codebook: str = "mcg", experts: int = 0) -> Exl3Weight:
    """A layer (or stack) of the right shapes that takes no memory: planning reads shapes only."""
    lead = (experts,) if experts else ()
    trellis = torch.zeros(1, k // 16, n // 16, int(16 * K), dtype=torch.int16).expand(*(lead or (1,)), -1, -1, -1)
    vec = lambda m: torch.zeros(1, m, dtype=torch.float16).expand(*(lead or (1,)), -1)  # noqa: E731
    return Exl3Weight(trellis if experts else trellis[0], vec(k) if experts else vec(k)[0],
                      vec(n) if experts else vec(n)[0], K, codebook, k, n)


def v41(K: float = 2, K_down: float | None = None, codebook: str = "mcg", E: int = 384) -> Exl3Experts:
    """DeepSeek-V4.1's experts on one rank of two: hidden 5120, intermediate 1152."""
    return Exl3Experts(weight(5120, 1152, K, codebook, E), weight(5120, 1152, K, codebook, E),
                       weight(1152, 5120, K_down or K, codebook, E))


def shape(x: Launch | None) -> tuple | None:
    return x and (x.kernel, x.BM, x.BN, x.BK, x.split, x.pair)


MMA, GEMM = "grouped_mma", "grouped_gemm"


@pytest.mark.parametrize("tokens, K, gate_up, down, dense_gate_up, dense, route, combine", [
    (1, 2, (MMA, 8, 128, 32, 12, False), (MMA, 8, 128, 32, 6, False), None, False, "route_rotate",
     ("combine_stacked", 1, 4)),
    (6, 2, (MMA, 8, 128, 32, 11, False), (MMA, 8, 128, 32, 5, True), None, False, "route_rotate",
     ("combine_stacked", 1, 4)),
    (12, 2, (MMA, 8, 128, 32, 6, False), (MMA, 8, 128, 32, 3, True), None, False, "route_small",
     ("combine_stacked", 2, 4)),
    (48, 2, (MMA, 8, 128, 32, 2, False), (MMA, 8, 128, 32, 1, True), None, False, "route_counted",
     ("combine_epilogue", 16, 4)),
    (1542, 2, (MMA, 32, 128, 16, 1, False), (MMA, 32, 256, 16, 1, False), (GEMM, 32, 128, 64, 1, False), True,
     "route_counted", ("combine_epilogue", 64, 4)),
    (4096, 2, (GEMM, 64, 128, 64, 1, False), (GEMM, 64, 128, 64, 1, False), None, True, "route_counted",
     ("combine_epilogue", 64, 4)),
    (6, 3, (MMA, 8, 128, 32, 11, False), (MMA, 8, 128, 32, 5, True), None, False, "route_rotate",
     ("combine_stacked", 1, 4)),
    (1542, 3, (MMA, 32, 128, 16, 1, False), (MMA, 32, 256, 16, 1, False), (GEMM, 32, 32, 16, 1, False), True,
     "route_counted", ("combine_epilogue", 64, 4))])
def test_moe_plans_at_v41_shapes(tokens, K, gate_up, down, dense_gate_up, dense, route, combine):
    plan = plan_moe(tokens, 6, v41(K), GPU)
    assert (shape(plan.gate_up), shape(plan.down), shape(plan.dense_gate_up)) == (gate_up, down, dense_gate_up)
    assert (plan.dense, plan.route, plan.combine) == (dense, route, combine)
    assert plan.dense_down is None or plan.dense_down.BM == plan.down.BM == plan.gate_up.BM
    assert plan.act == ((4, 4) if tokens * 6 <= 256 else (64, 4)) and plan.dense_rows == 128


@pytest.mark.parametrize("rows, K, expected", [
    (1, 2, (MMA, 8, 128, 32, 16, False)), (8, 3, (MMA, 8, 128, 32, 16, False)),
    (12, 2, (MMA, 16, 128, 32, 16, False)), (16, 3, (MMA, 16, 128, 32, 16, False)),
    (64, 2, (GEMM, 64, 128, 64, 8, False)), (64, 3, (MMA, 32, 256, 16, 16, False)),
    (1542, 2, (GEMM, 64, 128, 64, 1, False)), (1542, 3, (GEMM, 64, 32, 16, 1, False))])
def test_linear_plans(rows, K, expected):
    """A 5120 -> 2304 layer: grouped_mma up to 8 rows, then in chunks of 16 ("mid"), at K = 3 in chunks of 32 up
    to the dense path's rows (no tiled decoder), tl.dot beyond."""
    plan = plan_linear(rows, weight(5120, 2304, K), GPU)
    assert shape(plan.launch) == expected and plan.dense == (rows >= 128)


def test_mixed_bits_share_one_chunking():
    """Gate and up at K = 2 with down at K = 3 at 1,000 tokens (16 rows an expert): the tiled decoder's tl.dot and
    grouped_mma's chunks of 32 would differ, so both take tl.dot over one chunking."""
    plan = plan_moe(1000, 6, v41(2, 3), GPU)
    assert plan.gate_up.kernel == plan.down.kernel == GEMM and plan.gate_up.BM == plan.down.BM


def test_dense_rows():
    """Experts go dense from fewer rows where a projection would gather (K = 3, 2.5) but gluon_mma decodes it,
    unless grouped_mma's prefill chunks take the other experts."""
    def rows(experts, target=GPU, tokens=4096, top_k=6):
        plan = plan_moe(tokens, top_k, experts, target)
        assert plan.dense
        return plan.dense_rows
    half = Exl3Experts(weight(1024, 384, 2, "mul1", 64), weight(1024, 384, 2, "mul1", 64),
                       weight(384, 1024, 2.5, "mul1", 64))
    assert rows(half) == DEFAULT.dense_rows_untiled and rows(v41(2, E=64)) == DEFAULT.dense_rows
    assert rows(v41(5, E=64)) == DEFAULT.dense_rows and rows(half, Target()) == DEFAULT.dense_rows
    assert rows(half, tokens=256) == DEFAULT.dense_rows  # 24 rows an expert: grouped_mma's 32-row chunks


def test_gemv_plan():
    assert plan_gemm(36, 1152, 5120, 1.0, 132).gemv and plan_gemm(36, 1152, 5120, 1.0, 132).BM == 2
    assert not plan_gemm(6, 1152, 5120, 6.0, 132).gemv
    assert not plan_gemm(36, 1152, 5120, 1.0, 132, K=3).gemv  # the gather decoder has no CUDA-core path


@pytest.mark.parametrize("chunks", [1, 6, 18, 35, 68, 202])
@pytest.mark.parametrize("n, k", [(1152, 5120), (5120, 1152), (5120, 2304), (2304, 5120)])
def test_plan_leaves_no_split_empty(chunks, n, k):
    """Each K split gets ceil(steps / split) steps in the kernels; the plan never has a split past the last step,
    which would load a step beyond the weight's words before its empty loop."""
    for (rows, mma), single in itertools.product(((1.0, True), (6.0, True), (24.0, True), (1.0, False), (64.0, False)),
                                                 (False, True)):
        planned = plan_gemm(chunks, n, k, rows, 132, mma=mma, single=single)
        steps = k // planned.BK
        assert (planned.split - 1) * -(-steps // planned.split) < steps, (planned, steps)


def test_mma_plan():
    planned = plan_gemm(36, 1152, 5120, 1.0, 132, mma=True)
    assert planned.mma and not planned.gemv and planned.BM == 8
    rows = plan_gemm(36, 1152, 5120, 24.0, 132, mma=True)  # more rows per expert than 8: chunks of 32
    assert rows.mma and rows.BM == 32 and rows.BN == 128  # 256 does not divide 1,152 columns
    assert not plan_gemm(36, 1152, 5120, 12.0, 132, mma=True).mma  # the tiled decoder's tl.dot launch up to 16
    assert plan_gemm(36, 1152, 5120, 12.0, 132, K=3, mma=True).BM == 32  # none at K = 3
    assert not plan_gemm(36, 1152, 5120, 200.0, 132, mma=True).mma
    mid = plan_gemm(1, 1152, 5120, 12.0, 132, mma=True, mid=True)  # a dense layer of 9-16 rows: chunks of 16
    assert mid.mma and mid.BM == 16 and plan_gemm(1, 1152, 5120, 12.0, 132, K=3, mma=True, mid=True).BM == 16
    assert plan_gemm(1, 1152, 5120, 17.0, 132, K=3, mma=True, mid=True).BM == 32
    assert plan_gemm(1, 2304, 5120, 64.0, 132, K=3, mma=True, rows_mma=127).BM == 32  # a K = 3 dense layer's reach
    assert plan_gemm(36, 1152, 5120, 1.0, 132, K=3, mma=True).mma  # K = 3: no tiled decoder, but grouped_mma's
    wide = replace(DEFAULT, mma_decode=replace(DEFAULT.mma_decode, BN=256))
    assert plan_gemm(36, 1152, 5120, 1.0, 132, mma=True, tuning=wide).BN == 128  # 256 does not divide 1,152
    assert "K = 8" in mma_refusal(8, GPU) and "CUDA" in mma_refusal(8, Target())
    assert "gather" in mma_refusal(2, GPU, replace(DEFAULT, decoder="gather"))
    assert "Triton" in mma_refusal(2, replace(GPU, gluon_refusal="Triton 3.5"))


def test_mma_pair_plan():
    """A decode-size launch of one projection takes two column blocks a program (mma_pair): half the programs, so
    more K splits; gate and up (two projections already), other regimes and odd counts of blocks do not."""
    down = plan_gemm(35, 5120, 1152, 1.0, 132, mma=True, single=True)
    unpaired = plan_gemm(35, 5120, 1152, 1.0, 132, mma=True)
    assert down.pair and not unpaired.pair and down.split > unpaired.split
    assert not plan_gemm(36, 1152, 5120, 1.0, 132, mma=True, single=True).pair  # 9 blocks of 128 columns
    assert not plan_gemm(36, 5120, 1152, 24.0, 132, mma=True, single=True).pair  # chunks of 32
    assert not plan_gemm(1, 5120, 1152, 12.0, 132, mma=True, mid=True, single=True).pair  # chunks of 16
    assert not plan_gemm(35, 5120, 1152, 1.0, 132, single=True).pair  # no grouped_mma
    dense = plan_gemm(1, 2304, 5120, 1.0, 132, mma=True, mid=True, single=True)  # one chunk: the split at its cap
    assert not dense.pair and dense.split == DEFAULT.split_most
    assert not plan_gemm(35, 5120, 1152, 1.0, 132, mma=True, single=True, tuning=replace(DEFAULT, mma_pair=False)).pair


def test_moe_split_cap():
    """A MoE call's decode launches split K at most split_most_moe times, dense layers at most split_most, and into
    no fewer than mma_min_steps K steps a program: at V4.1 shapes gate/up of two tokens (12 experts, 9 column
    blocks) reach the MoE cap, a one-row dense layer its own, one token's down (36 steps) the steps' bound."""
    gate_up = plan_gemm(12, 1152, 5120, 1.0, 132, mma=True)
    assert gate_up.mma and gate_up.split == DEFAULT.split_most_moe < DEFAULT.split_most
    assert plan_gemm(1, 1152, 5120, 1.0, 132, mma=True, mid=True, single=True).split == DEFAULT.split_most
    assert plan_gemm(34, 1152, 5120, 1.0, 132, mma=True).split < DEFAULT.split_most_moe  # 6 tokens: fill decides
    down = plan_gemm(6, 5120, 1152, 1.0, 132, mma=True, single=True)  # one token's: 36 K steps
    assert down.split == 1152 // down.BK // DEFAULT.mma_min_steps < DEFAULT.split_most_moe


def test_mma_pair_launch(monkeypatch):
    """How the launcher runs grouped_mma for one projection, paired (half the column blocks, two streams'
    registers and unroll) and not."""
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
        launch.gemm(a, a, chunks, w, p, None, None, Launch(8, 128, 2, mma=True, pair=pair), DEFAULT)
    (paired, kw), (alone, kw_alone) = launches
    assert paired == (3, 2, 2) and kw["PAIR"] and not kw["DUAL"] and alone == (3, 4, 2) and not kw_alone["PAIR"]
    assert (kw["UNROLL"], kw["maxnreg"]) == (DEFAULT.mma_unroll_two, DEFAULT.mma_registers_two)
    assert (kw_alone["UNROLL"], kw_alone["maxnreg"]) == (DEFAULT.mma_unroll_one, DEFAULT.mma_registers_one)
    assert kw["IDP"] == kw_alone["IDP"] == DEFAULT.idp(16, "mcg") != 0


def test_dense_tile_fits_shared_memory():
    """dense_gemm's stages: the tuning's at most, fewer where a program's shared memory would not hold them."""
    assert dense_tile(GPU).stages == DEFAULT.dense.stages == 3
    assert dense_tile(replace(GPU, shared_memory=101376)).stages == 2 and dense_tile(Target()) == DEFAULT.dense
