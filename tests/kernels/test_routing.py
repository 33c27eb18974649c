"""Routing a MoE call's slots by expert (torch reference and Triton), routing inside the rotation's launch, and the
dense path's tables of hot experts."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_experts, routing  # noqa: E402
from checks import expert_map, run_interpreted  # noqa: E402

from xmoe.kernels import dense, launch  # noqa: E402
from xmoe.kernels.plan import Launch, epilogue_launch  # noqa: E402
from xmoe.kernels.routing import ROUTE_SLOTS, Routing, route  # noqa: E402
from xmoe.kernels.tuning import DEFAULT  # noqa: E402


def test_route_groups_slots_by_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1], [2, 3]])
    r = route(ids, experts=4, BM=2)
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
    r = route(ids, experts=2, BM=16, expert_map=emap)
    assert r.slot_expert.tolist() == [-1, 1, 0, -1]
    assert int(r.chunks[3]) == 2


ROUTE_CASES = ((1, 8, 2, 1, False, False), (6, 384, 6, 1, True, False), (12, 32, 6, 4, True, False),
               (7, 16, 8, 16, True, True), (21, 64, 6, 2, False, True), (16, 8, 8, 16, True, False),
               (40, 384, 6, 16, True, False), (300, 64, 4, 64, False, True), (222, 384, 6, 64, True, True),
               (1100, 8, 1, 128, True, False), (400, 384, 8, 16, True, False), (500, 64, 8, 128, False, True))


def triton_routes():
    for M, E, top_k, BM, skew, ep in ROUTE_CASES:
        ids, _ = routing(M, E, top_k, skew, seed=M, device="cpu")
        emap, n = expert_map(E, "cpu") if ep else (None, E)
        a, b = route(ids, n, BM, emap), route(ids, n, BM, emap, backend="triton")
        for f in ("rows", "sorted_expert", "slot_pos", "slot_expert"):
            assert torch.equal(getattr(a, f).int(), getattr(b, f).int()), (M, E, f)
        count = int(a.chunks[3])
        assert int(b.chunks[3]) == count and a.chunks[4] == b.chunks[4], (M, E)
        for x, y in zip(a.chunks[:3], b.chunks[:3]):
            assert torch.equal(x[:count].int(), y[:count].int()), (M, E)
        if b.runs is not None:
            counts = torch.bincount(a.sorted_expert.long(), minlength=n + 1)[:n]
            ends = counts.cumsum(0)
            assert torch.equal(b.runs.long(), torch.stack([ends - counts, ends])), (M, E)


def test_triton_routes_equal_route_interpreter():
    """The Triton routings (one launch for decode sizes, a counting sort in two launches beyond, here over up to
    four blocks of slots) give route()'s sorted slots and chunks exactly, and the experts' runs."""
    pytest.importorskip("triton")
    run_interpreted(triton_routes)


def route_then_rotate():
    for M, E, top_k, skew, ep, codebook, planned in (
            (1, 8, 2, False, False, "mcg", Launch(8, 128, 1, mma=True)),
            (6, 64, 6, True, False, "mul1", Launch(8, 128, 1, mma=True)),
            (7, 16, 8, True, True, "mul1", Launch(16, 64, 1)),
            (21, 64, 6, False, True, "3inst", Launch(2, 64, 1, tiled=True, gemv=True)),
            (16, 8, 8, True, False, "mcg", Launch(16, 64, 1))):
        ids, _ = routing(M, E, top_k, skew, seed=M, device="cpu")
        emap, n = expert_map(E, "cpu") if ep else (None, E)
        experts = random_experts(n, 256, 128, 2, codebook, seed=E)
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M)).half()
        P = M * top_k
        assert P <= ROUTE_SLOTS
        a = route(ids, n, planned.BM, emap, backend="triton")
        rotated = launch.rotate(x, a.rows, a.sorted_expert, experts.gate, experts.up, P, planned, epilogue_launch(P))
        b, fused = launch.route_rotate(x, ids, emap, experts.gate, experts.up, planned,
                                       epilogue_launch(P, DEFAULT.route_rotate_rows))
        for f in ("rows", "sorted_expert", "slot_pos", "slot_expert"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (M, E, f)
        count = int(a.chunks[3])
        assert int(b.chunks[3]) == count and a.chunks[4] == b.chunks[4], (M, E)
        for u, v in zip(a.chunks[:3], b.chunks[:3]):
            assert torch.equal(u[:count], v[:count]), (M, E)
        live = a.sorted_expert < n
        assert live.any() and (ep or live.all()), (M, E)
        pairs = zip(rotated, fused) if codebook == "mul1" else zip(rotated[:2], fused[:2])  # sums only at mul1
        for u, v in pairs:
            # The interpreter's dots are numpy matmuls whose summation order follows the block's shape, so rows
            # rotated in differently shaped programs may differ in the last bit; on a GPU they are equal.
            torch.testing.assert_close(u[live], v[live], rtol=2 ** -10, atol=1e-6, msg=str((M, E, codebook)))
    from xmoe.kernels import ops
    taken, fused = [], launch.route_rotate
    launch.route_rotate = lambda *args: taken.append(args[1].numel()) or fused(*args)
    experts = random_experts(8, 128, 128, 2, "mcg")
    most = DEFAULT.route_rotate_max_slots
    for M in (most // 8, most // 8 + 1):
        ids, weights = routing(M, 8, 8, False)
        ops.fused_moe(torch.randn(M, 128).half(), ids, weights, experts, backend="triton")
    assert taken == [most], taken


def test_route_rotate_equals_route_then_rotate_interpreter():
    """Decode-size calls route and rotate in one launch (route_rotate), each rotating program finding its slots
    itself: the routing equals route_small's exactly, the rotated rows and block sums rotate_rows' to the last bit,
    for every operand format, with expert maps, up to ROUTE_SLOTS slots; fused_moe takes it up to
    route_rotate_max_slots."""
    pytest.importorskip("triton")
    run_interpreted(route_then_rotate)


def hot_tables(rows: int, rest: int, group: int) -> None:
    """The dense experts' tables: which experts go dense, and chunks of at most BM rows (pos, length, index in the
    group) covering each one's sorted rows in order, once; a route_small routing (no runs) too."""
    tuning = replace(DEFAULT, dense_rest=rest, dense_group=group)
    BM, E, cpu = 16, 64, torch.device("cpu")
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        counts = (torch.rand(E, generator=g) ** 6 * 400).long() * (torch.rand(E, generator=g) < trial / 40)
        ends = counts.cumsum(0)
        r = Routing(*[None] * 5, runs=torch.stack([ends - counts, ends]).int())
        hot = dense.hot_experts(dense.find_hot(r, int(ends[-1]), E, BM, rows, tuning, cpu))
        nonzero = [e for e in range(E) if counts[e]]
        chosen = [e for e in nonzero if counts[e] >= rows]
        if len(nonzero) - len(chosen) <= rest:
            chosen = nonzero
        if not chosen:
            assert hot is None
            continue
        assert hot.flags.tolist() == [int(e in chosen) for e in range(E + 1)] and hot.every == (chosen == nonzero)
        assert [len(ids) for ids, *_ in hot.groups] == [min(group, len(chosen) - i)
                                                        for i in range(0, len(chosen), group)]
        for i, (ids, pos, length, slot) in enumerate(hot.groups):
            assert ids.tolist() == chosen[i * group:(i + 1) * group]
            assert ((length >= 1) & (length <= BM)).all()
            for j, e in enumerate(ids.tolist()):
                mine = slot == j
                covered = [r for p, n in zip(pos[mine].tolist(), length[mine].tolist()) for r in range(p, p + n)]
                assert covered == list(range(ends[e] - counts[e], ends[e])), (trial, e)
    ids = torch.tensor([[3, 1], [3, 3], [0, 3]])  # route_small's routing, whose runs find_hot counts itself
    hot = dense.hot_experts(dense.find_hot(route(ids, 4, BM, backend="triton"), 6, 4, BM, 2, tuning, cpu))
    chosen = [0, 1, 3] if rest >= 2 else [3]  # experts 0 and 1 have a row each, 3 has four
    assert hot.flags.tolist() == [int(e in chosen) for e in range(5)]
    assert torch.cat([g[0] for g in hot.groups]).tolist() == chosen


def hot_tables_grid():
    for case in ((128, 8, 32), (12, 0, 2), (1, 8, 3)):
        hot_tables(*case)


def test_hot_expert_tables():
    pytest.importorskip("triton")
    run_interpreted(hot_tables_grid)
