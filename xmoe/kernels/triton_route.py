"""One-launch routing for decode sizes: the slots (token, k) sorted by local expert and cut into chunks, as
routing.route does with a dozen torch kernels. A few microseconds of launch each are a large share of a decode
step, so for up to routing.ROUTE_SLOTS slots one program compares every slot with every other instead."""
import triton
import triton.language as tl


@triton.jit
def route_small(ids_ptr, emap_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, slot_expert_ptr, table_ptr,
                count_ptr, P, E, stride_table, TOPK: tl.constexpr, BM: tl.constexpr, PB: tl.constexpr,
                HAS_MAP: tl.constexpr):
    """Slot i (token i // TOPK) of local expert key_i (E: another rank's) goes to sorted position rank_i, stable
    in i; runs of one expert are cut every BM positions into chunks (pos, len, expert) in sorted order."""
    i = tl.arange(0, PB)
    valid = i < P
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(emap_ptr + e, mask=valid, other=-1).to(tl.int32)
    key = tl.where(valid, tl.where(e >= 0, e, E), E + 1)  # padding sorts last
    same = key[None, :] == key[:, None]  # [i, j]
    earlier = i[None, :] < i[:, None]
    lt = tl.sum((key[None, :] < key[:, None]).to(tl.int32), axis=1)
    before = tl.sum((same & earlier).to(tl.int32), axis=1)  # slots of the same expert ahead of i
    run = tl.sum(same.to(tl.int32), axis=1)
    rank = lt + before
    ours = valid & (key < E)
    tl.store(slot_pos_ptr + i, rank, mask=valid)
    tl.store(slot_expert_ptr + i, tl.where(key < E, key, -1), mask=valid)
    tl.store(rows_ptr + rank, i // TOPK, mask=valid)
    tl.store(sorted_expert_ptr + rank, key, mask=valid)
    leader = ours & (before % BM == 0)
    chunk = tl.sum((leader[None, :] & (rank[None, :] < rank[:, None])).to(tl.int32), axis=1)
    tl.store(table_ptr + chunk, rank, mask=leader)
    tl.store(table_ptr + stride_table + chunk, tl.minimum(run - before, BM), mask=leader)
    tl.store(table_ptr + 2 * stride_table + chunk, key, mask=leader)
    tl.store(count_ptr, tl.sum(leader.to(tl.int32), axis=0))


@triton.jit
def route_bounds(sorted_ptr, info_ptr, count_ptr, P, E, steps, BM: tl.constexpr, EB: tl.constexpr):
    """For the slots sorted by expert (sorted_ptr, ascending; E for other ranks'), one program finds each local
    expert's run [start, end) by binary search and numbers its chunks of BM rows: info = (start, end, index of
    the first chunk), count = all chunks."""
    e = tl.arange(0, EB)
    lo, hi = tl.zeros([EB], tl.int32), tl.zeros([EB], tl.int32) + P  # lower bound of e
    lo2, hi2 = tl.zeros([EB], tl.int32), tl.zeros([EB], tl.int32) + P  # upper bound of e
    for _ in range(steps):
        mid = (lo + hi) // 2
        below = tl.load(sorted_ptr + mid, mask=mid < hi, other=0) < e
        lo, hi = tl.where((mid < hi) & below, mid + 1, lo), tl.where((mid < hi) & ~below, mid, hi)
        mid = (lo2 + hi2) // 2
        below = tl.load(sorted_ptr + mid, mask=mid < hi2, other=0) <= e
        lo2, hi2 = tl.where((mid < hi2) & below, mid + 1, lo2), tl.where((mid < hi2) & ~below, mid, hi2)
    ours = e < E
    per = tl.where(ours, (lo2 - lo + BM - 1) // BM, 0)
    tl.store(info_ptr + e, lo, mask=ours)
    tl.store(info_ptr + E + e, lo2, mask=ours)
    tl.store(info_ptr + 2 * E + e, tl.cumsum(per, 0) - per, mask=ours)
    tl.store(count_ptr, tl.sum(per, 0))


@triton.jit
def route_positions(order_ptr, sorted_ptr, info_ptr, rows_ptr, sorted_expert_ptr, slot_pos_ptr, table_ptr, P, E,
                    stride_table, TOPK: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr):
    """Per sorted position p (slot order[p] of expert sorted[p]): its token, its expert, the inverse permutation,
    and, where p starts a chunk, the chunk's (pos, len, expert) at the index route_bounds gave it."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    live = p < P
    slot = tl.load(order_ptr + p, mask=live, other=0).to(tl.int32)
    e = tl.load(sorted_ptr + p, mask=live, other=E).to(tl.int32)
    tl.store(rows_ptr + p, slot // TOPK, mask=live)
    tl.store(sorted_expert_ptr + p, e, mask=live)
    tl.store(slot_pos_ptr + slot, p, mask=live)
    ours = live & (e < E)
    start = tl.load(info_ptr + e, mask=ours, other=0)
    lead = ours & ((p - start) % BM == 0)
    chunk = tl.load(info_ptr + 2 * E + e, mask=lead, other=0) + (p - start) // BM
    tl.store(table_ptr + chunk, p, mask=lead)
    tl.store(table_ptr + stride_table + chunk, tl.minimum(tl.load(info_ptr + E + e, mask=lead, other=0) - p, BM),
             mask=lead)
    tl.store(table_ptr + 2 * stride_table + chunk, e, mask=lead)


@triton.jit
def hot_experts(runs_ptr, flags_ptr, ids_ptr, table_ptr, counts_ptr, E, rows, rest, stride_runs, stride_table,
                BM: tl.constexpr, G: tl.constexpr, EB: tl.constexpr, GB: tl.constexpr):
    """The call's dense experts from their runs (runs_ptr: first and end sorted position a local expert): those
    of at least `rows` rows, or every expert with rows where at most `rest` others are left. flags (E + 1: the
    last, other ranks' slots, 0); ids, the dense experts ascending, cut into groups of G; table (pos, length,
    slot): each one's chunks of at most BM rows, in order, slot its index in its group, so that each group's
    chunks are one contiguous run; counts: (dense experts, all dense, chunks of each of GB groups)."""
    e = tl.arange(0, EB)
    ours = e < E
    start = tl.load(runs_ptr + e, mask=ours, other=0)
    length = tl.load(runs_ptr + stride_runs + e, mask=ours, other=0) - start
    hot = (length >= rows) & (length > 0)
    left = (length > 0) & ~hot
    every = tl.sum(left.to(tl.int32), 0) <= rest
    dense = tl.where(hot | (left & every), 1, 0)
    hot = dense != 0
    rank = tl.cumsum(dense, 0) - dense
    chunks = tl.where(hot, (length + BM - 1) // BM, 0)
    first = tl.cumsum(chunks, 0) - chunks
    tl.store(flags_ptr + e, dense, mask=e <= E)
    tl.store(ids_ptr + rank, e, mask=hot)
    for j in range(0, tl.max(chunks, 0)):
        live = j < chunks
        tl.store(table_ptr + first + j, start + j * BM, mask=live)
        tl.store(table_ptr + stride_table + first + j, tl.minimum(length - j * BM, BM), mask=live)
        tl.store(table_ptr + 2 * stride_table + first + j, rank % G, mask=live)
    group = tl.arange(0, GB)
    mine = ((rank // G)[None, :] == group[:, None]) & hot[None, :]
    tl.store(counts_ptr + 2 + group, tl.sum(tl.where(mine, chunks[None, :], 0), 1))
    tl.store(counts_ptr, tl.sum(dense, 0))
    tl.store(counts_ptr + 1, every.to(tl.int32))
