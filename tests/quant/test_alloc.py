import json
from fractions import Fraction

import pytest

from checkpoints import save_hf
from xmoe.quant.alloc import allocate, candidates, group_cost, groups_of, sample
from xmoe.quant.convert import convert
from xmoe.quant.plan import ConvertOptions, make_plan


def curve(e2: float, drop: float) -> dict[float, float]:
    """An error curve: e2 at K=2, divided by `drop` for every extra bit."""
    return {K: e2 / drop ** (K - 2) for K in (1.0, 2.0, 3.0, 4.0)}


def spent(picks, numels) -> Fraction:
    return sum(Fraction(str(K)) * n for K, n in zip(picks, numels)) / sum(numels)


def test_budget_is_met_and_never_exceeded():
    numels = [2 * 4096, 4096] * 6  # gate+up and down groups of six layers
    costs = [curve(0.07 * (1 + i % 3), 4.0 + i % 5) for i in range(len(numels))]
    for bits in (1.5, 2.0, 2.25, 2.5, 2.75, 3.1, 4.0):
        picks = allocate(costs, numels, bits)
        assert spent(picks, numels) <= Fraction(str(bits))
        # nothing is left that could buy a lower error: no single group can go up a bit within the budget
        for i, K in enumerate(picks):
            if K < 4:
                up = list(picks)
                up[i] = K + 1
                assert spent(up, numels) > Fraction(str(bits)) or costs[i][K + 1] >= costs[i][K]
    exact = allocate(costs, numels, 2.5)
    assert spent(exact, numels) == Fraction(5, 2)  # reachable exactly: met exactly


def test_bits_go_where_the_error_curve_falls_fastest():
    numels = [4096, 4096]
    flat, steep = curve(0.05, 1.5), curve(0.05, 6.0)
    assert allocate([flat, steep], numels, 2.5) == [2.0, 3.0]
    assert allocate([steep, flat], numels, 2.5) == [3.0, 2.0]
    # a loud layer (weight 10) wins the extra bit even with the flatter curve
    loud = {K: 10 * e for K, e in flat.items()}
    assert allocate([loud, steep], numels, 2.5) == [3.0, 2.0]


def test_fixed_tensors_count_against_the_budget():
    numels = [4096, 4096]
    costs = [curve(0.05, 4.0), curve(0.05, 4.0)]
    picks = allocate(costs, numels, 3.0, fixed_bits=4 * 8192, fixed_numel=8192)  # half the weights fixed at K=4
    assert (sum(K * n for K, n in zip(picks, numels)) + 4 * 8192) / (8192 + 8192) <= 3.0
    assert sorted(picks) == [2.0, 2.0]
    with pytest.raises(ValueError, match=r"--bits 1\.2: below"):
        allocate(costs, numels, 1.2, fixed_bits=4 * 8192, fixed_numel=8192)


def test_candidates():
    assert candidates(2.25, "mcg") == [2, 3]
    assert candidates(2.25, "mul1") == [2, 2.5, 3]
    assert candidates(5.5, "mcg") == [5, 6]
    assert candidates(1.75, "mcg") == [1, 2]
    assert candidates(7.5, "mcg") == [7, 8]
    assert candidates(2.0, "mcg") == [2, 3]  # --allocate at a whole K never trades K=1 for K=3


def test_groups_share_K_the_kernels_need(tmp_path):
    src = save_hf("olmoe", tmp_path / "src")
    plan = make_plan(src, ConvertOptions(bits=2.5, encoder="beam"))
    groups = groups_of(plan.experts, plan.shapes)
    assert [(g.layer, g.roles, len(g.members)) for g in groups] == [
        (0, ("gate", "up"), 8), (0, ("down",), 4), (1, ("gate", "up"), 8), (1, ("down",), 4)]
    import re
    for g in groups:
        assert all(re.search(g.name, p.key) for p in g.members)
        assert not any(re.search(g.name, p.key) for p in plan.experts if p not in g.members)
    assert {p.expert for p in sample(groups[0], 2)} == {0, 3}
    cost = group_cost(groups[1], {p.key: {2.0: 0.1, 3.0: 0.02} for p in sample(groups[1], 2)}, weight=0.5)
    assert cost == pytest.approx({2.0: 0.5 * 4 * 0.1, 3.0: 0.5 * 4 * 0.02})


def test_allocated_conversion(tmp_path):
    src = save_hf("olmoe", tmp_path / "src")
    opts = ConvertOptions(bits=2.5, encoder="beam", beam_width=8, sample_experts=2, sample_strips=1,
                          bits_for=((r"layers\.1\..*down", 4),))
    report = convert(src, tmp_path / "dst", opts, ["cpu"])
    config = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    a = report["allocation"]
    assert a["achieved_bits"] <= 2.5 and config["bits"] <= 2.5 and len(a["groups"]) == 3
    by_key = {t["key"]: t["K"] for t in report["tensors"]}
    assert all(K == 4 for k, K in by_key.items() if ".layers.1." in k and "down" in k)
    for g in a["groups"]:  # every tensor carries its group's K; costs fall with K
        costs = [g["cost"][repr(K)] for K in a["candidates"]]
        assert costs == sorted(costs, reverse=True)
    if len({g["K"] for g in a["groups"]} | {4}) > 1:
        assert config["layer_bits"]
    from xmoe.quant.inspect import inspect_dir
    mix = inspect_dir(tmp_path / "dst")["bit_mix"]
    assert sum(m["tensors"] for m in mix.values()) == len(by_key)
