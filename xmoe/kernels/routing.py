"""Grouping a MoE call's (token, expert) slots by expert, on the device and from host-known sizes only, so that
the grouped kernels' calls capture in CUDA graphs."""
from dataclasses import dataclass

import torch

ROUTE_SLOTS = 128  # route() takes one Triton launch (route_small) up to this many slots: (slots)^2 comparisons


@dataclass(frozen=True)
class Routing:
    """The slots (token, k) sorted by local expert, all on the device, from host-known sizes only.

    rows: token of each sorted position; sorted_expert: its expert (E for slots another rank owns);
    slot_pos: sorted position of each slot; slot_expert: local expert of each slot (-1: not ours);
    chunks: (pos, len, expert, count, bound), runs of one expert cut at BM rows, padded to `bound` entries;
    runs: (2, experts) first and end sorted position of each local expert, where the routing found them.
    """
    rows: torch.Tensor
    sorted_expert: torch.Tensor
    slot_pos: torch.Tensor
    slot_expert: torch.Tensor
    chunks: tuple
    runs: torch.Tensor | None = None


def chunk_bound(slots: int, BM: int, experts: int) -> int:
    """The most chunks `slots` sorted slots can make, cut at BM rows per expert: the grid's host-known bound."""
    return min(slots, -(-slots // BM) + experts)


def route(topk_ids: torch.Tensor, experts: int, BM: int, expert_map: torch.Tensor | None = None,
          backend: str = "torch") -> Routing:
    """Group slots by expert with device-side sort, scan and scatter: no host sync, so it graph-captures.
    backend "triton" takes one launch (route_small) where the slots are few enough, else two (_route_counted);
    "torch" is the reference, two dozen torch kernels."""
    if backend == "triton":
        small = topk_ids.numel() <= ROUTE_SLOTS
        return (_route_small if small else _route_counted)(topk_ids, experts, BM, expert_map)
    top_k = topk_ids.shape[1]
    local = (topk_ids if expert_map is None else expert_map[topk_ids.long()]).reshape(-1).long()
    key = torch.where(local >= 0, local, experts)
    order = torch.sort(key, stable=True).indices
    sorted_e = key[order]
    P = key.numel()
    pos = torch.arange(P, device=key.device)
    first = torch.ones(P, dtype=torch.bool, device=key.device)
    first[1:] = sorted_e[1:] != sorted_e[:-1]
    run_start = torch.where(first, pos, 0).cummax(0).values
    counts = torch.zeros(experts + 1, dtype=torch.long, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    run_end = run_start + counts[sorted_e]
    leader = ((pos - run_start) % BM == 0) & (sorted_e < experts)
    bound = chunk_bound(P, BM, experts)
    idx = torch.where(leader, leader.cumsum(0) - 1, bound)
    table = torch.zeros(3, bound + 1, dtype=torch.int32, device=key.device)
    table.scatter_(1, idx.expand(3, P), torch.stack([pos, (run_end - pos).clamp(max=BM), sorted_e]).int())
    slot_pos = torch.empty_like(order).scatter_(0, order, pos)
    chunks = (table[0], table[1], table[2], leader.sum().int().reshape(1), bound)
    return Routing((order // top_k).int(), sorted_e.int(), slot_pos.int(), local.int(), chunks)


def aligned_rows(rows: int, n: int, device) -> torch.Tensor:
    """(rows, n) int32 whose rows each start 64-byte aligned: Triton specializes a kernel on each pointer's 16-byte
    alignment, and rows at offsets that vary with n would compile new variants while a server runs."""
    return torch.empty(rows, -(-n // 16) * 16, dtype=torch.int32, device=device)[:, :n]


def small_route(topk_ids, experts, BM, expert_map) -> tuple:
    """route_small's outputs, allocated: (the Routing they make, the kernel's arguments, its constexprs), for
    route_small itself or a launch that routes in one of its programs (triton_rotate.route_rotate)."""
    import triton
    P, dev = topk_ids.numel(), topk_ids.device
    bound = chunk_bound(P, BM, experts)
    out = aligned_rows(4, P, dev)  # rows, sorted_expert, slot_pos, slot_expert
    table = aligned_rows(3, bound + 1, dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.contiguous()
    args = (ids, expert_map if expert_map is not None else ids, out[0], out[1], out[2], out[3], table, count, P,
            experts, table.stride(0))
    meta = dict(TOPK=topk_ids.shape[1], BM=BM, PB=max(16, triton.next_power_of_2(P)), HAS_MAP=expert_map is not None)
    return Routing(out[0], out[1], out[2], out[3], (table[0], table[1], table[2], count, bound)), args, meta


def _route_small(topk_ids, experts, BM, expert_map) -> Routing:
    from .triton_route import route_small
    r, args, meta = small_route(topk_ids, experts, BM, expert_map)
    route_small[(1,)](*args, **meta, num_warps=8)
    return r


def _route_counted(topk_ids, experts, BM, expert_map) -> Routing:
    """route() as a counting sort in two Triton launches (route_counts, route_scatter): a torch sort cost prefill
    calls run back to back much host time ahead of their one synchronization (docs/kernels.md)."""
    import triton
    from .triton_route import route_counts, route_scatter
    P, dev = topk_ids.numel(), topk_ids.device
    BP, EB = 1024, triton.next_power_of_2(experts + 2)
    blocks = triton.cdiv(P, BP)
    bound = chunk_bound(P, BM, experts)
    ids = topk_ids.contiguous()
    emap = expert_map if expert_map is not None else ids
    hist = torch.empty(blocks, EB, dtype=torch.int32, device=dev)
    out = aligned_rows(4, P, dev)  # rows, sorted_expert, slot_pos, slot_expert
    table = aligned_rows(3, bound + 1, dev)
    runs = torch.empty(2 * experts + 1, dtype=torch.int32, device=dev)  # starts, ends, the chunk count
    count = runs[2 * experts:]
    has_map = expert_map is not None
    route_counts[(blocks,)](ids, emap, hist, P, experts, HAS_MAP=has_map, BP=BP, EB=EB, num_warps=4)
    route_scatter[(blocks,)](ids, emap, hist, out[0], out[1], out[2], out[3], table, runs, count, P,
                             experts, blocks, table.stride(0), TOPK=topk_ids.shape[1], BM=BM, HAS_MAP=has_map,
                             BP=BP, EB=EB, num_warps=8)
    return Routing(out[0], out[1], out[2], out[3], (table[0], table[1], table[2], count, bound),
                   runs[:2 * experts].view(2, experts))


def expected_experts(slots: int, experts: int) -> int:
    """Distinct experts that `slots` (token, k) pairs pick under uniform routing: what launches are planned for,
    as the real count is known only on the device."""
    return max(1, round(experts * (1 - (1 - 1 / experts) ** slots)))
