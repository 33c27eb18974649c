"""fused_moe on the Triton kernels: one plan (plan.plan_moe), then its launches.

A call routes its slots by expert on the device, rotates each slot's row by its expert's suh, runs gate and up as
one grouped GEMM over chunks of one expert's rows, the activation as an epilogue that rotates for down, down as a
second grouped GEMM, and a combine that sums each token's slots by their weights. In prefill-sized calls, experts
with many rows are decoded once and multiplied densely (dense.py), the rest left to the grouped GEMMs.
"""
import torch

from . import dense as D
from . import launch as L
from .plan import MoePlan, eager, plan_moe, target_of
from .routing import Routing, route
from .tuning import Tuning, tuning_for
from .weights import Exl3Experts


def fused_moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Exl3Experts,
                     limit: float | None, expert_map: torch.Tensor | None, tuning: Tuning | None) -> torch.Tensor:
    """fused_moe (ops) on the Triton kernels, its arguments checked there."""
    dev = x.device
    tuning = tuning or tuning_for(str(dev))
    L.eager_tables((experts.gate, experts.up, experts.down), dev)
    plan = plan_moe(topk_ids.shape[0], topk_ids.shape[1], experts, target_of(dev), tuning, eager(dev))
    return run_moe(plan, x, topk_ids, topk_weights, experts, limit, expert_map, tuning)


def run_moe(plan: MoePlan, x, topk_ids, topk_weights, experts: Exl3Experts, limit, expert_map,
            tuning: Tuning) -> torch.Tensor:
    """The launches of `plan`. The one choice left to the call is the dense experts the routing gives."""
    g, u, d = experts.gate, experts.up, experts.down
    P, E, dev = plan.slots, experts.count, x.device
    r, (a0, a1, s0, s1), hot, gate_up, down = _route_and_rotate(plan, L.padded_rows(x, g.k), topk_ids, expert_map,
                                                                 experts, tuning)
    grouped = not (hot and hot.every)  # some experts are left to the grouped kernels
    chunks = D.without(r.chunks, hot, E) if hot and grouped else r.chunks
    pg = torch.empty(gate_up.split, P, g.n, device=dev, dtype=torch.float32)
    pu = torch.empty_like(pg)
    if grouped:
        L.gemm(a0, a1, chunks, g, pg, pu, u, gate_up, tuning)
    D.dense_products(hot, [(a0, g, pg, plan.decode_mma[0]), (a1, u, pu, plan.decode_mma[1])], plan.dense_tile,
                     plan.tma, tuning)
    mid, mid_sums = L.act_buffer(P, g.n, down, dev), L.sums(P, g.n, d, dev)
    L.act_epilogue(pg, pu, s0, s1, r, experts, mid, mid_sums, limit, gate_up.split, plan.act)
    pd = torch.empty(down.split, P, d.n, device=dev, dtype=torch.float32)
    if grouped:
        L.gemm(mid, mid, chunks, d, pd, None, None, down, tuning)
    D.dense_products(hot, [(mid, d, pd, plan.decode_mma[2])], plan.dense_tile, plan.tma, tuning)
    out = torch.empty(plan.tokens, experts.hidden, device=dev, dtype=x.dtype)
    L.combine(pd, mid_sums, r, topk_weights, d, out, topk_ids.shape[1], plan.combine)
    return out


def _route_and_rotate(plan: MoePlan, xp, topk_ids, expert_map, experts: Exl3Experts, tuning: Tuning) -> tuple:
    """The routing, the rotated rows of gate and up with their block sums, the dense experts (None if none), and
    the launches of gate and up and of down that the rest of the call takes."""
    g, u = experts.gate, experts.up
    gate_up, down, hot = plan.gate_up, plan.down, None
    if plan.route == "route_rotate":
        r, rotated = L.route_rotate(xp, topk_ids, expert_map, g, u, gate_up, plan.rotate)
        return r, rotated, hot, gate_up, down
    r: Routing = route(topk_ids, experts.count, gate_up.BM, expert_map, backend="triton")
    found = None
    if plan.dense:
        found = D.find_hot(r, plan.slots, experts.count, plan.dense_tile.BM, plan.dense_rows, tuning, xp.device)
    if plan.dense_gate_up is not None and found:  # the rotation's format waits for the dense experts
        hot, found = D.hot_experts(found), None
        if hot:
            gate_up, down = plan.dense_gate_up, plan.dense_down
    # otherwise the GPU rotates while the host waits for the counts of the dense experts
    rotated = L.rotate(xp, r.rows, r.sorted_expert, g, u, plan.slots, gate_up, plan.rotate)
    if found:
        hot = D.hot_experts(found)
    return r, rotated, hot, gate_up, down
