"""The GPU benchmarks' CPU-side parts: their arguments, the launch settings they take, and the way they drive
exllamav3 (stock_moe.py's tier plan, as its BlockSparseMLP plans a call)."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).parent))
import stock_moe  # noqa: E402
from common import tuning_of  # noqa: E402

from xmoe.kernels.tuning import DEFAULT  # noqa: E402


def test_settings_from_the_command_line():
    assert tuning_of([]) is None
    t = tuning_of(["decoder=gather", "gemv.BK=32", "fill=8", "dense_rows=64"])
    assert t == replace(DEFAULT.with_fill(8), decoder="gather", dense_rows=64, gemv=replace(DEFAULT.gemv, BK=32,
                                                                                           fill=8))
    for bad in (["dense_row=1"], ["split_most.BK=1"], ["gemv.BQ=1"]):
        with pytest.raises(SystemExit):
            tuning_of(bad)


def test_benchmark_arguments():
    pytest.importorskip("triton")
    import linear_kernel
    import moe_kernel
    args = moe_kernel.arguments(["--tokens", "12", "--set", "mma_pair=False", "--versus", "split_most_moe=16"])
    assert args.tuning.mma_pair is False and args.versus_tuning.split_most_moe == 16
    assert args.versus_tuning.mma_pair is False  # --versus is on top of --set
    assert moe_kernel.arguments(["--fill", "8"]).tuning.gemv.fill == 8
    assert linear_kernel.arguments(["--versus", "split_most=48"]).versus_tuning.split_most == 48


def test_sweep_times_the_regime_fused_moe_plans():
    pytest.importorskip("triton")
    import sweep
    from test_plan import GPU, v41
    assert sweep.regime_field(6, 6, v41(2), GPU, DEFAULT) == "mma_decode"
    assert sweep.regime_field(1542, 6, v41(2), GPU, DEFAULT) == "mma_prefill"
    assert sweep.regime_field(6, 6, v41(2), GPU, replace(DEFAULT, decoder="gather")) == "gather_decode"


def test_stock_groups_hot_experts_as_exllamav3_does():
    """At V4.1 shapes a batched-reconstruct group holds 11 experts (256 MB of weights); groups are cut where
    padding to the group's most rows would pass 10%."""
    assert stock_moe.recon_cap(5120, 1152) == 11
    count = [300, 290, 500, 130, 0, 280, 129] + [0] * 9
    assert stock_moe.recon_groups([0, 1, 2, 3, 5, 6], count, 11) == [[2], [0, 1, 5], [3, 6]]
    assert stock_moe.recon_groups(list(range(12)), [200] * 12, 11) == [list(range(11)), [11]]


def test_stock_tier_plan():
    """Experts of up to 128 rows fused (mcg: one launch), above that batched; slots: fused experts' rows in expert
    order, then each group padded to its most rows; at mul1 the fused kernel takes up to 256 rows in tiers."""
    count = [3, 0, 200, 17, 190, 40, 0]  # 6 experts and the other ranks' bucket
    plan = stock_moe.tier_plan(count, 6, 128, False, 11)
    assert plan["launches"] == [(3, 1, 128, 16)] and plan["groups"] == [[2, 4]]
    assert plan["kind"] == [1, 0, 2, 1, 2, 1, 0] and plan["base"][:6] == [0, 0, 60, 3, 260, 20]
    assert plan["slots"] == 60 + 2 * 200 and plan["start"] == [0, 3, 3, 203, 220, 410, 450]
    mul1 = stock_moe.tier_plan(count, 6, 256, True, 11)
    assert mul1["launches"] == [(3, 33, 256, 64), (1, 17, 32, 32), (1, 1, 16, 16)] and mul1["groups"] == []
    assert stock_moe.tier_plan([5, 9, 0], 2, 256, True, 11)["launches"] == [(2, 1, 256, 16)]
    assert stock_moe.tier_plan([3, 0, 200, 17, 140, 40, 0], 6, 128, False, 11)["groups"] == [[2], [4]]  # > 10% pad
    with pytest.raises(ValueError, match="per-expert"):
        stock_moe.tier_plan([20000, 0], 1, 128, False, 11)
